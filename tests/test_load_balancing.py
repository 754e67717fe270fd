"""engine.load_balancing: hivemind's all-reduce split without scipy, checked against hivemind's own
linear program (scipy's solver) on random groups, and kept out of the worker's imports."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dedloc_core.engine import load_balancing as ours

ROOT = Path(__file__).resolve().parent.parent


def hivemind_original():
    import hivemind.averaging

    path = Path(hivemind.averaging.__file__).with_name("load_balancing.py")
    spec = importlib.util.spec_from_file_location("hivemind_load_balancing_original", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_time(parts, bandwidths):
    """The program's objective: max over serving peers of (1 + (n - 2) w_i) / b_i."""
    n, size = len(parts), sum(parts)
    return max((1 + (n - 2) * p / size) / b for p, b in zip(parts, bandwidths, strict=True) if b > 0)


@pytest.mark.filterwarnings("ignore")  # scipy's interior-point solver warns as it converges
def test_the_split_is_as_fast_as_hiveminds_linear_program():
    original = hivemind_original()
    rng = random.Random(7)
    exact = 0
    for _ in range(300):
        n = rng.randint(1, 9)
        bandwidths = [rng.choice([0.0, rng.uniform(1, 200)]) for _ in range(n)]
        if not any(bandwidths):
            bandwidths[0] = 50.0
        size = rng.randint(10_000, 3_000_000)
        theirs = original.load_balance_peers(size, bandwidths)
        mine = ours.load_balance_peers(size, bandwidths)
        assert sum(mine) == size and all(p >= 0 for p in mine), (bandwidths, mine)
        assert all(p == 0 for p, b in zip(mine, bandwidths, strict=True) if b == 0), "a client-only peer got a part"
        assert round_time(mine, bandwidths) <= round_time(theirs, bandwidths) * (1 + 1e-4), (bandwidths, mine, theirs)
        exact += all(abs(a - b) <= size * 1e-4 for a, b in zip(mine, theirs, strict=True))
    assert exact > 50  # where the program has one optimum both find it (the rest: a slow peer bounds it)


def test_known_splits_and_edge_cases():
    assert ours.load_balance_peers(1000, [3.0, 2.0, 1.0, 1.0]) == (700, 300, 0, 0)
    assert ours.load_balance_peers(1000, [10.0, 10.0, 10.0, 10.0, 100.0]) == (0, 0, 0, 0, 1000)
    assert ours.load_balance_peers(1000, [100.0, 50.0]) == (500, 500)  # two peers: any split is as fast
    assert ours.load_balance_peers(1000, [None, 0.0, None]) == (500, 0, 500)  # no bandwidth given: equal
    assert ours.load_balance_peers(1000, [None, 60.0, 60.0]) == (334, 333, 333)  # None: the mean
    # a peer whose part would be under min_size gets none; the others take it
    assert ours.load_balance_peers(1000, [100.0, 100.0, 90.0])[2] > 200
    assert ours.load_balance_peers(1000, [100.0, 100.0, 90.0], min_size=300)[2] == 0
    with pytest.raises(ValueError):
        ours.load_balance_peers(1000, [0.0, 0.0])


def test_the_worker_imports_no_scipy_and_hivemind_uses_this_split():
    code = (
        "import sys\n"
        "import dedloc_core.engine.worker, dedloc_core.engine.training, dedloc_core.engine.swarm\n"
        "from hivemind.averaging import averager\n"
        "print(averager.load_balance_peers.__module__, any(m.split('.')[0] == 'scipy' for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["dedloc_core.engine.load_balancing", "False"], out.stdout
