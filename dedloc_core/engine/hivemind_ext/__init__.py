"""Our extensions of hivemind 1.1.12: named fixes and hooks, installed in one ordered list.

Each module changes one thing in hivemind and says in its docstring which upstream file and
functions it touches, what goes wrong without it, the fix, and whether it is a bug fix that
belongs upstream (its patch against hivemind's source is in ``docs/hivemind/``) or our policy.
Call ``install()`` once in a process, before creating a DHT (``swarm.prepare_process`` does).

The code is organized as follows, in install order:

- ``child_lifetime``: every forked helper and ``p2pd`` dies with its parent (PR_SET_PDEATHSIG).
- ``one_write``: a daemon message's length and body go in one write.
- ``stream_end``: a stream's handler closes only after its caller has read every answer.
- ``bandwidth_caps``: upload and download caps paced on the p2p streams and calls.
- ``traffic_count``: bytes sent and received by this peer (``traffic()``), around the caps.
- ``codecs_numpy2``: hivemind's 8-bit codecs decode under NumPy 2.
- ``relay_policy``: no relay for strangers (the backbone opts in); extra p2pd flags.
- ``task_references``: tasks and awaited MPFutures stay alive until done.
- ``robust_reduce``: non-finite parts dropped, centered clip, banned peers shunned.
- ``partial_rounds``: a partial all-reduce is a failed round; our own reducer never hangs us.
- ``verified_reduce``: every peer checks each reducer's average before applying it.
- ``invite_gate``: averagers of an invite-only experiment deal only with invited peers.
- ``state_records``: the state-sharing record is renewed at half life, stored only when due.
- ``step_cancel``: a cancelled step reads cancelled before the averager hears of it.
- ``no_rerun``: a step whose all-reduce began is not retried, but once among a lost reducer's survivors.
- ``leader_poll``: matchmaking fetches a group's averagers at a pace.
- ``optimizer_init``: the zero step that creates the optimizer's statistics counts no step.
- ``replica_sockets``: an averager shuts its P2P replica down (no socket file left).
- ``leave_drain``: a leaving averager first sends the averages it still owes.
- ``dht_orphans``: the DHT drops a request from a process that has gone.
- ``nearest_cache``: a store goes to the nodes the key's last store found; its search brings no record.
- ``socket_dir``: unix sockets in the supervisor's folder (``DEDLOC_SOCKET_DIR``).
- ``optimizer_client_mode``: an Optimizer's ``client_mode`` is the one it is given.
- ``helper_threads``: a switch (off by default): the DHT, or all helpers, as threads.
- ``fork_above_loop``: helpers fork from a thread above the idle training loop.
- ``fingerprints``: hashes of the upstream code these depend on (``tests/test_hivemind_fingerprints.py``).

``WRAPS`` states which extension wraps what another one installed (so that one goes first);
``install`` checks ``ORDER`` against it. ``install`` refuses any hivemind but ``HIVEMIND_VERSION``
(``HivemindVersionError``) before it changes anything.

Each extension's failure without it (all the others installed, unless noted) and its fix with
it, both shown by probes in fresh interpreters, in ``tests/``:

    child_lifetime         test_hivemind_ext_guard    state_records          test_hivemind_ext
    one_write              test_hivemind_ext          step_cancel            test_hivemind_ext
    bandwidth_caps         test_bandwidth             no_rerun               test_hivemind_ext (slow)
    traffic_count          with only (test_bandwidth) leader_poll            test_hivemind_ext
    codecs_numpy2          test_diloco                optimizer_init         test_optimizer_init
    relay_policy           test_reachability          replica_sockets        test_replica_sockets
    task_references        test_hivemind_ext          dht_orphans            test_dht_orphans
    robust_reduce          test_robust (slow, none)   nearest_cache          test_hivemind_ext
    partial_rounds         test_robust (slow, none)   socket_dir             test_hivemind_ext_guard
    invite_gate            test_invite_swarm (slow)   optimizer_client_mode  test_hivemind_ext_guard
    helper_threads         test_helper_threads        fork_above_loop        test_loop_priority
    verified_reduce        test_verified_reduce (slow) leave_drain           test_leave_drain (slow, root)
    stream_end             test_stream_end

"(none)": the without probe installs no extension at all; invite_gate's turns the gate off.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping, Sequence

from dedloc_core.errors import DedlocError

from .leader_poll import LEADER_POLL_SECONDS
from .nearest_cache import NEAREST_TTL
from .relay_policy import RELAY_HOP, p2pd_options, relay_service, set_p2pd_options, set_relay_service
from .traffic_count import traffic

__all__ = [
    "HIVEMIND_VERSION", "LEADER_POLL_SECONDS", "NEAREST_TTL", "ORDER", "RELAY_HOP", "WRAPS",
    "HivemindVersionError", "check_order", "install", "installed", "p2pd_options", "relay_service",
    "set_p2pd_options", "set_relay_service", "traffic",
]

HIVEMIND_VERSION = "1.1.12"  # the hivemind every extension was written against, read line by line

ORDER: tuple[str, ...] = (
    "child_lifetime",
    "one_write",
    "stream_end",
    "bandwidth_caps",
    "traffic_count",
    "codecs_numpy2",
    "relay_policy",
    "task_references",
    "robust_reduce",
    "partial_rounds",
    "verified_reduce",
    "invite_gate",
    "state_records",
    "step_cancel",
    "no_rerun",
    "leader_poll",
    "optimizer_init",
    "replica_sockets",
    "leave_drain",
    "dht_orphans",
    "nearest_cache",
    "socket_dir",
    "optimizer_client_mode",
    "helper_threads",
    "fork_above_loop",
)

# a wraps what b installed on the same attribute: b is installed first
WRAPS: dict[str, str] = {
    "traffic_count": "bandwidth_caps",  # P2P.receive_raw_data and the unary calls: counters around the pacing
    "invite_gate": "robust_reduce",  # Matchmaking._request_join_group: the token check outside the ban check
    "fork_above_loop": "helper_threads",  # DHT.start, DecentralizedAverager.start: whichever start is there
    "verified_reduce": "partial_rounds",  # AllReduceRunner.run: the check sees only whole rounds
    "leave_drain": "replica_sockets",  # DecentralizedAverager._shutdown: the drain before the handlers go
}

_installed: tuple[str, ...] | None = None


class HivemindVersionError(DedlocError):
    """The installed hivemind is not the one the extensions were written for."""

    title = "Unsupported hivemind version"
    hint = (f"Install hivemind {HIVEMIND_VERSION} (pip install hivemind=={HIVEMIND_VERSION}), or reinstall "
            "DeDLOC Volunteer, whose installer brings it.")


def check_order(order: Sequence[str] = ORDER, wraps: Mapping[str, str] = WRAPS) -> None:
    """Raise ``ValueError`` unless every extension comes after the one it wraps."""
    position = {name: i for i, name in enumerate(order)}
    for outer, inner in wraps.items():
        if outer not in position or inner not in position:
            raise ValueError(f"hivemind_ext: {outer} wraps {inner}, but the install order lacks one of them")
        if position[outer] < position[inner]:
            raise ValueError(f"hivemind_ext: {outer} wraps {inner}, so {inner} must be installed first")


def check_version() -> None:
    """Raise ``HivemindVersionError`` unless the installed hivemind is ``HIVEMIND_VERSION``."""
    import hivemind

    found = getattr(hivemind, "__version__", "unknown")
    if found != HIVEMIND_VERSION:
        raise HivemindVersionError(
            f"hivemind {found} is installed, but DeDLOC Volunteer's changes to hivemind were written for "
            f"hivemind {HIVEMIND_VERSION} and depend on its code line by line; none was applied.",
            code="hivemind_version")


def install(skip: Collection[str] = ()) -> None:
    """Install every extension in ``ORDER`` (once a process; a second call does nothing).
    ``skip``: extensions left out, for tests that show what goes wrong without one."""
    global _installed
    if _installed is not None:
        return
    unknown = set(skip) - set(ORDER)
    if unknown:
        raise ValueError(f"hivemind_ext: no extension named {sorted(unknown)}")
    check_order()
    check_version()
    names = tuple(name for name in ORDER if name not in skip)
    _installed = names
    for name in names:
        importlib.import_module(f"{__name__}.{name}").install()


def installed() -> tuple[str, ...]:
    """The extensions installed in this process, in order (empty before ``install``)."""
    return _installed or ()
