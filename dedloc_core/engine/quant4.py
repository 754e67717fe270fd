"""A 4-bit codec for hivemind's all-reduce: blockwise absmax, two values a byte (DiLoCo deltas).

Each block of ``BLOCK`` values is scaled by its largest magnitude over 7 (an fp16 scale) and
rounded to the nearest of the 15 levels -7..7; the codes are packed two a byte. On the wire: the
block size (uint32), the scales (fp16), the packed codes: ``4 + 2 * ceil(n / BLOCK) + ceil(n / BLOCK)
* BLOCK / 2`` bytes for n values (0.516 bytes a value at 128). Each value is off by at most half a
step, ``absmax / 14`` of its block (about 12 % of the norm for Gaussian values). A zero block stays
zero; a block with a non-finite value decodes non-finite (``robust`` then drops the part).

Registration: hivemind 1.1.12 decodes a tensor by the name of its ``runtime_pb2.CompressionType``
(``compression/serialization.py``: ``_BASE_COMPRESSION_TYPES[CompressionType.Name(x)]``, also for
the reducer's reply, ``allreduce.py`` ``serialize_torch_tensor(..., part_compression)``), and the
enum has no 4-bit value. The enum is proto3, hence open: a ``Tensor`` carries any number. So
``register`` gives the number ``WIRE_TYPE`` (64, far from upstream's 0-5) the name ``NAME`` (an
instance attribute of the enum's wrapper that shadows ``EnumTypeWrapper.Name`` for that one number)
and adds the codec to hivemind's table. Importing this module registers (idempotent), so every
process that builds the codec, and the averager it forks, decodes 4-bit tensors. No existing enum value
is reused: a peer without this module fails to decode (``ValueError``) instead of misreading.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

BLOCK = 128  # values a scale
LEVELS = 7  # codes -7..7, stored as 1..15
WIRE_TYPE = 64
NAME = "ABSMAX_4BIT"
FP16_MAX = float(torch.finfo(torch.float16).max)


class Absmax4BitQuantization(CompressionBase):
    """Blockwise absmax 4-bit quantization (see the module's docstring)."""

    compression_type = WIRE_TYPE

    def __init__(self, block: int = BLOCK):
        if block <= 0 or block % 2:
            raise ValueError(f"block must be a positive even number, got {block}")
        self.block = block

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"{type(self).__name__} does not support {tensor.dtype} tensors")
        scales, packed = quantize(tensor.detach().reshape(-1), self.block)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=b"".join((np.uint32(self.block).tobytes(), scales.numpy().tobytes(), packed.numpy().tobytes())),
            size=tensor.shape, dtype=str(tensor.dtype).removeprefix("torch."), requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, shape = serialized_tensor.buffer, tuple(serialized_tensor.size)
        block = int(np.frombuffer(buffer, dtype=np.uint32, count=1)[0])
        n = math.prod(shape)
        blocks = -(-n // block)
        scales = torch.from_numpy(np.frombuffer(buffer, dtype=np.float16, count=blocks, offset=4).copy())
        packed = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=blocks * block // 2,
                                                offset=4 + 2 * blocks).copy())
        values = dequantize(scales, packed, n, block)
        return values.reshape(shape).to(getattr(torch, serialized_tensor.dtype)).requires_grad_(
            serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (4 + 16 / self.block) / torch.finfo(info.descriptor.dtype).bits


def quantize(flat: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 scales, one a block; uint8 codes, two a byte) of a 1-d tensor."""
    flat = flat.float()
    blocks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    scales = torch.where(torch.isfinite(absmax), (absmax / LEVELS).clamp(max=FP16_MAX), math.nan).half()
    usable = scales.float() > 0  # not a zero block, nor a non-finite one (a NaN scale)
    codes = torch.round(blocks / torch.where(usable, scales.float(), 1.0)[:, None]).clamp_(-LEVELS, LEVELS)
    codes = codes.where(usable[:, None], 0.0).add_(8).to(torch.uint8).view(-1, 2)
    return scales, codes[:, 0] | (codes[:, 1] << 4)


def dequantize(scales: torch.Tensor, packed: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """The ``n`` float32 values that ``quantize`` encoded."""
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1, block).float().sub_(8)
    return (codes * scales.float()[:, None]).view(-1)[:n]


def register() -> None:
    """Teach hivemind's (de)serialization the 4-bit codec's wire type (see the module's docstring)."""
    from hivemind.compression import serialization

    if NAME in serialization._BASE_COMPRESSION_TYPES:
        return
    wrapper = runtime_pb2.CompressionType
    upstream = wrapper.Name

    def name(number: int) -> str:
        return NAME if number == WIRE_TYPE else upstream(number)

    wrapper.Name = name  # type: ignore[method-assign]
    serialization._BASE_COMPRESSION_TYPES[NAME] = Absmax4BitQuantization()


register()  # whoever can build the codec can also decode it
