"""Fingerprints of the upstream code our extensions replace whole or depend on line by line.

For each upstream function or method named in an extension's ``REPLACES`` (and in ``OUTSIDE``: the
hivemind and torch code that other engine modules are written against), the sha256 of its
``inspect.getsource``, stored in ``fingerprints.json`` beside this module. When hivemind (or torch)
changes, ``tests/test_hivemind_fingerprints.py`` names the extensions to re-read.

Compute on unpatched code only (a fresh interpreter that has not called ``install``)::

    python -m dedloc_core.engine.hivemind_ext.fingerprints --write   # store the current ones
    python -m dedloc_core.engine.hivemind_ext.fingerprints           # print what changed (JSON)
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

STORED = Path(__file__).with_name("fingerprints.json")
SWARM = Path(__file__).resolve().parents[1] / "swarm.py"

# Upstream code written against outside this package: who depends on it, and what.
OUTSIDE: dict[str, list[str]] = {
    # swarm.RoundCountingOptimizer: its overrides of hivemind.Optimizer's methods (read from
    # swarm.py, see round_counting_overrides) and the step that calls them
    "swarm.RoundCountingOptimizer": ["hivemind.optim.optimizer.Optimizer.step"],
    # load_balancing: serves hivemind.averaging.load_balancing in its place (sys.modules)
    "load_balancing": ["file:hivemind/averaging/load_balancing.py"],
    # no_dynamo: torch.optim calls only graph_break and, through torch._compile, disable
    "no_dynamo": ["torch.optim.optimizer._use_grad_for_differentiable", "torch._compile._disable_dynamo"],
    # quant4: its codec is found by its wire type's name in _BASE_COMPRESSION_TYPES, both ways
    "quant4": ["hivemind.compression.serialization.serialize_torch_tensor",
               "hivemind.compression.serialization.deserialize_torch_tensor"],
}


def round_counting_overrides() -> list[str]:
    """hivemind.Optimizer's methods that ``RoundCountingOptimizer`` (swarm.py) overrides, read from
    the source (importing swarm would build nothing, but it need not be importable to be read)."""
    from hivemind.optim.optimizer import Optimizer

    for node in ast.parse(SWARM.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "RoundCountingOptimizer":
            names = [f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            return [f"hivemind.optim.optimizer.Optimizer.{name}" for name in names if name in vars(Optimizer)]
    return []


def users() -> dict[str, list[str]]:
    """Each upstream name, and the extensions (or engine modules) that depend on it."""
    from dedloc_core.engine import hivemind_ext

    found: dict[str, list[str]] = {}
    for name in hivemind_ext.ORDER:
        for target in importlib.import_module(f"{hivemind_ext.__name__}.{name}").REPLACES:
            found.setdefault(target, []).append(name)
    outside = {**OUTSIDE}
    outside["swarm.RoundCountingOptimizer"] = [*round_counting_overrides(), *OUTSIDE["swarm.RoundCountingOptimizer"]]
    for user, targets in outside.items():
        for target in targets:
            found.setdefault(target, []).append(user)
    return dict(sorted(found.items()))


def resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes (a
    property is its getter)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:]):
            owner = obj
            obj = inspect.getattr_static(owner, attr) if i == len(parts) - cut - 1 else getattr(owner, attr)
        if isinstance(obj, property):
            obj = obj.fget
        if isinstance(obj, staticmethod | classmethod):
            obj = obj.__func__
        return obj
    raise ImportError(dotted)


def source(target: str) -> str:
    if target.startswith("file:"):  # a whole file, read without importing it
        package, _, rest = target[len("file:"):].partition("/")
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations
        return (Path(next(iter(spec.submodule_search_locations))) / rest).read_text()
    return inspect.getsource(resolve(target))


def compute() -> dict[str, dict]:
    """``{upstream name: {"sha256": ..., "used_by": [...]}}`` for the code as installed now."""
    from dedloc_core.engine import hivemind_ext

    if hivemind_ext.installed():
        raise RuntimeError("fingerprints are of upstream code: compute them before hivemind_ext.install()")
    out = {}
    for target, used_by in users().items():
        try:
            digest = hashlib.sha256(source(target).encode()).hexdigest()
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            digest = f"missing: {type(exc).__name__}: {exc}"
        out[target] = {"sha256": digest, "used_by": used_by}
    return out


def changed(stored: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """One line per upstream name whose fingerprint differs (or that one side lacks)."""
    lines = []
    for target in sorted(set(stored) | set(now)):
        old, new = stored.get(target), now.get(target)
        if old is None:
            lines.append(f"{target}: no stored fingerprint (used by {', '.join(new['used_by'])}): run --write")
        elif new is None:
            lines.append(f"{target}: no longer used by any extension (used by {', '.join(old['used_by'])}): "
                         "run --write")
        elif old["sha256"] != new["sha256"]:
            lines.append(f"{target} changed upstream: re-read {', '.join(new['used_by'])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import hivemind

    args = sys.argv[1:] if argv is None else argv
    now = compute()
    if "--write" in args:
        document = {"hivemind": hivemind.__version__, "fingerprints": now}
        STORED.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(now)} fingerprints to {STORED}")
        return 0
    stored = json.loads(STORED.read_text())["fingerprints"]
    print(json.dumps({"hivemind": hivemind.__version__, "changed": changed(stored, now)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
