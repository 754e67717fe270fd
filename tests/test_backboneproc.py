"""``BackboneProcess``: a backbone that cannot start says why, with the end of its log."""

from __future__ import annotations

import os

import pytest

from dedloc_core.backboneproc import BackboneProcess
from dedloc_core.errors import DedlocError
from dedloc_core.proctree import StopResult

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast


def test_a_backbone_that_exits_before_it_is_up_is_an_error_with_its_log(tmp_path):
    (tmp_path / "backbone").mkdir()
    (tmp_path / "backbone" / "ready.json").write_text("{}")  # an earlier run's: not taken for this one's
    backbone = BackboneProcess(["--experiment", "no-such-experiment"], tmp_path / "backbone",
                               tmp_path / "backbone.log", env={**os.environ, "DEDLOC_HOME": str(tmp_path / "home")})
    with pytest.raises(DedlocError) as caught:
        backbone.start(timeout=60)
    assert caught.value.code == "backbone_not_ready"
    assert "exited" in caught.value.message and "no-such-experiment" in caught.value.message
    assert not backbone.running() and backbone.maddrs == [] and backbone.stop() is StopResult.NOT_RUNNING
