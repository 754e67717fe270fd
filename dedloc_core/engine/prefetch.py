"""A newcomer's state download, begun as soon as its DHT is up.

hivemind downloads a running swarm's state only once its Optimizer exists, and building that takes
seconds of CPU (forking two averagers), and the dial-back that tells whether the DHT is reachable
takes round trips before it.
``start()`` runs the download in the DHT's event loop meanwhile, the way hivemind's
averager does it (``DecentralizedAverager._load_state_from_peers``: the peers that declared their
state, highest step first, ``rpc_download_state``; that loop runs in the averager, which does not
exist yet, so it is written again here); our ``TrainingStateAverager`` hands the result to
hivemind's own ``load_state_from_peers`` instead of downloading it again.

hivemind names a peer's RPC handlers after the servicer's class (``TrainingStateAverager.rpc_download_state``),
so our subclass keeps that name: peers of every version find each other's state.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from functools import partial

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim import state_averager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, MSGPackSerializer, ValueWithExpiration
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from .parameter_rounds import KeepsItsParameterRounds, LeavesLoneParameterRounds

logger = logging.getLogger(__name__)


def start(dht, run_id: str, timeout: float, expected: int | None = None) -> MPFuture:
    """Download the swarm's newest state in ``dht``'s event loop; the future gives ``(metadata, tensors)``,
    or None when the swarm is at step 0 or nobody shares a state."""
    return dht.run_coroutine(partial(_download, run_id=run_id, timeout=timeout, expected=expected),
                             return_future=True)


def swarm_step(progress) -> int:
    """The highest step among the progress records of ``{run_id}_progress`` (0 when none)."""
    if not isinstance(progress, dict):
        return 0
    epochs = [info.value.get("epoch") for info in progress.values()
              if isinstance(info, ValueWithExpiration) and isinstance(info.value, dict)]
    return max((e for e in epochs if isinstance(e, int)), default=0)


async def _download(_dht, node, run_id: str, timeout: float, expected: int | None = None):
    asked = time.monotonic()
    prefix = f"{run_id}_state_averager"
    progress, found = await asyncio.gather(node.get(f"{run_id}_progress", latest=True),  # a lookup each,
                                           node.get(f"{prefix}.all_averagers", latest=True))  # round trips
    if swarm_step(progress.value if progress else None) <= 0:
        return None  # the first peers: nothing to catch up with
    sharing = found.value if found and isinstance(found.value, dict) else {}
    priority = {PeerID(peer): (float(info.value), random.random()) for peer, info in sharing.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))}
    for peer in sorted(priority, key=priority.get, reverse=True):
        if peer == node.peer_id:
            continue
        began = time.monotonic()
        try:
            stub = state_averager.TrainingStateAverager.get_stub(node.p2p, peer, namespace=prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, tensors, parts, wire, first, whole = None, [], [], 0, None, True
            async for message in aiter_with_timeout(stream, timeout=timeout):
                first = first or time.monotonic() - began
                wire += len(message.tensor_part.buffer)
                if message.metadata:
                    metadata = MSGPackSerializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a new tensor begins
                    whole = whole and len(parts) >= parts[0].chunks
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                whole = whole and len(parts) >= parts[0].chunks
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        except Exception as exc:
            logger.warning(f"Could not download the state from {peer}: {exc!r}")
            continue
        if metadata and (not whole or expected is not None and len(tensors) != expected):
            # the stream ended early without an error (it happens: 11 of 24 tensors, no exception)
            logger.warning(f"The state from {peer} came incomplete ({len(tensors)} tensors"
                           f"{'' if expected is None else f' of {expected}'}): trying the next peer")
            continue
        if metadata:
            size = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in tensors)
            logger.info(f"Downloaded the swarm's state (step {metadata.get('epoch')}) from {peer} while joining,"
                        f" in {time.monotonic() - began:.1f} s (looked up in {began - asked:.1f} s, the first part"
                        f" after {first:.1f} s):"
                        f" {wire / 1e6:.2f} MB of tensors, {size / 1e6:.2f} MB in fp32")
            return metadata, tensors
    return None


class _UsesPrefetched(DecentralizedAverager):
    """Answers the first ``load_state_from_peers`` with the prefetched state, if it is recent enough."""

    prefetched: MPFuture | None = None
    min_epoch = 0  # an older prefetched state is dropped: hivemind would load again at once
    used_prefetched = False  # the last load took the prefetched state
    found_state = False  # the last load got a state (from the prefetch or a peer)

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        state = self._load_state(wait, timeout)
        self.found_state = state is not None
        return state

    def _state_tensors(self) -> int | None:
        """How many tensors a whole state of this averager has (None: not known)."""
        return None

    def _load_state(self, wait: bool, timeout: float | None):
        future, self.prefetched, self.used_prefetched = self.prefetched, None, False
        if future is not None and wait:
            try:
                state = future.result(timeout=timeout)
            except Exception as exc:
                logger.warning("The state downloaded while joining is lost (%r); downloading it again", exc)
                state = None
            whole = self._state_tensors()
            if state is not None and whole is not None and len(state[1]) != whole:
                logger.warning("The state downloaded while joining is incomplete (%d of %d tensors): downloading"
                               " it again", len(state[1]), whole)
                state = None
            if state is not None and state[0].get("epoch", -1) >= self.min_epoch:
                self.used_prefetched = True
                return state
            if state is not None:
                logger.info("The state downloaded while joining is from step %s, the swarm is at %d: downloading"
                            " it again", state[0].get("epoch"), self.min_epoch + 1)
        return super().load_state_from_peers(wait=wait, timeout=timeout)


class _HandsOverPacked:
    """Hands the state to its averager's process in one buffer per dtype instead of one tensor each.

    A newcomer's request reaches the averager's process, which asks the host (the training process)
    for its tensors through hivemind's pipe; each tensor crosses it as a file descriptor, fetched
    over a socket from a thread of the host that needs the host's interpreter lock: 0.2 s for 150
    tensors on an idle core (1 tensor: 0.01 s), and in the lab 0.4-1.3 s before the first part left
    a volunteer training on half a core (the demo's state is about 200 tensors). The buffers are a
    copy taken as the state is handed over (just after hivemind's lock, not under it); hivemind
    sent the live tensors, which the next steps change while they stream. The wire is unchanged."""

    def get_current_state(self):  # the host's side
        metadata, tensors, infos = super().get_current_state()
        if infos is None or len(infos) != len(tensors):
            return metadata, tensors, infos
        return metadata, pack(tensors), infos

    async def _get_current_state_from_host_process(self):  # the averager process's side
        metadata, tensors, infos = await super()._get_current_state_from_host_process()
        if infos is not None and len(tensors) != len(infos):
            tensors = unpack(tensors, infos)
        return metadata, tensors, infos


def pack(tensors) -> list:
    """Tensors concatenated into one flat buffer per dtype, in order of first appearance."""
    import torch

    parts: dict = {}
    for tensor in tensors:
        parts.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1))
    return [torch.cat(flat) for flat in parts.values()]


def unpack(buffers, infos) -> list:
    """``pack``'s tensors again, as views of its buffers, from their descriptors (shape, dtype)."""
    by_dtype = {buffer.dtype: buffer for buffer in buffers}
    offsets = dict.fromkeys(by_dtype, 0)
    tensors = []
    for info in infos:
        shape, dtype = tuple(info.descriptor.size), info.descriptor.dtype
        begin, count = offsets[dtype], info.descriptor.numel()
        tensors.append(by_dtype[dtype][begin:begin + count].view(shape))
        offsets[dtype] = begin + count
    if any(offsets[dtype] != buffer.numel() for dtype, buffer in by_dtype.items()):
        raise ValueError("the state's buffers do not match its tensors' descriptors")
    return tensors


class _ServesWholeSteps:
    """Serves a state whose step number and parameters agree. hivemind counts a global step as soon
    as it begins (``step(increment_epoch=True)``), and a delayed optimizer step (overlap) updates the
    parameters and the optimizer's statistics only after the step's gradient round, a second or two
    later: a state asked for in between was step N+1's number with step N's parameters and
    statistics, and its taker went on without step N's update (in the network lab, a volunteer that
    took the swarm's state just as the swarm took its first step). The host waits for the step, at
    most ``STEP_WAIT`` seconds, before it hands the state over."""

    STEP_WAIT = 20.0

    def __init__(self, *args, **kwargs):
        self._whole_step = threading.Event()
        self._whole_step.set()
        super().__init__(*args, **kwargs)
        self.finished_optimizer_step = _AlsoSets(self._whole_step)  # set by the step's background task

    def step(self, *args, increment_epoch: bool = False, optimizer_step: bool = False,
             delay_optimizer_step: bool = False, **kwargs):
        if increment_epoch and optimizer_step and delay_optimizer_step:
            self._whole_step.clear()  # step N+1 from now; its parameters once the background step ends
        return super().step(*args, increment_epoch=increment_epoch, optimizer_step=optimizer_step,
                            delay_optimizer_step=delay_optimizer_step, **kwargs)

    def get_current_state(self):  # the host's side
        if not self._whole_step.wait(self.STEP_WAIT):
            logger.warning("Serving the state of step %d before its optimizer step ended", self.local_epoch)
        return super().get_current_state()


class _AppliesUpdatesAtStepEnds:
    """Applies a delayed optimizer step's new parameters only when the next step ends, never in the
    middle of one. hivemind applies them at the first micro-batch after the background step ends
    (``step(apply_delayed_updates=True)`` before each one), so a step's gradient mixed micro-batches
    taken on two parameter versions, in proportions that vary from step to step, and with Adam at the
    demo's learning rate such a mix can make the loss jump by half for a step or two. Held to the
    step's end, every micro-batch of a step sees the same parameters, one step old: DeDLOC's delayed
    parameter updates. The step's end waits for the update and applies it, as before."""

    def step(self, *args, wait_for_delayed_updates: bool | None = None, apply_delayed_updates: bool = True,
             **kwargs):
        if apply_delayed_updates and not wait_for_delayed_updates and not args and not any(kwargs.values()):
            apply_delayed_updates = False  # hivemind's call before each micro-batch: nothing else to do
        return super().step(*args, wait_for_delayed_updates=wait_for_delayed_updates,
                            apply_delayed_updates=apply_delayed_updates, **kwargs)


class _AlsoSets(threading.Event):
    """An Event whose ``set`` also sets ``other``."""

    def __init__(self, other: threading.Event):
        super().__init__()
        self.other = other

    def set(self) -> None:
        super().set()
        self.other.set()


class TrainingStateAverager(_AppliesUpdatesAtStepEnds, LeavesLoneParameterRounds, _ServesWholeSteps,
                            _HandsOverPacked, state_averager.TrainingStateAverager, KeepsItsParameterRounds,
                            _UsesPrefetched):
    """hivemind's TrainingStateAverager whose next load may use a state downloaded beforehand, that
    applies a delayed update at a step's end, leaves a parameter round that finds no group rather
    than wait for it (``parameter_rounds``), serves a state only once its step's delayed update is in
    it, and that hands it to its own process packed (the same class name: it names the handlers on
    the wire)."""

    def _state_tensors(self) -> int:
        return len(state_averager.TrainingStateAverager.get_current_state(self)[1])  # hivemind's, unpacked
