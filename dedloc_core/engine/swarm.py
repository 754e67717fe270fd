"""Building a hivemind DHT and Optimizer for one experiment (used by the worker and the backbone).

Facts from ../shared/DESIGN.md that shape this module: the Optimizer must be built in the main
thread of a process started by fork; ``client_mode`` must be passed to both the DHT and the
Optimizer; ``averager_opts`` reach only the state averager.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import Float16Compression, NoCompression
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.logging import use_hivemind_log_handler

from . import hivemind_ext, no_dynamo, prefetch, progress_digest

no_dynamo.install()  # torch.optim's import of torch._dynamo: 1.3 s of CPU and 75 MiB, for two no-ops

logger = logging.getLogger(__name__)


@dataclass
class SwarmConfig:
    run_id: str
    target_batch_size: int
    batch_size_per_step: int
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    # created by this session: no other peer can hold it, so hivemind's check that it is free (a second
    # p2pd that asks the swarm for this peer id, seconds on a slow link) is skipped
    identity_is_new: bool = False
    client_mode: bool = False
    # use the DHT without serving it (the backbones and peers that serve it do), still taking averaging
    # connections: a volunteer's helpers then use about 0.01 of a core less (bench/swarm_netlab.py).
    # Only with initial peers (someone must serve it); an outbound-only peer is a client anyway
    dht_client: bool = False
    matchmaking_time: float = 3.0
    averaging_timeout: float = 30.0
    load_state_timeout: float = 60.0
    bandwidth: float | None = None
    # how often peers fetch progress (seconds): hivemind's 0.5-10 s cost CPU; as the step's end nears
    # a fetch comes every half of the time left, at least this far apart
    min_refresh_period: float = 2.0
    max_refresh_period: float = 10.0
    default_refresh_period: float = 3.0
    # how often a peer publishes its progress while accumulating (seconds); hivemind publishes after
    # every micro-batch (a signed DHT store each time); a new epoch is still published at once. The
    # records carry samples/s, which the other peers extrapolate between them; at 1 s they were most
    # of each node's DHT traffic (a search and a store on every node, from every peer); at 6 s, with the
    # fetches above, a volunteer's DHT process takes about 0.009 cores where it took 0.011 at 3 s
    progress_report_period: float = 6.0
    # how to be reachable (see reachability.join): "auto" asks the backbone to dial back and falls
    # back to its relay, then to client mode; or force "direct", "relay" or "outbound"
    reachability: str = "auto"
    # serve as a libp2p circuit relay for other peers: the backbone only (hivemind_ext.relay_policy)
    relay_service: bool = False
    grad_compression: str = "fp16"  # "none", "fp16" or "8bit" (hivemind's Uniform8BitQuantization)
    # DeDLOC's delayed updates: a global step's gradient all-reduce and optimizer step run in the
    # background while the next accumulation computes; the result is applied one step late
    overlap: bool = False
    average_state_every: int = 1  # epochs between parameter averaging rounds (hivemind: 1)
    # an invite-only experiment's DHT authorizer (gate.InviteAuthorizer), None for open ones
    authorizer: object | None = None


ROLES = ("volunteer", "backbone")


def config_for(exp, *, role: str = "volunteer", **fields) -> SwarmConfig:
    """The ``SwarmConfig`` of experiment ``exp`` (a ``catalog.Experiment``) for a volunteer or the
    backbone. What the catalog says reaches both; ``fields``: this peer's own (addresses, identity,
    initial peers, limits) and overrides of the catalog's values (a worker's batch size)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    backbone = role == "backbone"
    cfg = dict(
        run_id=exp.run_id,
        target_batch_size=exp.target_batch_size,
        batch_size_per_step=exp.batch_size_per_step,
        # the catalog's initial peers are the backbones themselves: a backbone joins the ones it is told
        initial_peers=[] if backbone else list(exp.initial_peers),
        matchmaking_time=exp.matchmaking_time,
        averaging_timeout=exp.averaging_timeout,
        average_state_every=exp.average_state_every,
        # The keeper never steps, so delayed updates have nothing to delay; and with them hivemind
        # offloads the optimizer onto a copy of the parameters, which is what a peer serves to
        # newcomers, and which a checkpoint restored into the model (keeper.Checkpoint) never reaches.
        overlap=exp.overlap and not backbone,
        # volunteer_dht is the volunteers' part: the backbone always serves the DHT
        dht_client=exp.volunteer_dht == "client" and not backbone,
        # the backbone relays for volunteers behind NAT; volunteers relay for nobody
        relay_service=backbone,
    )
    cfg.update(fields)
    return SwarmConfig(**cfg)


_process_prepared = False
_libc = None


def p2pd_on_one_thread() -> None:
    """A volunteer's p2p daemon runs its Go code on one thread (``GOMAXPROCS=1``, unless set already;
    hivemind starts p2pd with this process's environment). It carries one peer's traffic, a few MB
    a round, and with a thread per core its goroutines woke across threads: in the network lab its
    p2pd used 0.009-0.013 of a node's 0.40 cores, 0.007-0.009 on one thread (one run each). The
    backbone, a relay for many peers, keeps Go's default."""
    os.environ.setdefault("GOMAXPROCS", "1")


def prepare_process() -> None:
    """Process-wide setup before any hivemind object is created.

    hivemind's DHT and averagers are forked processes (``helper_threads`` can make them threads;
    off by default), which inherit the tensors they share with us.
    torch's ``file_descriptor`` sharing strategy serves that without ``torch_shm_manager`` (a
    60-70 MiB process that the default ``file_system`` strategy starts) and leaves nothing in
    /dev/shm. Each shared tensor holds a file descriptor, so the soft limit on open files is raised
    to the hard one (at most 65536). Memory measured with ``bench/overhead.py``.

    For the forked averagers: the worker after building the Optimizer, and every forked child, give
    the free pages of the C heap back to the OS (``malloc_trim``, about 30 MB PSS of a peer's tree),
    and before each fork the objects alive are frozen out of the garbage collector (``gc.freeze``,
    as the Python docs advise for fork without exec): a full collection in the parent or a child
    wrote to every inherited object and copied the whole shared heap, about 70 MB per process,
    minutes into a run (``bench/chaos.py``).
    """
    global _process_prepared
    mp.set_start_method("fork", force=True)
    use_hivemind_log_handler("nowhere")  # hivemind's records propagate to our root logger
    quiet_repeats()
    hivemind_ext.install()
    if _process_prepared:
        return
    _process_prepared = True
    _share_by_file_descriptor()
    _load_libc()
    os.register_at_fork(before=gc.freeze, after_in_child=trim_heap)


def _share_by_file_descriptor() -> None:
    import torch.multiprocessing as torch_mp

    if "file_descriptor" not in torch_mp.get_all_sharing_strategies():
        return  # Windows and macOS have file_system only
    torch_mp.set_sharing_strategy("file_descriptor")
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError) as exc:
        logger.warning("Could not raise the limit on open files (%s): a large model may hit it", exc)


class SayOnce(logging.Filter):
    """Lets the first record that starts with one of ``prefixes`` through, then drops its repeats."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes, self.said = prefixes, set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        prefix = next((p for p in self.prefixes if text.startswith(p)), None)
        if prefix is None:
            return True
        if prefix in self.said:
            return False
        self.said.add(prefix)
        record.msg, record.args = f"{text} (said once; repeats are not logged)", None
        return True


# A lone peer's matchmaking says this every few seconds for as long as nobody else is there.
_REPEATS = {"hivemind.averaging.matchmaking": ("Another look_for_group is already in progress",)}


def quiet_repeats() -> None:
    """Install ``SayOnce`` on hivemind's chattiest loggers (idempotent)."""
    for name, prefixes in _REPEATS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, SayOnce) for f in log.filters):
            log.addFilter(SayOnce(*prefixes))


def _load_libc() -> None:
    global _libc
    try:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        _libc = None


def trim_heap() -> None:
    """Give the free pages of the C heap back to the OS (glibc ``malloc_trim``; no-op elsewhere)."""
    if _libc is not None:
        _libc.malloc_trim(0)


# How long p2pd may take to come up. hivemind's 15 s is too short on a busy computer (several
# workers starting at once on a third of a core take longer): the worker would crash with "Daemon
# failed to start in 15.0 seconds" instead of joining late.
P2PD_STARTUP_SECONDS = 90.0
# p2pd quits at start when it reaches none of its initial peers in time ("failed to connect to
# bootstrap peers"): a backbone busy with many newcomers, a network still coming up. A worker tries
# again this many times, BOOTSTRAP_BACKOFF seconds apart (doubling), before it says the swarm is unreachable.
BOOTSTRAP_TRIES = 3
BOOTSTRAP_BACKOFF = 5.0
BOOTSTRAP_FAILED = "failed to connect to bootstrap peers"


def start_dht(cfg: SwarmConfig, **extra) -> hivemind.DHT:
    """A started DHT; ``extra`` goes to hivemind (and its P2P), e.g. ``client_mode``, ``use_auto_relay``."""
    hivemind_ext.set_relay_service(cfg.relay_service)
    opts = dict(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                announce_maddrs=cfg.announce_maddrs or None, identity_path=cfg.identity_path,
                client_mode=cfg.client_mode, startup_timeout=P2PD_STARTUP_SECONDS)
    if cfg.authorizer is not None:
        opts["authorizer"] = cfg.authorizer
    if cfg.identity_is_new:
        opts["check_if_identity_free"] = False
    opts.update(extra)
    serves_averaging = not opts["client_mode"]
    if cfg.dht_client and cfg.initial_peers and not opts["client_mode"]:
        # p2pd's own (libp2p) DHT stays a server: it is how peers find each other's addresses
        opts.update(client_mode=True, dht_mode="server")
    dht = _start_with_retries(opts)
    dht.dedloc_serves_averaging = serves_averaging
    dht.dedloc_dht_client = serves_averaging and opts["client_mode"]  # serves the DHT if no backbone does
    return dht


def _start_with_retries(opts: dict) -> hivemind.DHT:
    from hivemind.p2p import P2PDaemonError

    for attempt in range(BOOTSTRAP_TRIES):
        try:
            return hivemind.DHT(start=True, **opts)
        except P2PDaemonError as exc:
            if BOOTSTRAP_FAILED not in str(exc) or attempt == BOOTSTRAP_TRIES - 1:
                raise
            wait = BOOTSTRAP_BACKOFF * 2 ** attempt
            logger.warning("p2pd reached none of the initial peers: trying again in %.0f s", wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def averaging_client_mode(dht: hivemind.DHT) -> bool:
    """Whether this peer's averagers take no connections: an outbound-only peer's; not a peer that is
    only a DHT client (``SwarmConfig.dht_client``)."""
    return not getattr(dht, "dedloc_serves_averaging", not dht.client_mode)


def join_swarm(cfg: SwarmConfig, on_start=None) -> tuple[hivemind.DHT, str]:
    """Start the DHT as reachable as this network allows: (dht, "direct" | "via relay" | "outbound only").
    ``on_start(dht)``: called as soon as a DHT is up, before its reachability is known."""
    from hivemind.p2p import P2PDaemonError

    from dedloc_core.errors import WorkerError

    from . import reachability

    try:
        return reachability.join(cfg, start_dht, on_start=on_start)
    except RuntimeError as exc:
        if "bootstrap failed" not in str(exc):
            raise
        # p2pd reached them, their DHTs did not answer: down, or volunteers that only use the DHT
        raise WorkerError(
            "None of the swarm's entry points answered (its initial peers: "
            f"{', '.join(cfg.initial_peers)}).", title="Swarm unreachable", code="swarm_unreachable",
            hint="The experiment's backbone may be down: try again later. A volunteer's address may "
                 "belong to a peer that does not serve the swarm's DHT: give a backbone's.") from exc
    except P2PDaemonError as exc:
        if BOOTSTRAP_FAILED in str(exc):
            raise WorkerError(
                "None of the swarm's entry points could be reached (its initial peers: "
                f"{', '.join(cfg.initial_peers)}).", title="Swarm unreachable", code="swarm_unreachable",
                hint="The experiment's backbone may be down or overloaded, or this computer offline: "
                     "try again later.") from exc
        if "already taken" not in str(exc):
            raise
        raise WorkerError(
            "Another peer in the swarm uses this computer's identity: a second copy of DeDLOC Volunteer "
            "with the same data folder, or a data folder copied from another computer.",
            title="Identity in use", code="identity_taken",
            hint=f"Close the other copy. If the data folder was copied, delete {cfg.identity_path} on "
                 "one of the computers (it gets a new identity).") from exc


def build_optimizer(dht: hivemind.DHT, cfg: SwarmConfig, model: torch.nn.Module, recipe) -> hivemind.Optimizer:
    """A hivemind.Optimizer that averages gradients with the swarm (DeDLOC's large-batch training)."""
    averager_opts = {"request_timeout": 1.0}
    grad_opts: dict = {}
    if cfg.bandwidth is not None:
        averager_opts["bandwidth"] = cfg.bandwidth
        grad_opts["bandwidth"] = cfg.bandwidth
    optimizer = RoundCountingOptimizer(
        dht=dht,
        run_id=cfg.run_id,
        params=model.parameters(),
        optimizer=recipe.build_optimizer,
        scheduler=recipe.build_scheduler,
        target_batch_size=cfg.target_batch_size,
        batch_size_per_step=cfg.batch_size_per_step,
        matchmaking_time=cfg.matchmaking_time,
        averaging_timeout=cfg.averaging_timeout,
        next_chunk_timeout=chunk_timeout(cfg),
        load_state_timeout=cfg.load_state_timeout,
        client_mode=averaging_client_mode(dht),
        grad_compression=_compression(cfg.grad_compression),
        state_averaging_compression=Float16Compression(),
        load_state_compression=load_state_compression(),
        grad_averager_factory=partial(StatelessGradientAverager, request_timeout=1.0,
                                      round_timeout=cfg.averaging_timeout, accumulate_in_grads=cfg.overlap,
                                      **grad_opts),
        averager_opts=averager_opts,
        **overlap_options(cfg),
        tracker_opts=dict(
            min_refresh_period=cfg.min_refresh_period,
            max_refresh_period=cfg.max_refresh_period,
            default_refresh_period=cfg.default_refresh_period,
            report_period=cfg.progress_report_period,
            progress_from=progress_digest.backbone_ids(cfg.initial_peers),
            progress_token=getattr(getattr(cfg.authorizer, "holder", None), "get", None),
        ),
        verbose=False,
    )
    trim_heap()
    return optimizer


def chunk_timeout(cfg: SwarmConfig) -> float:
    """How long a peer in an all-reduce may take to send its next chunk before the round goes on
    without it. hivemind's default is the matchmaking time (2 s in our catalog): a volunteer whose
    averager shares a busy CPU with its training loop missed it in most rounds (the network lab's
    outbound-only test: 45 partial rounds in the volunteer's log at 2 s, none at 5 s). A third of
    the round's time budget, at most 5 s, keeps a dead peer from costing the whole round. (At 20 s,
    a peer capped at 250 kB/s stayed in every round and its wire rate reached 303 kB/s: the caps
    hold the payload, and the wire's overhead above it is larger than ``limits.WIRE_SHARE`` allows.)"""
    return max(cfg.matchmaking_time, min(cfg.averaging_timeout / 3, 5.0))


MATCHMAKING_PER_PEER = 0.125  # seconds a gradient round looks for its group, per peer in the swarm
MATCHMAKING_MOST = 15.0  # hivemind's advice for many peers over the Internet: 10-15 s


def matchmaking_window(peers: int, matchmaking_time: float, averaging_timeout: float) -> float:
    """How long before the swarm's step ends a gradient round begins to look for its group. hivemind
    begins ``matchmaking_time`` before, and every round's leader closes its group at the step's end.
    With many peers that is too short for the chains of join requests to reach one leader: 64 peers
    with 3 s (``bench/scale_averaging.py``) split into groups of 2 to 23 and half the rounds left a
    peer with no group; with 8 s one to four groups formed and 8 of 9 rounds averaged. The group still
    closes at the step's end, so a longer search costs the swarm no time. At most a third of the
    averaging timeout, which the search is part of."""
    return max(matchmaking_time, min(MATCHMAKING_PER_PEER * peers, MATCHMAKING_MOST, averaging_timeout / 3))


def overlap_options(cfg: SwarmConfig) -> dict:
    """hivemind.Optimizer's options for DeDLOC's delayed updates (``cfg.overlap``), or its defaults."""
    if not cfg.overlap:
        return dict(average_state_every=cfg.average_state_every)
    return dict(offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True,
                delay_state_averaging=True, average_state_every=cfg.average_state_every)


def load_state_compression():
    """How this peer serves its state to a newcomer (and to the backbone's checkpoints): parameters in
    fp16, half their bytes (a rounding of about 5e-4 of a weight, less than one step's change; the
    parameter rounds send fp16 too), optimizer statistics in bfloat16 (``BFloat16Statistics``).
    A newcomer decodes either, as would a plain hivemind peer."""
    from hivemind.compression import RoleAdaptiveCompression

    return RoleAdaptiveCompression(parameter=Float16Compression(), optimizer=BFloat16Statistics())


class BFloat16Statistics(NoCompression):
    """Optimizer statistics as bfloat16 on the wire: half the bytes of fp32 with fp32's range (Adam's
    second moment falls below fp16's, and a zero there makes an update explode), 8 bits of mantissa
    (a relative rounding of at most 2**-9, 1e-3 of an update at most). 0-d tensors (Adam's step
    count) go as they are. Sent as hivemind's own bfloat16 tensors (type NONE, dtype "bfloat16"),
    which every hivemind 1.1 peer decodes; ``torch.optim`` casts them back to the parameters' dtype
    when the newcomer loads them."""

    def compress(self, tensor: torch.Tensor, info, allow_inplace: bool = False):
        if tensor.dim() == 0 or tensor.dtype not in (torch.float32, torch.float64):
            return super().compress(tensor, info, allow_inplace)
        from hivemind.proto import runtime_pb2

        tensor = tensor.detach()
        return runtime_pb2.Tensor(compression=self.compression_type, size=tensor.shape, dtype="bfloat16",
                                  buffer=tensor.to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
                                  requires_grad=tensor.requires_grad)

    def estimate_compression_ratio(self, info) -> float:
        return 0.5 if len(info.descriptor.shape) else 1.0


def _compression(name: str):
    from hivemind.compression import Uniform8BitQuantization

    return {"none": NoCompression, "fp16": Float16Compression, "8bit": Uniform8BitQuantization}[name]()


class StatelessGradientAverager(GradientAverager):
    """A GradientAverager that downloads no state: ``hivemind.Optimizer.load_state_from_peers`` asks
    the gradient averager for a peer's accumulated gradients too, then throws them away (it resets
    its own). For a newcomer that was a second download as large as the parameters, after the state
    it needs, and 2 s per peer that did not answer in time (seen in ``bench/join_time.py``). Nor does
    it offer one: hivemind declared each gradient averager in the DHT at every step for downloads that
    no peer of ours makes (a store a step each, in a network-lab run 0.08-0.10 of a volunteer's 1.2
    DHT stores a second).

    Its buffers that the worker rewrites on every micro-batch (the parameters' ``.grad`` and the
    local accumulators, which hivemind allocates just before forking the averager's process) are
    put in shared memory before the fork: as private pages, each write by the worker left the
    averager's process an old copy of its own (``bench/overhead.py``: 39 MiB of private memory in
    that process, 14 MiB after).

    A round begun without a pre-scheduled group (hivemind.Optimizer passes no timeout then) gets
    ``round_timeout`` (the optimizer's averaging timeout) instead of none: without a deadline it retried
    matchmaking until some group formed, long after the optimizer had gone on with local gradients,
    and held the averager's matchmaking from the next steps' rounds meanwhile.

    ``accumulate_in_grads`` (with an offloaded optimizer, which never writes the parameters' ``.grad``):
    a step's micro-batches add up in ``.grad`` as backward leaves them, and go to the accumulators
    once, when the step's end reads them (``flush_grads_``, in the training loop's thread), instead
    of one copy per micro-batch plus the loop's ``zero_grad`` (5 % of the loop's CPU per micro-batch,
    ``bench/accumulate.py``). Micro-batches weigh the same (hivemind weighs them by size; the
    worker's are all ``batch_size_per_step``)."""

    _pending = False  # .grad holds micro-batches the accumulators do not have yet
    _loop_thread: int | None = None  # the thread that accumulates (only it may touch .grad)

    def __init__(self, parameters, *args, start: bool = False, round_timeout: float | None = None,
                 accumulate_in_grads: bool = False, **kwargs):
        self.round_timeout = round_timeout
        self.accumulate_in_grads = accumulate_in_grads
        kwargs.setdefault("allow_state_sharing", False)  # nothing to share: no DHT record of it either
        parameters = tuple(parameters)
        with torch.no_grad():
            for param in parameters:
                if param.grad is None and param.device.type == "cpu":
                    param.grad = torch.zeros_like(param).share_memory_()
        super().__init__(parameters, *args, start=False, **kwargs)
        for accumulator in self._local_accumulators or ():
            if accumulator.device.type == "cpu":
                accumulator.share_memory_()
        if start:
            self.run_in_background(await_ready=True)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        return None

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int):
        if not self.accumulate_in_grads:
            return super().accumulate_grads_(batch_size)
        self._loop_thread = threading.get_ident()
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size
        self._accumulators_used_in_step = False
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        self._pending = True

    @torch.no_grad()
    def flush_grads_(self) -> None:
        """Move the micro-batches in ``.grad`` to the accumulators (and zero ``.grad``): only from
        the training loop's thread, which is the only one that writes ``.grad``."""
        if not self._pending or threading.get_ident() != self._loop_thread:
            return
        grads, accumulators = list(self._grads_from_parameters()), list(self._grad_accumulators())
        if all(g.device == a.device for g, a in zip(grads, accumulators, strict=True)):
            torch._foreach_add_(accumulators, grads)
        else:  # accumulators on another device (hivemind's accumulate_grads_on)
            for grad, accumulator in zip(grads, accumulators, strict=True):
                accumulator.add_(grad.to(accumulator.device))
        torch._foreach_zero_(grads)
        self._pending = False

    def load_accumulators_into_averager_(self):
        self.flush_grads_()
        super().load_accumulators_into_averager_()

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        super().reset_accumulated_grads_()
        if self._pending and threading.get_ident() == self._loop_thread:  # drop them, as hivemind does
            torch._foreach_zero_(list(self._grads_from_parameters()))
            self._pending = False

    def schedule_step(self, scheduled_time=None, **kwargs):
        if kwargs.get("timeout") is None and self.round_timeout is not None:  # hivemind: deadline > scheduled time
            kwargs["timeout"] = max(self.round_timeout, 2 * self.matchmaking_kwargs["min_matchmaking_time"])
        return super().schedule_step(scheduled_time, **kwargs)


class _PacedEvent(threading.Event):
    """``ProgressTracker.should_report_progress`` that wakes the reporter (the only thread that waits
    on it) at most once per ``period`` seconds, unless ``hurry`` is set (a new epoch, shutdown).

    The wake after a hurried one is not paced: hivemind's reporter publishes only while this peer's
    last report with samples in it is at most one epoch old, and the hurried report of a new epoch
    has none. A peer stepping faster than ``period`` was otherwise never published at all."""

    def __init__(self, period: float):
        super().__init__()
        self.period = period
        self.hurry = threading.Event()
        self._next = 0.0
        self._hurried = False

    def wait(self, timeout: float | None = None) -> bool:
        began = time.monotonic()
        pause = 0.0 if self._hurried else self._next - began
        if pause > 0 and not self.hurry.is_set():
            self.hurry.wait(pause if timeout is None else min(pause, timeout))
        self._hurried = self.hurry.is_set()
        self.hurry.clear()
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
        result = super().wait(left)
        self._next = time.monotonic() + self.period
        return result


class _WithdrawableRecord:
    """A tracker's DHT: while the tracker is ``withdrawn``, what it stores as its progress record is
    None (hivemind's own mark of a peer gone, as its ``ProgressTracker.shutdown`` stores it)."""

    def __init__(self, dht, tracker: SwarmTracker):
        self._dht, self._tracker = dht, tracker

    def store(self, key, *args, **kwargs):
        if self._tracker.withdrawn and key == self._tracker.training_progress_key:
            kwargs["value"] = None
        return self._dht.store(key, *args, **kwargs)

    def get(self, key, *args, return_future: bool = False, **kwargs):
        """The progress record from a backbone's digest (``progress_digest``) where there is one."""
        tracker = self._tracker
        if key != tracker.training_progress_key or not tracker.progress_from:
            return self._dht.get(key, *args, return_future=return_future, **kwargs)
        token = tracker.progress_token() if tracker.progress_token is not None else None
        read = progress_digest.Read(key, tracker._local_public_key, tracker.progress_from, token)
        return self._dht.run_coroutine(read, return_future=return_future)

    def __getattr__(self, name):
        return getattr(self._dht, name)


class SwarmTracker(ProgressTracker):
    """ProgressTracker that also keeps the swarm's samples/s (the sum of the peers' reports),
    publishes this peer's progress at most every ``report_period`` seconds while it accumulates, and
    takes it out of the swarm's count of peers while its user has paused it (``withdraw``)."""

    swarm_samples_per_second = 0.0
    withdrawn = False
    _last_metadata = None  # the swarm's progress records as last read
    peers_in_step = 0  # of the peers counted, those at the swarm's step or one behind

    def __init__(self, *args, report_period: float = 1.0, start: bool = True, group_waits=None,
                 progress_from: list[str] = (), progress_token=None, **kwargs):
        super().__init__(*args, start=False, **kwargs)
        self.should_report_progress = _PacedEvent(report_period)
        self.group_waits = group_waits
        # backbones' peer ids whose digest of the progress record we read, and our invite token's getter
        self.progress_from, self.progress_token = list(progress_from), progress_token
        self.dht = _WithdrawableRecord(self.dht, self)
        if start:
            self.start()

    def withdraw(self, withdrawn: bool = True) -> None:
        """Paused, this peer trains no more until ``withdraw(False)``: its record says None meanwhile.
        A paused peer still counted among the peers made the others wait out each round for it: of
        two volunteers, the one left trained a step per averaging timeout and could not serve its
        state (its step was never whole), so the paused one, back, loaded stale states in a loop."""
        if withdrawn == self.withdrawn:
            return
        self.withdrawn = withdrawn
        if withdrawn:  # now, not at the reporter's next turn (it publishes only a peer in step)
            self.dht.store(self.training_progress_key, subkey=self._local_public_key, value=None,
                           expiration_time=get_dht_time() + self.metadata_expiration, return_future=True)
        else:  # back: publish our progress at once, and count ourselves in the swarm's again now
            self.should_report_progress.hurry.set()
            self.should_report_progress.set()
            if self._last_metadata is not None:
                with self.lock_global_progress:
                    self.global_progress = self._parse_swarm_progress_data(self._last_metadata)

    @property
    def ready_to_update_epoch(self) -> bool:
        """hivemind's, or the optimizer's round already in its group for the step (``group_waits``)."""
        return super().ready_to_update_epoch or (self.group_waits is not None and self.group_waits())

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        if local_epoch != self.local_progress.epoch or samples_accumulated == 0:
            self.should_report_progress.hurry.set()
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)

    def shutdown(self, timeout: float | None = None):
        self.should_report_progress.hurry.set()
        return super().shutdown(timeout)

    def _parse_swarm_progress_data(self, metadata):
        self._last_metadata = metadata
        if not isinstance(metadata, dict):
            self.peers_in_step = 0
            return super()._parse_swarm_progress_data(metadata)
        mine = metadata.get(self._local_public_key)
        if metadata and not self.withdrawn and (mine is None or mine.value is None):
            # our record is missing or None (read while we were withdrawn, or before our store landed):
            # without it a peer just back counted one peer less, and beside one other it took its steps
            # alone, a step per target batch, unaveraged (the other, waiting in its round, fell behind)
            record = dict(self.local_progress.dict(), time=get_dht_time())
            metadata = {**metadata, self._local_public_key: ValueWithExpiration(record, get_dht_time() + 1.0)}
        progress = super()._parse_swarm_progress_data(metadata)
        peers = [LocalTrainingProgress.parse_obj(entry.value) for entry in metadata.values() if entry.value is not None]
        self.swarm_samples_per_second = sum(peer.samples_per_second for peer in peers)
        # peers that can join this step's rounds: a peer far behind loads the swarm's state first
        self.peers_in_step = sum(not peer.client_mode and peer.epoch >= progress.epoch - 1 for peer in peers)
        return progress


class RoundCountingOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that counts the averaging rounds it joined and tracks swarm samples/s.

    With delayed gradient averaging (``SwarmConfig.overlap``) it also fixes what a failed round
    falls back to: hivemind reloads the gradient accumulators, which by then hold the *next* step's
    first micro-batches (or zeros), over buffers a partial all-reduce left half averaged. Here the
    step's own local gradients, kept when its round begins, are used instead."""

    rounds_joined = 0
    rounds_failed = 0  # gradient rounds this peer entered that did not average (it stepped on its own)
    last_group_size = 0
    samples_dropped = 0  # accumulated samples a state load threw away: never part of the swarm's steps
    averaging_seconds = 0.0
    _fresh_load = False  # a state was just loaded: the swarm may have stepped meanwhile
    _local_grads: list[torch.Tensor] | None = None  # this step's local gradients, while its round runs
    _owed_steps: OwedSteps | None = None  # wraps the offloaded optimizer's step (_make_state_averager)
    steps_sat_out = 0
    _sitting_out: int | None = None  # the step sat out, until the swarm leaves it or the late round ends
    _joining_since: float | None = None  # our round looks for a group while the swarm has moved on
    JOIN_GRACE = 1.0  # seconds a looking round gets to hear it joined the swarm's group for the step
    GROUP_GRACE = 1.0  # seconds past its scheduled time a looking round gets to form its group
    _looked_at: int | None = None  # the step at whose end we last read the swarm's progress ourselves

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind schedules the next step's round as soon as the last one was triggered; with
        delayed averaging the last one may still run. A round scheduled then found its group at once
        among peers already ending this step, who then sent their parts to a peer that could not take
        them yet (BAD_GROUP_ID: it registers a group only when its own step ends, after the last
        round), and the round failed for all of them (seen in ``bench/swarm_netlab.py``'s logs). So
        no new round while the last one runs; the step's end begins one (``_begin_averaging_gradients``).
        In a large swarm the round begins to look ``matchmaking_window`` before the step's end."""
        last = self.scheduled_grads
        if last is not None and last.triggered and not last.done() or self._sitting_out is not None:
            return  # (nor while sitting a step out: this peer's next round is for the swarm's next step)
        window = matchmaking_window(self.tracker.global_progress.num_peers, self.matchmaking_time,
                                    self.averaging_timeout)
        if window <= self.matchmaking_time:
            return super()._maybe_schedule_gradient_averaging()
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if eta <= window and (last is None or last.triggered or last.done()):
            # hivemind's own scheduling, begun earlier: the round still closes its group at the
            # step's end, and keeps the time after it that hivemind's round has
            lead = max(eta, self.matchmaking_time)
            self.scheduled_grads = self.grad_averager.schedule_step(
                scheduled_time=get_dht_time() + lead,
                timeout=self.averaging_timeout + lead - self.matchmaking_time)

    def _maybe_schedule_state_averaging(self) -> None:
        if self._sitting_out is None:  # the parameter round of a step sat out is not ours to join
            super()._maybe_schedule_state_averaging()

    def _update_global_epoch(self, grad_scaler) -> None:
        """A peer whose last step's round is still looking for a group when the next step comes is a
        round behind: the swarm's group for that step has long run, so the round will join the swarm's
        round for *this* step. hivemind would then trigger this step's round only after that one
        ends, when the swarm's group for the next step has formed too, and so on, one round behind
        for good: each step its loop waited for the last round ("Waiting for delayed updates"), and
        its parameter rounds (every ``average_state_every`` steps) found nobody until their deadline
        (a newcomer in ``bench/join_time.py``: 17 s). Such a peer sits this step out instead: no
        round and no optimizer step; once the swarm has taken the step it goes on at the swarm's step
        number, its samples carried into that step's round, which it can then schedule in time (if
        the late round ends first, the swarm's other peers were late too: it takes the step). The
        optimizer owes the step sat out (``OwedSteps``): its next step, with the late round's average
        (the swarm's for the step sat out), is taken twice.

        With overlap, a peer whose swarm has already taken this step is a round behind the same way,
        unless its pre-scheduled round already sits in the swarm's group for the step: it goes on at the
        swarm's step at once (without overlap its step waits in the round, as hivemind's does). In the
        network lab the fastest volunteer, alone when it last read the swarm's progress, stepped 1.1 s
        after the others; from then on each of its parameter rounds began a step late, and the others
        timed out waiting for it (the "stalled" parameter rounds of a quarter of the runs). Its tracker
        reads the swarm's progress every few seconds, so a peer whose round is in no group reads it
        again before it steps (a round pre-scheduled late, on an ETA the swarm beat by 3 s, missed the
        group by 0.1 s). A round still looking then gets a moment to hear that it joined the swarm's
        group for the step (one heard it 5 ms after its peer had gone on without it, and the group
        waited 5 s for its trigger). A round found in the group after that moment takes the step, and one
        still looking is cancelled when the peer goes on (left looking, it joined the group of the step
        the swarm took, late, and held it until the peer's next step)."""
        last = self.scheduled_grads
        if self._looks_in_vain(last):  # our last round waits for peers the swarm no longer has
            logger.info("Alone in the swarm: our round for step %d looks for a group in vain, cancelled",
                        self.local_epoch - 1 if self._sitting_out is None else self._sitting_out - 1)
            last.cancel()  # its delayed step takes our local gradients (``_load_local_gradients_into_optimizer``)
            self.scheduled_grads, self._sitting_out = None, None
            return super()._update_global_epoch(grad_scaler)
        if self._sitting_out is not None and self.local_epoch != self._sitting_out:
            self._sitting_out = None  # a state load moved this peer meanwhile
        if self._sitting_out is not None:
            self._sitting_out, step = None, self._sitting_out
            if self.tracker.global_epoch > step:
                return self._go_on_from(self.tracker.global_epoch)
            if last is not None and not last.done():
                self._sitting_out = step
                return  # the swarm is still finishing that step: keep accumulating
            # the late round ended and the swarm did not move on (its other peers were late too, as
            # when rounds outlast steps: all of them sat out, and none would ever move on): step
            return super()._update_global_epoch(grad_scaler)
        joining, self._joining_since = self._joining_since, None
        behind = self.delay_grad_averaging and not self._in_a_group(last)  # (without overlap the step waits)
        if (behind and joining is None and self.tracker.global_epoch <= self.local_epoch
                and self._looked_at != self.local_epoch):
            self._looked_at = self.local_epoch  # (once a step: a wait for the group calls here each micro-batch)
            self._look_at_the_swarm()  # our last look may be seconds old: did the swarm step already?
        if behind and self.tracker.global_epoch > self.local_epoch:
            if self._may_be_joining(last, joining):
                return  # keep accumulating; the next micro-batch decides
            if self._in_a_group(last):  # it joined the swarm's group since we looked: take the step
                return super()._update_global_epoch(grad_scaler)
            # the swarm took this step without us (our tracker saw it late): a round begun now would
            # find no group for it and join the swarm's next one, a round behind from then on (its
            # parameter rounds triggered a step after the others': they timed out waiting for us)
            if self.local_epoch > 0:  # (before its first step a peer loads the swarm's state: _go_on_from)
                logger.info("The swarm took step %d without us: going on at step %d with our samples",
                            self.local_epoch, self.tracker.global_epoch)
            if last is not None and not last.triggered and not last.done():
                # our round for the step the swarm took: left looking, it joined that step's group
                # late and held it until our next step, and that group's round failed
                last.cancel()
                self.scheduled_grads = None
            self._skip_step()
            return self._go_on_from(self.tracker.global_epoch)
        if self._awaits_its_group(last):
            return  # keep accumulating: the swarm has not stepped, and our round's group forms shortly
        if (last is None or not last.triggered or last.done()
                or last.stage != AveragingStage.LOOKING_FOR_GROUP):
            return super()._update_global_epoch(grad_scaler)
        logger.info("Our last round is still looking for a group: sitting step %d out", self.local_epoch)
        self._skip_step()
        self._sitting_out = self.local_epoch

    def _looks_in_vain(self, last) -> bool:
        """Our triggered round still looks for a group and the swarm has no other peer in step now
        (they left, paused: ``SwarmTracker.withdraw``, or are steps behind, loading its state). It
        could only fail at its deadline, the averaging timeout, and meanwhile this peer sat its steps
        out: alone beside a paused volunteer, a step per timeout. Beside one back from a pause, 170
        steps behind, its delayed step waited in that round, so it could serve no whole step, and the
        other's downloads timed out (5 s each) until the round's deadline. (Without overlap a step
        waits in its round, as hivemind's does: not this case.)"""
        return (last is not None and last.triggered and not last.done()
                and last.stage == AveragingStage.LOOKING_FOR_GROUP and self.tracker.peers_in_step <= 1)

    PAUSED_WEIGHT = 1e-6  # a paused peer's parts in a round it was already grouped for: next to nothing

    def leave_untriggered_rounds(self) -> None:
        """Paused by its user, this peer takes no step until it resumes, and only a step's end
        triggers its rounds: left alone, a round it scheduled for its next step joined a group and
        waited there, and the group's all-reduce failed for want of its share of the reduction. A
        round still looking for a group leaves now (the group forms without us); one already in its
        group stays, for ``serve_grouped_rounds``."""
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and not control.triggered and not control.done() \
                    and control.stage != AveragingStage.AWAITING_TRIGGER:
                control.cancel()
                setattr(self, name, None)

    def serve_grouped_rounds(self) -> None:
        """While paused: once the swarm's step ends (when the group's other members trigger theirs),
        run a round that was already in its group, our parts at ``PAUSED_WEIGHT``: the group gets
        our share of the reduction and our stale buffers count for nothing (not 0: a part whose
        other senders all failed would be 0/0). Triggered earlier, our reducer gave up waiting for
        the others' parts. The first step after the pause schedules new rounds."""
        if not self.tracker.ready_to_update_epoch:
            return
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and not control.triggered and not control.done():
                control.weight = self.PAUSED_WEIGHT
                control.allow_allreduce()
                setattr(self, name, None)

    def _skip_step(self) -> None:
        """This peer takes no step now: no parameter round for it either."""
        if self.scheduled_state is not None and not self.scheduled_state.done():
            self.scheduled_state.cancel()
            self.scheduled_state = None
        self.steps_sat_out += 1

    def _look_at_the_swarm(self, timeout: float = 1.0) -> None:
        """Read the swarm's progress now (one DHT get) instead of at the tracker's next fetch."""
        tracker = self.tracker
        future = tracker.dht.get(tracker.training_progress_key, latest=True, return_future=True)
        try:
            found = future.result(timeout)
        except Exception as exc:  # a slow or failed get: decide on the last look, as before
            future.cancel()
            logger.debug("Could not read the swarm's progress: %r", exc)
            return
        metadata = getattr(found, "value", None)
        with tracker.lock_global_progress:
            tracker.global_progress = tracker._parse_swarm_progress_data(metadata)

    def _may_be_joining(self, last, since: float | None) -> bool:
        """Our untriggered round still looks for a group: the swarm's group for this step may have
        just taken it in (the leader's word takes a network trip). Wait up to ``JOIN_GRACE`` for it:
        a round that joined and then heard no trigger held the group until our next step."""
        if last is None or last.triggered or last.done() or last.stage != AveragingStage.LOOKING_FOR_GROUP:
            return False
        now = time.monotonic()
        if since is not None and now - since >= self.JOIN_GRACE:
            return False
        self._joining_since = now if since is None else since
        return True

    def _awaits_its_group(self, last) -> bool:
        """The swarm reached the target but nobody has stepped yet, and our pre-scheduled round still
        looks for its group, due at the round's scheduled time: keep accumulating until it is in the
        group (then every peer in it triggers at its next micro-batch) or ``GROUP_GRACE`` after that
        time. A peer that stepped on a round still looking was the swarm's first step: the peers whose
        rounds were looking too then saw the swarm step without them and went on with their samples,
        which made the next step reach its target before the rounds pre-scheduled for it formed, and
        the peers stepping then went on in their turn (the going-on cascade of the network lab)."""
        if (not self.delay_grad_averaging or last is None or last.triggered or last.done()
                or last.stage not in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
                or self.tracker.global_progress.num_peers <= 1):  # (alone: no round, hivemind steps at once)
            return False
        return get_dht_time() < last.scheduled_time + self.GROUP_GRACE

    def group_waits(self) -> bool:
        """Our pre-scheduled round sits in its group past the time it was scheduled for, untriggered:
        the group formed, so the swarm's step is due, whatever our tracker's last read of the swarm
        says (a tracker that read it before the step's samples came in steps seconds later, and the
        group's other peers, who sent their parts at once, gave up on ours: "no average from").
        ``SwarmTracker.ready_to_update_epoch`` asks this."""
        last = self.scheduled_grads
        return (self.delay_grad_averaging and self._in_a_group(last)
                and last.stage == AveragingStage.AWAITING_TRIGGER and get_dht_time() >= last.scheduled_time)

    @staticmethod
    def _in_a_group(scheduled) -> bool:
        """Our pre-scheduled round already sits in a group, waiting for this step's trigger."""
        return (scheduled is not None and not scheduled.triggered and not scheduled.done()
                and scheduled.stage in (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE))

    def _go_on_from(self, epoch: int) -> None:
        """Go on at the swarm's step ``epoch`` (``_go_on_at``); a peer that has taken no step yet loads
        the swarm's state instead (``_load_first_step``). The optimizer's owed steps repeat the next
        step's averaged gradients for the one missed, and the first is the one that differs most (its
        gradient norm is the largest): a volunteer that went on at the swarm's first step (late to its
        first round) would take twice its second step's gradients, its Adam statistics without the
        largest; a few steps later its update is its own, its gradients go into everyone's average,
        and the swarm's loss jumps for a step (in the network lab, 3.19 -> 4.90). A newcomer has nothing
        of its own to lose in the swarm's state but the samples of its first seconds, and its download
        costs it a second or two once."""
        if self.local_epoch == 0:
            return self._load_first_step(epoch)
        self._go_on_at(epoch)

    def _load_first_step(self, epoch: int) -> None:
        """``load_state_from_peers``: the samples accumulated so far are dropped, as hivemind does
        (they were computed on the initial parameters: carried into the swarm's second step, they can
        raise the whole swarm's loss a few steps later). If no peer shared a
        state, the peer goes on with its samples, the steps owed as by ``_go_on_at``."""
        ga = self.grad_averager
        if isinstance(ga, StatelessGradientAverager):
            ga.flush_grads_()
        with torch.no_grad():
            kept = [acc.detach().clone() for acc in ga._grad_accumulators()]
        samples, times = ga.local_samples_accumulated, ga.local_times_accumulated
        before = self.local_epoch
        logger.info("The swarm took its first step without us: loading its state (our %d samples, "
                    "computed on the initial parameters, are dropped)", samples)
        self.load_state_from_peers()
        if getattr(self.state_averager, "found_state", False):
            return
        # hivemind took the swarm's step number anyway: the steps are owed as by _go_on_at
        logger.info("No peer shared its state: going on at step %d with our samples", self.local_epoch)
        with torch.no_grad():
            for acc, grad in zip(ga._grad_accumulators(), kept, strict=True):
                acc.copy_(grad)
        ga.local_samples_accumulated, ga.local_times_accumulated = samples, times
        self.samples_dropped -= samples  # (load_state_from_peers counted them dropped)
        if self._owed_steps is not None:
            self._owed_steps.owe(max(epoch, self.local_epoch) - before)
        self.state_averager.local_epoch = max(epoch, self.local_epoch)
        self.tracker.report_local_progress(self.local_epoch, samples)

    def _go_on_at(self, epoch: int) -> None:
        """Take the swarm's step number without a step of our own, keeping the samples accumulated.
        The optimizer owes the swarm the steps skipped: its next step is taken once more for each
        (``OwedSteps``), so that its statistics and step count stay the swarm's."""
        missed = epoch - self.state_averager.local_epoch
        if missed > 0 and self._owed_steps is not None:
            self._owed_steps.owe(missed)
        self.state_averager.local_epoch = epoch
        self.tracker.report_local_progress(epoch, self.tracker.local_progress.samples_accumulated)

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        if self.scheduled_grads is not None and self.scheduled_grads.triggered:
            # the last step's round, which ran on until this step's end (so none was scheduled):
            # hivemind would drop it and begin no round for this step at all
            self.scheduled_grads = None
        if self.delay_grad_averaging:
            ga = self.grad_averager
            if isinstance(ga, StatelessGradientAverager):
                ga.flush_grads_()
            scale = 1.0 / ga.local_times_accumulated if ga.local_times_accumulated else 0.0
            with torch.no_grad():
                self._local_grads = [acc.detach().clone().mul_(scale) for acc in ga._grad_accumulators()]
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:
            self._local_grads = None  # no round in the background to fall back from
        return began

    def zero_grad(self, set_to_none: bool = False):
        """Zeroes the gradients in place by default: they sit in shared memory, shared with the
        gradient averager's process (``StatelessGradientAverager``); new ones would be private again.
        Nothing to do while the averager accumulates in ``.grad``: they are the step's gradients so
        far, and it zeroes them when it takes them."""
        if getattr(self.grad_averager, "accumulate_in_grads", False):
            return
        super().zero_grad(set_to_none=set_to_none)

    def _load_local_gradients_into_optimizer(self):
        local, self._local_grads = self._local_grads, None
        if local is None:
            return super()._load_local_gradients_into_optimizer()
        logger.debug("Proceeding with this step's local gradients")
        with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
            for buffer, grad in zip(averaged, local, strict=True):
                buffer.copy_(grad)
        self._load_averaged_gradients_into_optimizer_()

    def load_state_from_peers(self, **kwargs):
        swarm_before = self.tracker.global_epoch
        held = self.grad_averager.local_samples_accumulated if self.grad_averager is not None else 0
        super().load_state_from_peers(**kwargs)
        if self.grad_averager is not None:  # hivemind resets the accumulators after a load
            self.samples_dropped += max(0, held - self.grad_averager.local_samples_accumulated)
        self._fresh_load = True
        if self._owed_steps is not None:
            self._owed_steps.clear()  # the swarm's own statistics now
        self._look_at_the_swarm()  # the tracker did not read the swarm's progress during the download
        if self.tracker.global_epoch > self.local_epoch >= swarm_before:
            # The swarm took steps while we downloaded its newest state. Downloading again would last
            # as long and find the swarm as far ahead: a peer capped at 250 kB/s downloaded a 2.6 MB
            # state eight times in a row, 14 s each while the swarm took 5 steps, and did nothing else
            # (tests/test_bandwidth_netns.py). Go on at the swarm's step instead: the optimizer owes
            # the steps (OwedSteps replays two at most); our parameters, older by the rest, meet the
            # swarm's at the next parameter round.
            self._go_on_after_load()

    def _go_on_after_load(self) -> None:
        """Take the swarm's step number after a state load the swarm outpaced (no second download)."""
        logger.info("The swarm reached step %d while we loaded its state of step %d: going on from there",
                    self.tracker.global_epoch, self.local_epoch)
        self._should_check_synchronization_on_update = False
        self._go_on_at(self.tracker.global_epoch)

    def _should_load_state_from_peers(self) -> bool:
        fetched = self.tracker.fetched_global_progress_this_epoch.is_set()
        if self._fresh_load and self._should_check_synchronization_on_update and fetched:
            self._fresh_load = False
            if self.tracker.global_epoch == self.local_epoch + 1:
                # The swarm stepped while we loaded its state (on a slow link a download lasts about a
                # step): take its step number, as hivemind's load_state_from_peers does when it sees the
                # new step at load time, instead of downloading the whole state again. The optimizer
                # owes that step: its next one is taken twice (OwedSteps).
                self._go_on_after_load()
                return False
        return super()._should_load_state_from_peers()

    def _make_state_averager(self, **kwargs):
        # hivemind's own construction, of the class that can take a state downloaded while joining
        module = hivemind.optim.optimizer
        module.TrainingStateAverager = prefetch.TrainingStateAverager
        try:
            averager = super()._make_state_averager(**kwargs)
        finally:
            module.TrainingStateAverager = prefetch.state_averager.TrainingStateAverager
        self._owed_steps = OwedSteps(averager.optimizer)
        return averager

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return SwarmTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            group_waits=self.group_waits,
            **kwargs,
        )

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        began = time.perf_counter()
        try:
            super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        finally:
            self._local_grads = None
        self.averaging_seconds += time.perf_counter() - began
        if maybe_step_control is None:  # no other peer to average with: no round
            return
        try:
            group = maybe_step_control.result(0) if maybe_step_control.done() else None
        except BaseException:
            group = None
        if group is None:  # a failed round: hivemind already used local gradients
            self.rounds_failed += 1
            return
        self.rounds_joined += 1
        self.last_group_size = len(group)


class OwedSteps:
    """Replaces an optimizer's ``step``: after a step, takes it again (same gradients) once for each
    global step this peer skipped (``owe``: a step sat out, a step the swarm took while we loaded its
    state). Without it such a peer's optimizer stayed a step behind the swarm's for good: Adam's step
    count and moments missed a gradient, and with the swarm's parameters (a parameter round brings
    them) its updates were not the others'. In the network lab a peer that sat out the first step
    made an update of its own at step 6 (loss 3.48 -> 4.5 on its next micro-batches, the others 3.29)
    and its gradients, 50 times the usual, went into the swarm's average."""

    MAX = 2  # more missed steps than that and the peer loads the swarm's state instead (hivemind)

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._step, self._lock, self.owed = optimizer.step, threading.Lock(), 0
        optimizer.step = self

    def owe(self, steps: int) -> None:
        with self._lock:
            self.owed = min(self.owed + steps, self.MAX)

    def clear(self) -> None:
        with self._lock:
            self.owed = 0

    def __call__(self, *args, **kwargs):
        out = self._step(*args, **kwargs)
        with self._lock:
            owed, self.owed = self.owed, 0
        for _ in range(owed):
            logger.info("Taking the optimizer step again for a global step this peer skipped")
            self._step(*args, **kwargs)
        return out


def param_digest(model: torch.nn.Module) -> list[float]:
    """A few numbers that identify the model's parameters (to compare peers in tests and logs)."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        return [float(flat.sum()), float(flat.abs().sum()), float(flat[:: max(1, flat.numel() // 7)].sum())]
