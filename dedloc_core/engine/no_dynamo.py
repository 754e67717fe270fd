"""torch.optim without torch._dynamo, unless something asks for more of it.

torch.optim imports ``torch._dynamo`` (torch.compile's tracer) the first time an optimizer is built
or stepped, only to call two functions that do nothing outside ``torch.compile``: ``graph_break()``
around every ``step`` and ``disable(fn)`` on ``zero_grad``, ``state_dict`` and the like. The import
costs 1.3 s of CPU and 75 MiB of memory per process (measured on the 2-core dev VM); the worker,
its DHT and its averagers never compile. ``install()`` puts a stand-in module in its place that
has those two functions; any other name or submodule asked of it imports the real module, which
then replaces the stand-in (``torch._dynamo.config``, ``torch.compile`` and the like still work).
"""

from __future__ import annotations

import importlib
import sys
import threading
import types

NAME = "torch._dynamo"


class _StandIn(types.ModuleType):
    """``torch._dynamo`` until something needs more than ``graph_break`` and ``disable``."""

    @staticmethod
    def graph_break(msg: str = "") -> None:
        """The real one does nothing either when not tracing."""

    @staticmethod
    def disable(fn=None, recursive: bool = True, *, reason=None, wrapping: bool = True):
        """Outside torch.compile a disabled function runs as it is."""
        if fn is None:
            return lambda f: f
        return fn

    def __getattr__(self, name: str):
        if name.startswith("__") and name not in ("__path__", "__all__"):
            raise AttributeError(name)
        return getattr(real(), name)


def install() -> None:
    """Put the stand-in in place if torch._dynamo is not imported yet (call after ``import torch``)."""
    if NAME in sys.modules:
        return
    import torch

    stand_in = _StandIn(NAME, __doc__)
    sys.modules[NAME] = stand_in
    torch._dynamo = stand_in


def real() -> types.ModuleType:
    """Import the real torch._dynamo in the stand-in's place and return it. From any thread: one
    that asks while another imports it waits for the whole module (importlib's module lock), not a
    half-initialized one from ``sys.modules``."""
    with _swap:
        if isinstance(sys.modules.get(NAME), _StandIn):
            import torch

            del sys.modules[NAME]
            if isinstance(torch.__dict__.get("_dynamo"), _StandIn):
                del torch._dynamo
    return importlib.import_module(NAME)


_swap = threading.Lock()


def installed() -> bool:
    """Whether the stand-in still holds torch._dynamo's place."""
    return isinstance(sys.modules.get(NAME), _StandIn)
