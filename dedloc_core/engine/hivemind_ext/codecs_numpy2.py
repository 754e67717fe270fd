"""8-bit codecs under NumPy 2: hivemind's 8-bit tensors decode again.

Upstream: ``hivemind/compression/quantization.py``: ``Quantization.extract`` and
``BlockwiseQuantization.extract`` (replaced whole), ``Uniform8BitQuantization.quantize``
(replaced whole).

Without it: both ``extract`` read the codebook size with ``int(np.frombuffer(..., count=1))``, a
1-element array, which NumPy 2 refuses (``TypeError: only 0-dimensional arrays can be converted
to Python scalars``): every 8-bit tensor fails to decode. ``quantize`` calls
``torch.quantize_per_tensor``, deprecated by torch 2.13.

Fix: read element ``[0]`` (the upstream fix, made after 1.1.12); compute the uint8 indices (round
half to even, clamped to 0..255) with plain tensor ops. The wire format is unchanged; a value that
lies within float rounding of a bin's edge may land one bin away from ``quantize_per_tensor``'s
(7 of 2 million indices in a check).

Kind: bug fix (belongs upstream; docs/hivemind/codecs_numpy2.patch)

Shown: ``tests/test_diloco.py`` (every 8-bit codec round-trips; without this the decode raises).
"""

from __future__ import annotations

REPLACES = [
    "hivemind.compression.quantization.Quantization.extract",
    "hivemind.compression.quantization.BlockwiseQuantization.extract",
    "hivemind.compression.quantization.Uniform8BitQuantization.quantize",
]


def install() -> None:
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
