"""The upstream code our hivemind extensions are written against has not changed: for every
function or method an extension replaces whole or depends on line by line (and what
``swarm.RoundCountingOptimizer``, ``load_balancing`` and ``no_dynamo`` are written against), the
sha256 of its source equals the one stored in ``hivemind_ext/fingerprints.json``. After a hivemind
(or torch) upgrade a failure names the extensions to re-read; once they are, store the new
fingerprints with ``python -m dedloc_core.engine.hivemind_ext.fingerprints --write``.

The fingerprints are computed in a fresh interpreter that never installs the extensions (they
replace much of what is hashed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from probes import ROOT

COMPUTE = """
import json
from dedloc_core.engine.hivemind_ext import fingerprints
print(json.dumps(fingerprints.compute()))
"""


def test_the_upstream_code_the_extensions_depend_on_is_unchanged():
    out = subprocess.run([sys.executable, "-c", COMPUTE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DEDLOC_HELPER_THREADS": "none"})
    assert out.returncode == 0, out.stderr[-3000:]
    now = json.loads(out.stdout.strip().splitlines()[-1])
    from dedloc_core.engine.hivemind_ext import fingerprints

    stored = json.loads(fingerprints.STORED.read_text())["fingerprints"]
    changed = fingerprints.changed(stored, now)
    assert not changed, "upstream code changed under our hivemind extensions:\n  " + "\n  ".join(changed)


def test_every_extension_says_what_upstream_code_it_depends_on():
    from dedloc_core.engine import hivemind_ext

    stored = json.loads((ROOT / "dedloc_core/engine/hivemind_ext/fingerprints.json").read_text())
    assert stored["hivemind"] == hivemind_ext.HIVEMIND_VERSION
    users = {name for entry in stored["fingerprints"].values() for name in entry["used_by"]}
    # fork_above_loop wraps multiprocessing's start, not hivemind's code
    assert users >= set(hivemind_ext.ORDER) - {"fork_above_loop"}, set(hivemind_ext.ORDER) - users
