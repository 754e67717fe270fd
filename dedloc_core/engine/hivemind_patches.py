"""Our named fixes and hooks on hivemind 1.1.12. Each patch says what it changes and why.

Call ``install()`` once in a process, before creating a DHT. Patches:

1. ``traffic``: counts the bytes of every p2p message this peer sends and receives
   (``P2P.send_raw_data`` / ``P2P.receive_raw_data`` for streams, ``P2P._call_unary_protobuf_handler``
   and ``P2P._add_protobuf_unary_handler`` for unary calls). hivemind counts nothing. The counters
   live in shared memory so the forked averager processes add to the same totals (the DHT is a
   thread since patch 11).
2. ``children die with us``: hivemind forks its DHT and averager processes (the DHT is a thread
   since patch 11) and starts ``p2pd`` (``p2p/p2p_daemon.py``, ``create_subprocess_exec``) without
   tying their lifetime to ours; after a SIGKILL they linger forever. We set ``PR_SET_PDEATHSIG`` = SIGKILL in
   every forked child and in ``p2pd``, so a killed worker takes its whole tree with it.
3. ``bandwidth caps``: hivemind cannot cap traffic (its ``bandwidth`` is a load-balancing hint).
   We pace ``P2P.send_protobuf`` (each message waits for its tokens, then is written whole, as
   before) and ``P2P.receive_raw_data`` (read chunk by chunk, each after its tokens; ``p2p/p2p_daemon.py``)
   through the shared token buckets of ``dedloc_core.engine.bandwidth``, and the unary calls and handlers
   per message. Installed before patch 1, so the counters wrap the paced functions. With no cap
   set, the original functions run unchanged.
4. ``8-bit codecs under NumPy 2``: ``Quantization.extract`` and ``BlockwiseQuantization.extract``
   (``compression/quantization.py``) read the codebook size with ``int(np.frombuffer(..., count=1))``,
   a 1-element array, which NumPy 2 refuses (``TypeError: only 0-dimensional arrays can be
   converted to Python scalars``): every 8-bit tensor failed to decode. We read element ``[0]``
   instead (the upstream fix, made after 1.1.12). ``Uniform8BitQuantization.quantize`` also called
   ``torch.quantize_per_tensor``, deprecated by torch 2.13; we compute the same uint8 indices
   (round half to even, clamped to 0..255) with plain tensor ops, so the bytes on the wire are the
   same as before.
5. ``no relay for strangers``: p2pd offers a circuit relay (v2) to anyone by default, in two ways.
   Its ``main.go`` calls ``d.EnableRelayV2()`` (``relay.New(host)`` with default limits) whenever
   ``-relay=1``, and ``P2P.create`` (``p2p/p2p_daemon.py``) offers only ``use_relay=False``, which
   also stops this peer from using relays. So after ``P2P.create`` we register our own handler for
   the relay's hop protocol (``/libp2p/circuit/relay/0.2.0/hop``); the daemon then routes those
   streams to us instead of its relay, and we close them. Second, once AutoNAT (through other
   peers of the swarm) finds the host public, libp2p's relay manager starts a relay service again
   and takes the hop protocol back (seen in the network lab: a public volunteer in a training
   swarm granted reservations). ``-relayService=0`` stops that manager, so every daemon of a peer
   that does not relay gets that flag. No reservations, no circuits. The backbone opts in with
   ``set_relay_service(True)``. The same patch appends extra p2pd flags from ``set_p2pd_options``
   (a NATed peer that names its relay sets ``relayDiscovery=False``; with few public peers,
   discovery finds none).
6. ``tasks and awaited futures stay alive``: asyncio keeps only weak references to tasks, and
   hivemind's background loops (``DHT._run``, ``DecentralizedAverager._run``, matchmaking) start
   tasks with ``asyncio.create_task`` and drop them; ``MPFuture`` (``utils/mpfuture.py``) keeps only
   weak references to its futures too. A chain of tasks whose leaf awaits such a future (a DHT
   store from the averager, a step's trigger, a reply) had no strong holder, and the garbage
   collector destroyed it mid-await ("Task was destroyed but it is pending!"). When that hit the
   matchmaking chain inside ``look_for_group``, its lock was never released and every later
   averaging round failed with "could not find a group" until the process ended; in a DHT process
   the caller of ``run_coroutine`` got ``GeneratorExit`` (both seen in the network lab). Now
   ``asyncio.create_task`` keeps every task in a set until it is done, and ``MPFuture.__await__``
   keeps the future until the await ends. The same for the task that serves each connection to a
   unix-socket server (``asyncio.streams.StreamReaderProtocol``: p2pd hands every incoming stream to
   our handlers so): it was collected mid-stream ("Task was destroyed but it is pending!", then
   "cannot reuse already awaited coroutine"), and the peer sending that stream saw it reset.
7. ``robust aggregation``: ``TensorPartReducer`` (``averaging/partition.py``) adds every sender's
   part to a weighted mean, NaN and all: one broken or hostile peer poisons every peer's step.
   ``accumulate_part`` now drops a non-finite part (that sender leaves this round, named in the log,
   with a strike, see ``engine/robust.py``), and with ``robust.configure("centered_clip")`` keeps the
   parts and returns their centered clip instead of the mean. An average that a reducer returns
   with NaN or inf (``TensorPartContainer.register_processed_part``) is not used either: that
   reducer's parts count as failed (so the round fails, see below) and it gets a strike; hivemind
   added it to every peer's tensors, so one hostile reducer poisoned the whole group. ``on_sender_failed`` is made
   idempotent (a dropped sender is banned by the runner too). ``AllReduceRunner`` tells its reducer
   the senders' peer ids (for the log), a peer whose own parts were dropped still reduces the others'
   parts, then keeps its local values (as for a failed reducer) instead of waiting forever, and ``Matchmaking``
   (``averaging/matchmaking.py``) neither accepts nor follows a peer that ``robust.banned`` (one
   dropped again and again). A partial all-reduce is a failed round: a reducer that lost a sender
   (killed, timed out, not for its content) answers its remaining parts with an error instead of an
   average without it, and a peer that misses any reducer's results raises in
   ``AllReduceRunner.run`` before the next output (hivemind logged "received 54 % of input tensors" and went on, which
   merged two rounds in DiLoCo); every peer of the group then keeps its local state.
8. ``invite-only averaging``: hivemind checks tokens only in the DHT (``TokenAuthorizerBase``, see
   ``engine/gate.py``); its averagers answer anyone who knows the group key. When ``gate.active()``
   (an invite-only experiment), ``Matchmaking.rpc_join_group`` (``averaging/matchmaking.py``) refuses
   a follower without a valid token, ``_request_join_group`` does not ask a leader without one,
   ``follower_assemble_group`` leaves a group that holds a peer without one, and
   ``DecentralizedAverager.rpc_aggregate_part`` and ``rpc_download_state`` (``averaging/averager.py``)
   refuse parts from and state downloads by such a peer. The checks read the tokens peers publish
   in the DHT (``gate.admits``). With the gate off (open experiments) nothing changes.
9. ``state records never lapse``: ``DecentralizedAverager._declare_for_download_periodically``
   (``averaging/averager.py``) stores this peer's "I can share my state" record with a lifetime of
   ``declare_state_period`` and renews it only when it expires, through a DHT store that takes a
   while (seconds, when the routing table still holds peers that left). Meanwhile the record is
   gone: a newcomer that looks then finds no peer to load the state from and starts from scratch
   (most likely what CI saw: a DiLoCo newcomer whose only source was the backbone started at round 0, not 3). Now the
   record is renewed halfway through its lifetime; a peer that left still drops out within one period.
   The same loop also stored the record again each time its event woke it, and hivemind's all-reduce
   sets that event after every averaged tensor: a gradient round of the netlab's tiny-lm stored it
   about 20 times in 0.1 s (2.5 stores a second per volunteer, each a DHT search and a store to
   every node, counted in ``bench/swarm_netlab.py``'s DHT traffic). Now it is stored only when what it
   says changes (sharing allowed, the priority) or when it is due for renewal.
10. ``a cancelled step stays cancelled``: ``StepControl.cancel`` (``averaging/control.py``) tells the
   averager first (its trigger and cancel futures) and sets its own state to cancelled last. The
   averager's ``_step`` (``averaging/averager.py``) wakes on that news and reads ``step.cancelled()``,
   which could still be False; it then went on with matchmaking, found that the cancelled trigger
   counts as "triggered", and ran a whole all-reduce for a step nobody waits for (its end:
   "Can't set_result to a future that is CANCELLED"). hivemind.Optimizer cancels its pre-scheduled
   gradient round whenever it sees no other peer, which is often as peers come and go. The zombie
   round held the averager's matchmaking ("Another look_for_group is already in progress"), took the
   group another peer meant for its real step, and left this peer's real round without one until
   the averaging timeout: in two peers' logs on loopback, most failed rounds and 30 s stalls began
   so. Now the state is set first, then the averager is told; a second cancel does nothing (hivemind's
   raised ``InvalidStateError`` setting the cancel future again, e.g. in ``Optimizer.shutdown``).
11. ``helper threads``, a switch, off by default: ``DEDLOC_HELPER_THREADS=dht`` runs the DHT as a
   thread of this process instead of a forked process, ``all`` the averagers too
   (``dedloc_core.engine.helper_threads`` says what that changes and why it is not the default).
12. ``a round that ran is not run again``: ``DecentralizedAverager._step`` (``averaging/averager.py``)
   retried a step whose all-reduce had begun and failed, looking for a new group until the step's
   deadline (the averaging timeout). The group it ran with has dissolved, and in a synchronous
   swarm the other peers have moved on (one whose last part went missing was the only one to see
   the round fail): a newcomer's parameter round in ``bench/join_time.py`` found no group for 25 s
   while its training loop waited for it ("Allreduce group not found" every 2-6 s). Now
   ``StepControl.allow_retries`` is False once the all-reduce began: the step fails at once and the
   optimizer goes on with its local gradients or parameters. A step that has not found a group yet
   still retries until its deadline.
13. ``helpers forked above the loop``: the DHT and the averagers start (``mp.Process.start``, the
   fork) on ``limits.above_the_loop``'s thread. A child inherits its forking thread's scheduling
   class, and the training loop's thread goes to SCHED_IDLE (``limits.training_below_helpers``),
   which it cannot leave: a rejoin's session (a lost relay) forked its helpers from there, level
   with the loop. hivemind's ``signal.signal`` calls stay in the calling thread.
14. ``matchmaking polls the DHT at a pace``: while an averager looks for a group,
   ``PotentialLeaders._update_queue_periodically`` (``averaging/matchmaking.py``) fetches the group
   key's averagers again as soon as ``pop_next_leader`` finds no better leader than itself, which is
   at once: a DHT get (a search over every node) back to back for the whole matchmaking time (a lone
   averager on loopback: 750 a second; in a netlab run with failing rounds one averager averaged 7
   a second over the run, two thirds of the searches its DHT sent). Now a fetch
   starts at most every ``LEADER_POLL_SECONDS`` (a quarter of the matchmaking time if that is less);
   the first of a search at once, as before.
15. ``one write per daemon message``: ``write_pbmsg`` (``p2p/p2p_daemon_bindings/utils.py``) wrote a
   message's length (a varint) one byte at a time, each byte its own ``write`` and ``drain`` (a send
   on p2pd's unix socket, a wake of its reader), then the body: three sends for most requests and
   replies of a unary call. Now the length and the body go in one write.
16. ``an optimizer's first step is its first``: ``initialize_optimizer_state_``
   (``optim/state_averager.py``) makes the optimizer's statistics exist by running a step with zero
   gradients, at the recipe's learning rate and weight decay. Adam's step count then starts at 1,
   so every later step used the bias correction of the step after (the first update 0.73x, and so
   on), and AdamW's decay shrank the offloaded parameters once. On the network lab's tiny-lm (AdamW,
   betas 0.9/0.95, lr 3e-3, no warm-up) that trajectory reached a sharp point at step 6: gradient
   norm 30-145 against 1, the loss 3.45 -> 4-9 for a step, with overlap and without (replayed in one
   process: the same spike with the zero step, none without). DeepSpeed, Megatron and torchtitan
   fixed the same step. Now the zero step runs at learning rate and weight decay 0 and the step
   counts go back to 0: the statistics exist, and the first real step is torch's first step.
17. ``an averager leaves no socket behind``: each averager talks to p2pd through a replica of the
   DHT's ``P2P`` (``DHT.replicate_p2p``), whose client listens on a unix socket
   ``/tmp/hivemind-p2pclient-*.sock``. ``DecentralizedAverager._shutdown``
   (``averaging/averager.py``) removes the averager's handlers but never shuts the replica down, so
   its socket file stayed in /tmp: two per worker session (a join, a rejoin, the resume after a
   long pause), 4,838 on the dev VM after two days of tests and benchmarks. Now the replica is shut down after
   the handlers are gone (``P2P._terminate`` removes the file; a replica has no daemon to stop).
18. ``a request from a process that has gone``: a call to the DHT travels through its pipe with
   an ``MPFuture``, whose pipe end and shared state are file descriptors that the DHT process fetches
   from the caller's ``multiprocessing.resource_sharer`` while it unpickles the message. An averager
   that asks the DHT something as it shuts down has exited by then: the fetch fails. ``DHT.run``
   (``dht/dht.py``) caught ``OSError`` and slept ``wait_timeout`` (3 s) before reading its pipe
   again, so the DHT's own shutdown waited past its 3 s grace and was killed, leaving its p2pd
   and its two socket files; an ``EOFError`` (the caller gone mid-handshake) killed the DHT
   process outright. 6 of 20 lone sessions ended so (``tests/test_replica_sockets.py``'s probe).
   Now the DHT reads each message's bytes first (a broken pipe still fails as before) and drops a
   message it cannot unpickle: its caller can no longer hear the answer.
19. ``a store goes where the key's last store went``: ``DHTNode.store_many`` (``dht/node.py``)
   searches the DHT for a key's nearest nodes before every store (a find to each node it visits),
   although a peer stores the same keys again and again (its progress every few seconds, its
   group declarations, its metrics, its state record): in the network lab half of all DHT requests
   (a volunteer sent 150 finds and 75 stores in 30 s). Now a store keeps the nodes its search found
   for ``NEAREST_TTL`` seconds and the next store of that key goes to them directly, unless one of
   them has left the routing table (a request to it failed), then it searches again. Gets still
   search every time.
20. ``sockets in the supervisor's folder``: hivemind names its unix sockets (p2pd's control socket,
   each ``P2P`` client's) at random in /tmp (``P2P._UNIX_SOCKET_PREFIX``, ``p2p/p2p_daemon.py``). A
   worker killed (a stop past its grace, a crash, a lab node stopped) removes none, and its
   supervisor cannot tell them from another worker's: 2,217 on the dev VM after a day of tests and
   benchmarks. With ``DEDLOC_SOCKET_DIR`` set (``WorkerProcess`` makes a folder per worker) they go
   in that folder, which the supervisor removes once the worker's process group is gone.
21. ``an optimizer's client_mode is the one it is given``: ``hivemind.Optimizer.__init__``
   (``optim/optimizer.py``) reads ``client_mode if client_mode is None else dht.client_mode``, so
   its averagers always take the DHT's mode. A volunteer that uses the DHT without serving it
   (``SwarmConfig.dht_client``) still takes averaging connections: its optimizer is created with
   the DHT's ``client_mode`` read as the one given.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import multiprocessing as mp
import os
import signal
import sys
from typing import Any

_installed = False
_counters: Any = None  # shared RawArray('Q', 2): [sent, received]
_PR_SET_PDEATHSIG = 1
RELAY_HOP = "/libp2p/circuit/relay/0.2.0/hop"
_relay_service = False  # patch 5; module state is inherited by the forked DHT processes
_p2pd_flags: dict[str, Any] = {}
LEADER_POLL_SECONDS = 0.5  # patch 14: the shortest time between two fetches of a group's averagers
NEAREST_TTL = 30.0  # patch 19: how long a store reuses the nodes its last search for the key found


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass


def _add(index: int, n: int) -> None:
    if _counters is not None:
        _counters[index] += n  # racy across processes by a few bytes at worst; fine for statistics


def traffic() -> tuple[int, int]:
    """(bytes sent, bytes received) by this peer's p2p streams and calls since ``install()``."""
    if _counters is None:
        return 0, 0
    return int(_counters[0]), int(_counters[1])


def install() -> None:
    """Apply all patches (idempotent)."""
    global _installed, _counters
    if _installed:
        return
    _installed = True
    _counters = mp.RawArray("Q", 2)
    os.register_at_fork(after_in_child=_set_pdeathsig)
    _patch_one_write_per_message()
    _patch_bandwidth()
    _patch_traffic()
    _patch_p2pd_spawn()
    _patch_8bit_codecs()
    _patch_p2pd_flags()
    _patch_task_references()
    _patch_robust_aggregation()
    _patch_invite_gate()
    _patch_state_declarations()
    _patch_step_cancel()
    _patch_no_rerun()
    _patch_leader_poll()
    _patch_inert_optimizer_init()
    _patch_replica_sockets()
    _patch_dht_drops_orphans()
    _patch_store_where_last_stored()
    _patch_socket_dir()
    _patch_optimizer_client_mode()
    from dedloc_core.engine import helper_threads

    helper_threads.install(os.environ.get("DEDLOC_HELPER_THREADS", "none"))
    _patch_fork_above_loop()  # after helper_threads: wraps whichever start it left


def _patch_optimizer_client_mode() -> None:
    """Patch 21 (see the module docstring)."""
    from hivemind.optim.optimizer import Optimizer

    init = Optimizer.__init__

    @functools.wraps(init)
    def __init__(self, *args, dht, client_mode=None, **kwargs) -> None:
        if client_mode is None or client_mode == dht.client_mode:
            return init(self, *args, dht=dht, client_mode=client_mode, **kwargs)
        actual, dht._client_mode = dht.client_mode, client_mode
        try:
            init(self, *args, dht=dht, client_mode=client_mode, **kwargs)
        finally:
            dht._client_mode = actual

    Optimizer.__init__ = __init__  # type: ignore[method-assign]


def _patch_fork_above_loop() -> None:
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.dht import DHT

    from dedloc_core.engine import limits

    for cls in (DHT, DecentralizedAverager):
        def start(self, _start=cls.start) -> None:
            limits.above_the_loop(_start, self)

        cls.start = start


_alive: set = set()  # patch 6: tasks not done yet and MPFutures being awaited, in this process


def _patch_task_references() -> None:
    from hivemind.utils.mpfuture import MPFuture

    create_task = asyncio.create_task

    def create_task_kept(coro, **kwargs):
        task = create_task(coro, **kwargs)
        _alive.add(task)
        task.add_done_callback(_alive.discard)
        return task

    asyncio.create_task = create_task_kept
    original = MPFuture.__await__

    def __await__(self):
        _alive.add(self)
        try:
            return (yield from original(self))
        finally:
            _alive.discard(self)

    MPFuture.__await__ = __await__  # type: ignore[method-assign]

    # the task that serves each incoming connection of a unix-socket server (how p2pd hands a peer's
    # stream to our handlers) comes from loop.create_task, held only by its own protocol
    protocol = asyncio.streams.StreamReaderProtocol
    made = protocol.connection_made

    def connection_made(self, transport) -> None:
        made(self, transport)
        task = getattr(self, "_task", None)
        if task is not None and not task.done():
            _alive.add(task)
            task.add_done_callback(_alive.discard)

    protocol.connection_made = connection_made  # type: ignore[method-assign]


def _patch_traffic() -> None:
    from hivemind.p2p import p2p_daemon
    from hivemind.p2p.p2p_daemon import P2P

    send_raw, receive_raw = P2P.send_raw_data, P2P.receive_raw_data

    async def send_raw_data(data: bytes, writer: asyncio.StreamWriter, *, chunk_size: int = 2**16) -> None:
        _add(0, len(data) + P2P.HEADER_LEN)
        await send_raw(data, writer, chunk_size=chunk_size)

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        data = await receive_raw(reader)
        _add(1, len(data) + P2P.HEADER_LEN)
        return data

    P2P.send_raw_data = staticmethod(send_raw_data)  # type: ignore[method-assign]
    P2P.receive_raw_data = staticmethod(receive_raw_data)  # type: ignore[method-assign]

    call_unary = P2P._call_unary_protobuf_handler

    async def _call_unary_protobuf_handler(self, peer_id, handle_name, input, output_protobuf_type):
        _add(0, input.ByteSize())
        response = await call_unary(self, peer_id, handle_name, input, output_protobuf_type)
        _add(1, response.ByteSize())
        return response

    P2P._call_unary_protobuf_handler = _call_unary_protobuf_handler  # type: ignore[method-assign]

    add_unary = P2P._add_protobuf_unary_handler

    async def _add_protobuf_unary_handler(self, handle_name, handler, input_protobuf_type, balanced=False):
        async def counted(request, context):
            _add(1, request.ByteSize())
            response = await handler(request, context)
            _add(0, response.ByteSize())
            return response

        await add_unary(self, handle_name, counted, input_protobuf_type, balanced=balanced)

    P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler  # type: ignore[method-assign]
    assert p2p_daemon.P2P is P2P


def _patch_p2pd_spawn() -> None:
    from hivemind.p2p import p2p_daemon

    real_asyncio = p2p_daemon.asyncio

    class _Subprocess:
        """Stands in for ``asyncio.subprocess`` inside p2p_daemon only."""

        PIPE = real_asyncio.subprocess.PIPE
        STDOUT = real_asyncio.subprocess.STDOUT

        @staticmethod
        async def create_subprocess_exec(*args, **kwargs):
            kwargs.setdefault("preexec_fn", _set_pdeathsig)
            return await real_asyncio.subprocess.create_subprocess_exec(*args, **kwargs)

    class _AsyncioProxy:
        subprocess = _Subprocess

        def __getattr__(self, name: str) -> Any:
            return getattr(real_asyncio, name)

    p2p_daemon.asyncio = _AsyncioProxy()  # type: ignore[assignment]


def _patch_bandwidth() -> None:
    from hivemind.p2p.p2p_daemon import P2P

    from . import bandwidth

    bandwidth.setup()  # shared buckets, created before hivemind forks
    send_protobuf, receive_raw = P2P.send_protobuf, P2P.receive_raw_data

    async def send_protobuf_paced(protobuf, writer: asyncio.StreamWriter) -> None:
        # wait for the whole message's tokens (paced chunk by chunk) *before* writing any of it:
        # hivemind writes a message's marker, header and body with no yield between them, and a
        # yield there would let another coroutine's message interleave on the same stream
        if bandwidth.active(bandwidth.UP):
            await bandwidth.take_up(1 + P2P.HEADER_LEN + protobuf.ByteSize())
        await send_protobuf(protobuf, writer)

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        if not bandwidth.active(bandwidth.DOWN):
            return await receive_raw(reader)
        header = await reader.readexactly(P2P.HEADER_LEN)
        left = int.from_bytes(header, P2P.BYTEORDER)
        parts = []
        while left > 0:
            step = min(left, bandwidth.CHUNK)
            await bandwidth.take_down(step)  # reading slower fills the buffers: the sender slows
            parts.append(await reader.readexactly(step))
            left -= step
        return b"".join(parts)

    P2P.send_protobuf = staticmethod(send_protobuf_paced)  # type: ignore[method-assign]
    P2P.receive_raw_data = staticmethod(receive_raw_data)  # type: ignore[method-assign]

    call_unary = P2P._call_unary_protobuf_handler

    async def _call_unary_protobuf_handler(self, peer_id, handle_name, input, output_protobuf_type):
        await bandwidth.take_up(input.ByteSize())
        response = await call_unary(self, peer_id, handle_name, input, output_protobuf_type)
        await bandwidth.take_down(response.ByteSize())
        return response

    P2P._call_unary_protobuf_handler = _call_unary_protobuf_handler  # type: ignore[method-assign]

    add_unary = P2P._add_protobuf_unary_handler

    async def _add_protobuf_unary_handler(self, handle_name, handler, input_protobuf_type, balanced=False):
        async def paced(request, context):
            await bandwidth.take_down(request.ByteSize())
            response = await handler(request, context)
            await bandwidth.take_up(response.ByteSize())
            return response

        await add_unary(self, handle_name, paced, input_protobuf_type, balanced=balanced)

    P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler  # type: ignore[method-assign]


def _patch_8bit_codecs() -> None:
    import math

    import numpy as np
    import torch
    from hivemind.compression import quantization as q

    def extract(self, serialized_tensor):  # Quantization.extract, codebook size read as element [0]
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    def blockwise_extract(self, serialized_tensor):  # BlockwiseQuantization.extract, sizes read as [0]
        from bitsandbytes.functional import dequantize_blockwise  # hivemind requires it for this codec

        buffer = serialized_tensor.buffer
        absmax_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook_size = int(np.frombuffer(buffer, offset=8, count=1, dtype=np.int64)[0])
        absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
        codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
        result = dequantize_blockwise(
            torch.from_numpy(quantized.copy()).reshape(tuple(serialized_tensor.size)),
            absmax=torch.from_numpy(absmax.copy()), code=torch.from_numpy(codebook.copy()),
            blocksize=q._BLOCKWISE_QUANTIZATION_BLOCKSIZE, nested=False)
        return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)

    def uniform_quantize(self, tensor, allow_inplace=False):  # without torch.quantize_per_tensor
        offset = self.n_bins // 2
        shift = tensor.mean()
        tensor = tensor.to(dtype=torch.float32, copy=not allow_inplace)
        centered = tensor.sub_(shift) if allow_inplace else tensor - shift
        std_unbiased = centered.norm() / math.sqrt(centered.numel() - 1)
        scale = float(self.RANGE_IN_SIGMAS * std_unbiased / self.n_bins)
        if scale == 0.0 or not math.isfinite(scale):
            quantized = torch.full_like(centered, offset, dtype=torch.uint8)
        else:
            quantized = torch.round(centered / scale).add_(offset).clamp_(0, self.n_bins - 1).to(torch.uint8)
        lookup = q.average_buckets(tensor, quantized, self.n_bins)
        return np.asarray(quantized, dtype=self.indices_dtype), np.asarray(lookup, dtype=self.codebook_dtype)

    q.Quantization.extract = extract  # type: ignore[method-assign]
    q.BlockwiseQuantization.extract = blockwise_extract  # type: ignore[method-assign]
    q.Uniform8BitQuantization.quantize = uniform_quantize  # type: ignore[method-assign]


def set_relay_service(enabled: bool) -> None:
    """Whether P2P daemons started from now on relay for other peers (patch 5; the backbone only)."""
    global _relay_service
    _relay_service = enabled


def relay_service() -> bool:
    return _relay_service


def set_p2pd_options(**flags: Any) -> None:
    """Extra p2pd flags for daemons started from now on (patch 5), e.g. ``relayDiscovery=False``.
    ``None`` removes a flag. Set before creating the DHT: its process is forked and inherits them."""
    for key, value in flags.items():
        if value is None:
            _p2pd_flags.pop(key, None)
        else:
            _p2pd_flags[key] = value


def p2pd_options() -> dict[str, Any]:
    return dict(_p2pd_flags)


async def _refuse(info: Any, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    import logging

    logging.getLogger(__name__).info("Refused to relay for %s", getattr(info, "peer_id", "a peer"))
    writer.close()


def _patch_p2pd_flags() -> None:
    from hivemind.p2p.p2p_daemon import P2P

    make_args = P2P._make_process_args

    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        relay = {} if _relay_service else {"relayService": False}  # see patch 5
        return make_args(*args, **{**kwargs, **relay, **_p2pd_flags})

    P2P._make_process_args = staticmethod(_make_process_args)  # type: ignore[method-assign]

    create = P2P.create.__func__  # type: ignore[attr-defined]

    async def create_without_relay_service(cls, *args: Any, **kwargs: Any) -> P2P:
        p2p = await create(cls, *args, **kwargs)
        if not _relay_service:
            await p2p.add_binary_stream_handler(RELAY_HOP, _refuse)
        return p2p

    P2P.create = classmethod(create_without_relay_service)  # type: ignore[method-assign,assignment]


def _patch_robust_aggregation() -> None:
    """Patch 7 (see the module docstring)."""
    import logging

    from hivemind.averaging import allreduce, matchmaking, partition
    from hivemind.proto import averaging_pb2

    from . import robust

    log = logging.getLogger(__name__)
    reducer = partition.TensorPartReducer
    original_reset, original_failed = reducer.reset_accumulators, reducer.on_sender_failed

    def reset_accumulators(self) -> None:
        self.robust_parts = []  # (part, weight) of the current part, kept for centered_clip
        if not hasattr(self, "dropped"):
            self.dropped = set()  # senders left out for what they sent (NaN): not a partial round
        original_reset(self)

    def on_sender_failed(self, sender_index: int) -> None:
        if self.sender_failed_after[sender_index] == float("inf"):
            original_failed(self, sender_index)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part, weight: float = 1.0):
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise partition.AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise partition.BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            if not robust.finite(tensor_part):
                self.num_parts_received[sender_index] -= 1  # not counted: the sender fails before this part
                names = getattr(self, "sender_names", None)
                peer = names[sender_index] if names else f"sender {sender_index}"
                log.warning("Dropped part %d from %s: it holds NaN or inf; it leaves this round", part_index, peer)
                robust.strike(peer)
                self.dropped.add(sender_index)
                self.on_sender_failed(sender_index)
                raise partition.BannedException(f"{peer} sent a non-finite part")
            if robust.kind() == "centered_clip":
                self.robust_parts.append((tensor_part.detach().clone(), float(weight)))
            else:
                self.accumulator.add_(tensor_part, alpha=weight)
            self.current_part_accumulated_from += 1
            self.denominator += weight
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            lost = [i for i, after in enumerate(self.sender_failed_after)
                    if after <= self.current_part_index and i not in self.dropped]
            if lost:  # a sender vanished: its part is missing from this average, so there is none
                names = getattr(self, "sender_names", None)
                who = ", ".join(f"...{names[i][-6:]}" if names else str(i) for i in lost)
                self.current_part_future.set_exception(partition.AllreduceException(
                    f"partial all-reduce: {len(lost)} of {self.num_senders} senders lost ({who}); the round fails"))
                self.current_part_future.exception()  # retrieved: no "never retrieved" warning
            elif self.robust_parts:
                parts, weights = zip(*self.robust_parts, strict=True)
                result = robust.centered_clip(list(parts), list(weights))
            else:
                result = self.accumulator.div_(self.denominator)
            if not lost:
                self.current_part_future.set_result(result)
            self.reset_accumulators()

    reducer.reset_accumulators = reset_accumulators
    reducer.on_sender_failed = on_sender_failed
    reducer.accumulate_part = accumulate_part
    reducer.check_current_part_finished = check_current_part_finished

    container = partition.TensorPartContainer
    register = container.register_processed_part

    def register_processed_part(self, peer_index: int, part_index: int, part) -> None:
        if not robust.finite(part):  # a reducer's average with NaN/inf: none of its parts is used
            names = getattr(self, "reducer_names", None)
            peer = names[peer_index] if names else f"reducer {peer_index}"
            log.warning("%s returned average %d with NaN or inf: the round fails", peer, part_index)
            robust.strike(peer)
            raise partition.AllreduceException(f"{peer} returned a non-finite average")
        register(self, peer_index, part_index, part)

    container.register_processed_part = register_processed_part
    register_failed = container.register_failed_reducer

    def register_failed_reducer(self, peer_index: int) -> None:
        self.failed_reducers = [*getattr(self, "failed_reducers", ()), peer_index]
        register_failed(self, peer_index)

    container.register_failed_reducer = register_failed_reducer
    runner_init = allreduce.AllReduceRunner.__init__

    def init(self, *args: Any, **kwargs: Any) -> None:
        runner_init(self, *args, **kwargs)
        self.tensor_part_reducer.sender_names = [str(p) for p in self.sender_peer_ids]
        self.tensor_part_container.reducer_names = [str(p) for p in self.ordered_peer_ids]

    allreduce.AllReduceRunner.__init__ = init
    communicate = allreduce.AllReduceRunner._communicate_with_peer

    async def _communicate_with_peer(self, peer_id) -> None:
        try:
            await communicate(self, peer_id)
        except Exception as exc:
            if peer_id == self.peer_id:  # hivemind does not expect our own reducer to fail us: it would hang
                if isinstance(exc, partition.BannedException):  # our parts were dropped (NaN): still reduce
                    await self.tensor_part_reducer.finished.wait()  # the others' parts to the end
                self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
            raise

    allreduce.AllReduceRunner._communicate_with_peer = _communicate_with_peer
    run = allreduce.AllReduceRunner.run

    async def run_whole(self):
        container = self.tensor_part_container
        async for delta in run(self):  # each output comes once all its parts are in (averaged or failed)
            if container.failed_size:  # a reducer's parts are missing: a partial all-reduce is a failed round
                names = getattr(container, "reducer_names", None)
                missing = ", ".join(f"...{names[i][-6:]}" if names else str(i)
                                    for i in getattr(container, "failed_reducers", ()))
                raise partition.AllreduceException(
                    f"partial all-reduce in {self._prefix}: {container.failed_size} of {container.total_size} "
                    f"values not averaged (no average from {missing})")
            yield delta

    allreduce.AllReduceRunner.run = run_whole

    mm = matchmaking.Matchmaking
    check, request = mm._check_reasons_to_reject, mm._request_join_group

    def _check_reasons_to_reject(self, request_msg, context):
        if robust.banned(str(context.remote_id)):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return check(self, request_msg, context)

    async def _request_join_group(self, leader):
        if robust.banned(str(leader)):
            return None
        return await request(self, leader)

    mm._check_reasons_to_reject = _check_reasons_to_reject
    mm._request_join_group = _request_join_group


def _patch_invite_gate() -> None:
    """Patch 8 (see the module docstring)."""
    from hivemind.averaging import averager, matchmaking
    from hivemind.p2p import P2PHandlerError
    from hivemind.proto import averaging_pb2

    from . import gate

    mm = matchmaking.Matchmaking
    join, request, assemble = mm.rpc_join_group, mm._request_join_group, mm.follower_assemble_group

    async def rpc_join_group(self, request_msg, context):
        if not await gate.admits(self.group_key_manager.dht, context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in join(self, request_msg, context):
            yield message

    async def _request_join_group(self, leader):
        if not await gate.admits(self.group_key_manager.dht, leader):
            return None
        return await request(self, leader)

    async def follower_assemble_group(self, leader, msg):
        for raw in msg.ordered_peer_ids:
            peer = matchmaking.PeerID(raw)
            if peer != self.peer_id and not await gate.admits(self.group_key_manager.dht, peer):
                raise P2PHandlerError(f"the group of {leader} holds {peer}, who has no valid invite token")
        return await assemble(self, leader, msg)

    mm.rpc_join_group = rpc_join_group
    mm._request_join_group = _request_join_group
    mm.follower_assemble_group = follower_assemble_group

    avg = averager.DecentralizedAverager
    aggregate, download = avg.rpc_aggregate_part, avg.rpc_download_state

    # hivemind builds its handlers from these functions' argument names and annotations: keep both
    @functools.wraps(aggregate)
    async def rpc_aggregate_part(self, stream, context):
        if not await gate.admits(self.dht, context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in aggregate(self, stream, context):
            yield message

    @functools.wraps(download)
    async def rpc_download_state(self, _request, _context):
        if not await gate.admits(self.dht, _context.remote_id):
            return
        async for message in download(self, _request, _context):
            yield message

    avg.rpc_aggregate_part = rpc_aggregate_part
    avg.rpc_download_state = rpc_download_state


def _patch_state_declarations() -> None:
    """Patch 9 (see the module docstring): hivemind's loop, renewing at half the record's lifetime and
    storing the record only when it changes or is due."""
    from hivemind.averaging import averager
    from hivemind.utils import get_dht_time

    async def _declare_for_download_periodically(self):
        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        declared: tuple | None = None  # (allowed, priority) in the record last stored
        renew_at = float("inf")
        while True:
            allowed = self.allow_state_sharing
            wanted = (allowed, self.state_sharing_priority if allowed else None)
            # a changed declaration, or a record at half its life; a switch-off is stored once (None)
            if (allowed or (declared is not None and declared[0])) and (wanted != declared
                                                                        or get_dht_time() >= renew_at - 0.01):
                expiration_time = get_dht_time() + self.declare_state_period
                asyncio.create_task(asyncio.wait_for(
                    self.dht.store(download_key, subkey=self.peer_id.to_bytes(), value=wanted[1],
                                   expiration_time=expiration_time, return_future=True),
                    timeout=expiration_time - get_dht_time()))
                declared = wanted
                renew_at = expiration_time - self.declare_state_period / 2 if allowed else float("inf")
            self._state_updated.clear()
            wait = min(renew_at, get_dht_time() + self.declare_state_period) - get_dht_time()
            try:
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, wait))
            except TimeoutError:
                pass

    averager.DecentralizedAverager._declare_for_download_periodically = _declare_for_download_periodically


def _patch_step_cancel() -> None:
    """Patch 10 (see the module docstring)."""
    from hivemind.averaging.control import StepControl
    from hivemind.utils.mpfuture import MPFuture

    def cancel(self) -> bool:
        cancelled = MPFuture.cancel(self)  # the shared state, read by the averager when it hears below
        if self._trigger is not None:
            self._trigger.cancel()
        if self._cancel is not None and not self._cancel.done():  # a second cancel is a no-op, as for a future
            self._cancel.set_result(None)
        return cancelled

    StepControl.cancel = cancel  # type: ignore[method-assign]


def _patch_no_rerun() -> None:
    """Patch 12 (see the module docstring)."""
    from hivemind.averaging.control import StepControl

    allowed = StepControl.allow_retries.fget
    StepControl.allow_retries = property(lambda self: allowed(self) and not self.began_allreduce)


class _PacedKeys:
    """A ``GroupKeyManager`` whose ``get_averagers`` waits until the pause since its last call is over."""

    def __init__(self, leaders: Any, keys: Any) -> None:
        self._leaders, self._keys, self._last = leaders, keys, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._keys, name)

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        from hivemind.utils import get_dht_time

        if self._last is not None:
            pause = min(LEADER_POLL_SECONDS, self._leaders.min_matchmaking_time / 4)
            wait = min(self._last + pause, self._leaders.search_end_time) - get_dht_time()
            if wait > 0:
                await asyncio.sleep(wait)
        self._last = get_dht_time()
        return await self._keys.get_averagers(*args, **kwargs)


def _patch_leader_poll() -> None:
    """Patch 14 (see the module docstring)."""
    from hivemind.averaging.matchmaking import PotentialLeaders

    update = PotentialLeaders._update_queue_periodically

    async def _update_queue_periodically(self, key_manager) -> None:
        await update(self, _PacedKeys(self, key_manager))

    PotentialLeaders._update_queue_periodically = _update_queue_periodically  # type: ignore[method-assign]


def _patch_one_write_per_message() -> None:
    """Patch 15 (see the module docstring)."""
    import varint  # hivemind's own dependency (multiaddr's varints)
    from hivemind.p2p.p2p_daemon_bindings import control, utils

    async def write_pbmsg(stream: asyncio.StreamWriter, pbmsg) -> None:
        body = pbmsg.SerializeToString()
        stream.write(varint.encode(len(body)) + body)
        await stream.drain()

    control.write_pbmsg = utils.write_pbmsg = write_pbmsg


def _patch_inert_optimizer_init() -> None:
    """Patch 16."""
    import torch
    from hivemind.optim import state_averager

    original = state_averager.initialize_optimizer_state_

    def initialize_optimizer_state_(opt) -> None:
        keys = ("lr", "weight_decay")
        saved = [{k: group[k] for k in keys if k in group} for group in opt.param_groups]
        for group in opt.param_groups:
            for k in keys:
                if k in group:
                    group[k] = group[k] * 0 if torch.is_tensor(group[k]) else 0.0
        try:
            original(opt)
        finally:
            for group, values in zip(opt.param_groups, saved, strict=True):
                group.update(values)
        for state in [*opt.state.values(), *opt.param_groups]:
            step = state.get("step")
            if torch.is_tensor(step):
                step.zero_()
            elif isinstance(step, int | float) and not isinstance(step, bool):
                state["step"] = type(step)(0)

    state_averager.initialize_optimizer_state_ = initialize_optimizer_state_


def _patch_socket_dir() -> None:
    """Patch 20 (see the module docstring)."""
    from hivemind.p2p.p2p_daemon import P2P

    from dedloc_core.workerproc import SOCKET_DIR_ENV

    folder = os.environ.get(SOCKET_DIR_ENV)
    # (a unix socket's path holds at most 107 bytes; hivemind's names take 40)
    if folder and os.path.isdir(folder) and len(os.path.abspath(folder)) <= 60:
        P2P._UNIX_SOCKET_PREFIX = f"/unix{os.path.abspath(folder)}/hivemind-"


def _patch_replica_sockets() -> None:
    """Patch 17."""
    from hivemind.averaging.averager import DecentralizedAverager

    shutdown = DecentralizedAverager._shutdown

    async def _shutdown(self, timeout) -> None:
        try:
            await shutdown(self, timeout)
        finally:
            replica = getattr(self, "_p2p", None)
            if replica is not None:
                await replica.shutdown()

    DecentralizedAverager._shutdown = _shutdown  # type: ignore[method-assign]


class _OrphanTolerantPipe:
    """Patch 18: the DHT's end of its pipe, whose ``recv`` drops a message it cannot unpickle."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def recv(self):
        from multiprocessing.reduction import ForkingPickler

        data = self._conn.recv_bytes()  # a broken pipe raises here, as before
        try:
            return ForkingPickler.loads(data)
        except Exception as exc:  # whatever the caller's process left behind
            import logging

            logging.getLogger(__name__).debug("The DHT dropped a request from a process that has gone (%r)", exc)
            return "_drop_request", [], {}


def _patch_dht_drops_orphans() -> None:
    """Patch 18."""
    from hivemind.dht import DHT

    run = DHT.run

    @functools.wraps(run)
    def run_tolerant(self) -> None:  # the DHT's body, in its process (or thread: patch 11)
        if not isinstance(self._inner_pipe, _OrphanTolerantPipe):
            self._inner_pipe = _OrphanTolerantPipe(self._inner_pipe)
        run(self)

    async def _drop_request(self) -> None:
        return None

    DHT.run = run_tolerant  # type: ignore[method-assign]
    DHT._drop_request = _drop_request


def _patch_store_where_last_stored() -> None:
    """Patch 19. ``store_many`` is the only caller that passes ``found_callback`` (gets call
    ``traverse_dht`` themselves), and it uses only the callback, not the result."""
    import time

    from hivemind.dht.node import DHTNode

    find = DHTNode.find_nearest_nodes

    async def find_nearest_nodes(self, queries, k_nearest=None, beam_size=None, num_workers=None,
                                 node_to_peer_id=None, exclude_self=False, **kwargs):
        found = kwargs.get("found_callback")
        if found is None or node_to_peer_id is None:
            return await find(self, queries, k_nearest, beam_size, num_workers, node_to_peer_id, exclude_self,
                              **kwargs)
        known = self.__dict__.setdefault("_nearest_by_key", {})  # key id -> (valid until, {node id: peer id})
        now, table = time.monotonic(), self.protocol.routing_table
        if len(known) > 256:  # keys of past rounds
            for key_id in [k for k, (until, _) in known.items() if until <= now]:
                del known[key_id]
        cached, search = {}, []
        for key_id in queries:
            until, nearest = known.get(key_id, (0.0, {}))
            if until > now and nearest and all(node in table for node in nearest):
                cached[key_id] = nearest
            else:
                search.append(key_id)
        stores = []
        for key_id, nearest in cached.items():
            node_to_peer_id.update(nearest)
            stores.append(asyncio.create_task(found(key_id, list(nearest), {self.node_id})))
        result = {}
        if search:
            async def remember(key_id, nearest_nodes, visited):
                known[key_id] = (time.monotonic() + NEAREST_TTL, {n: node_to_peer_id[n] for n in nearest_nodes})
                await found(key_id, nearest_nodes, visited)

            kwargs["found_callback"] = remember
            result = await find(self, search, k_nearest, beam_size, num_workers, node_to_peer_id, exclude_self,
                                **kwargs)
        if stores:
            await asyncio.gather(*stores)
        return result

    DHTNode.find_nearest_nodes = find_nearest_nodes  # type: ignore[method-assign]
