"""Averaging DiLoCo deltas (outer model minus local parameters) with hivemind's DecentralizedAverager.

Only deltas cross the network, compressed by one of ``CODECS``; weights never do (quantizing
weights costs 1.6-2.6x an update, quantizing the update 1.6-2.6 % of it; see DESIGN.md). The outer
state (outer parameters, momentum, round) is served to newcomers uncompressed, so they start from
exactly the swarm's outer model.

Error feedback (lossy codecs, ``LOSSY``): the codec is wrapped in ``ErrorFeedback``, which records,
for every part this peer sends to another reducer, what the codec lost (the part minus its decoded
wire form) in buffers shared with the averager's process. Parts this peer reduces itself never go
through the codec and lose nothing. That record serves twice:

- hivemind hands a sender its own exact part plus the reducer's compressed ``average - decoded
  part``, so the sender's average holds its own loss, which the reducer's does not; ``average``
  takes it back out: every peer gets the reducer's average, up to the codec's error on the reply
  (less drift between peers);
- ``sent_errors`` gives the loss; the caller (``diloco``) adds it to its next delta, so what one
  round's codec dropped is sent in the next (as in 1-bit Adam and SparseLoCo) and the codec's error
  on the group's average does not build up over rounds. The error on the reply is not fed back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from .quant4 import Absmax4BitQuantization

logger = logging.getLogger(__name__)

CODECS: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "8bit": Uniform8BitQuantization,
    "4bit": Absmax4BitQuantization,
}
LOSSY = frozenset({"8bit", "4bit"})  # codecs whose loss is fed back (error feedback) by default

# (metadata, tensors) that a peer serves to newcomers
StateProvider = Callable[[], tuple[dict[str, Any], Sequence[torch.Tensor]]]


@dataclass(frozen=True)
class RoundResult:
    """What one averaging attempt gave: the group's gathered metadata (peer id -> dict), or None."""

    gathered: dict[str, dict[str, Any]] | None
    error: str = ""

    @property
    def group_size(self) -> int:
        return len(self.gathered or {})


class ErrorFeedback(CompressionBase):
    """A codec that records what ``codec`` loses on each part it compresses, in shared buffers shaped
    like the averaged tensors (hivemind gives each part its tensor's index as ``info.key``)."""

    def __init__(self, codec: CompressionBase, shapes: Sequence[torch.Size]):
        self.codec, self.compression_type = codec, codec.compression_type
        self.errors = [torch.zeros(shape).share_memory_() for shape in shapes]  # before the averager forks

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        wire = self.codec.compress(tensor, info, allow_inplace=False)
        start = info.part_index * (info.part_size or 0)
        lost = tensor.detach().reshape(-1).float() - self.codec.extract(wire).reshape(-1).float()
        self.errors[info.key].view(-1)[start:start + lost.numel()].copy_(lost)
        return wire

    def extract(self, serialized_tensor):
        return self.codec.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.estimate_compression_ratio(info)


class DeltaAverager(DecentralizedAverager):
    """A DecentralizedAverager over delta buffers shaped like the model's parameters.

    ``error_feedback``: record what the codec loses (``sent_errors``); default: for ``LOSSY`` codecs."""

    def __init__(self, shapes: Sequence[torch.Size], dht, *, prefix: str, compression: str,
                 state_provider: StateProvider, min_matchmaking_time: float, request_timeout: float = 3.0,
                 next_chunk_timeout: float | None = None, error_feedback: bool | None = None, **kwargs: Any):
        if compression not in CODECS:
            raise ValueError(f"unknown delta compression {compression!r}; expected one of {sorted(CODECS)}")
        self._state_provider = state_provider
        self._state_lock = threading.Lock()
        codec = CODECS[compression]()
        if (compression in LOSSY) if error_feedback is None else error_feedback:
            codec = ErrorFeedback(codec, shapes)
        self.feedback = codec if isinstance(codec, ErrorFeedback) else None
        super().__init__(
            [torch.zeros(shape) for shape in shapes], dht, prefix=prefix, start=True,
            compression=codec, state_compression=NoCompression(),
            min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
            next_chunk_timeout=next_chunk_timeout, **kwargs,
        )

    def get_current_state(self):  # runs in this (the host) process when a newcomer asks
        metadata, tensors = self._state_provider()
        return metadata, [t.detach().cpu().clone() for t in tensors], None

    def average(self, deltas: Sequence[torch.Tensor], *, weight: float, gather: dict[str, Any],
                timeout: float) -> tuple[RoundResult, list[torch.Tensor]]:
        """One all-reduce of ``deltas`` (weighted by ``weight``); returns the result and the averaged
        deltas (this peer's own deltas if the round failed). The buffers are refilled every call, so
        a round that failed half-way (a peer killed while reducing) leaves nothing behind."""
        with self.get_tensors() as buffers:
            for buffer, delta in zip(buffers, deltas, strict=True):
                buffer.copy_(delta)
        for error in self.feedback.errors if self.feedback else ():
            error.zero_()  # parts reduced here lose nothing; a retry may give them to other peers
        try:
            gathered = self.step(gather=gather, weight=weight, timeout=timeout, allow_retries=False, wait=True)
        except Exception as exc:  # hivemind raises many kinds; a failed round is normal
            gathered, error = None, f"{type(exc).__name__}: {exc}"
        else:
            error = "" if gathered else "no group"
        if not gathered:
            return RoundResult(None, error), [d.clone() for d in deltas]
        with self.get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        if self.feedback:  # our own average held our codec's loss, which the reducers' did not
            averaged = [a - e for a, e in zip(averaged, self.feedback.errors, strict=True)]
        return RoundResult({str(k): v for k, v in gathered.items()}, error), averaged

    def sent_errors(self) -> list[torch.Tensor] | None:
        """What the codec lost on this peer's parts in the last ``average`` (None without error feedback)."""
        return [e.clone() for e in self.feedback.errors] if self.feedback else None

    def download_state_from(self, peer: str, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The state (metadata, tensors) of one given peer, or None. ``load_state_from_peers`` picks
        the peer by its published priority; an outer-model resync needs one agreed peer."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer=peer, timeout=timeout, future=future)))
        try:
            return future.result(timeout=timeout + 5)
        except Exception:  # a resync that fails is retried at the next one
            logger.warning("could not download the state of %s", peer, exc_info=True)
            return None

    async def _download_state_from(self, future: MPFuture, peer: str, timeout: float) -> None:
        # hivemind's _load_state_from_peers (averaging/averager.py), for one given peer
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, tensors, parts = None, [], []
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            future.set_result((metadata, tensors) if metadata else None)
        except Exception as exc:
            logger.warning("downloading the state of %s failed: %r", peer, exc)
        finally:
            if not future.done():
                future.set_result(None)
