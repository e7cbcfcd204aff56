"""GGUF-quantized weights kept in the file's block layout: QuantizedLinear and QuantizedEmbedding.

The raw blocks stay a uint8 tensor [out_features, row_bytes] (a view of the file's memory map where
the caller passes one). On CPU with the native kernels built (kernels/native.py) a few rows run
kernels/cpu/quant_matmul.cpp, which reads each weight byte once; many rows (prefill) dequantize
tiles of output rows and run torch's blocked matmul on them. Elsewhere, and for types without a
kernel, the weight is dequantized with gguf-py (the oracle) and F.linear runs.
"""

from __future__ import annotations

import logging
import warnings

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.native import native_ops

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
NATIVE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
DECODE_ROWS = 16  # at most this many rows run the fused kernel; more dequantize tiles
TILE_VALUES = 1 << 22  # dequantized floats per prefill tile (16 MiB)
_logged_slow_types: set[Q] = set()


def _raw_blocks(data: np.ndarray | torch.Tensor, out_features: int) -> torch.Tensor:
    """[out_features, row_bytes] uint8, sharing memory with `data` (a read-only memmap too: the
    blocks are never written through this view, so torch's warning about it is silenced)."""
    if isinstance(data, torch.Tensor):
        return data.view(torch.uint8).reshape(out_features, -1)
    array = np.ascontiguousarray(data).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(array)
    return blocks.reshape(out_features, -1)


class _QuantizedWeight(nn.Module):
    """The blocks, their type and the float shape [out_features, in_features] they stand for."""

    def __init__(self, blocks, ggml_type, out_features: int, in_features: int):
        super().__init__()
        self.ggml_type = Q(ggml_type)
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[self.ggml_type]
        if in_features % block_values:
            raise ValueError(f"in_features {in_features} is not a multiple of {block_values}")
        self.out_features, self.in_features = out_features, in_features
        raw = _raw_blocks(blocks, out_features)
        if raw.shape[1] != in_features // block_values * block_bytes:
            raise ValueError(
                f"{tuple(raw.shape)} bytes do not hold [{out_features}, {in_features}]"
            )
        self.register_buffer("blocks", raw, persistent=False)

    @property
    def weight_nbytes(self) -> int:
        return self.blocks.numel()

    def _native(self):
        if self.blocks.device.type != "cpu" or self.ggml_type not in NATIVE_TYPES:
            return None
        return native_ops()

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [len(rows), in_features] of the given output rows (all by default)."""
        blocks = self.blocks[rows]
        ops = self._native()
        if ops is not None:
            return ops.quant_dequantize(
                blocks, int(self.ggml_type), blocks.shape[0], self.in_features
            )
        if self.ggml_type not in NATIVE_TYPES and self.ggml_type not in _logged_slow_types:
            _logged_slow_types.add(self.ggml_type)
            log.info("no quantized kernel for %s: dequantized with gguf-py", self.ggml_type.name)
        values = gguf.quants.dequantize(blocks.cpu().numpy(), self.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(blocks.device)

    @classmethod
    def from_reader_tensor(cls, tensor, **kwargs):
        """From a gguf-py ReaderTensor: shape lists ne0 (in_features, contiguous) first."""
        in_features, out_features = (int(n) for n in tensor.shape[:2])
        return cls(tensor.data, tensor.tensor_type, out_features, in_features, **kwargs)


class QuantizedLinear(_QuantizedWeight):
    """y [n, out] = x [n, in] @ W^T (+ bias), W in GGUF blocks."""

    def __init__(self, blocks, ggml_type, out_features: int, in_features: int, bias=None):
        super().__init__(blocks, ggml_type, out_features, in_features)
        self.bias = (
            None if bias is None else nn.Parameter(torch.as_tensor(bias), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        ops = self._native()
        if ops is not None and rows.shape[0] <= DECODE_ROWS:
            y = ops.quant_matmul(
                rows, self.blocks, int(self.ggml_type), self.out_features, self.in_features
            )
        else:
            y = self._tiled_linear(rows)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _tiled_linear(self, rows: torch.Tensor) -> torch.Tensor:
        y = rows.new_empty(rows.shape[0], self.out_features)
        tile = max(1, TILE_VALUES // self.in_features)
        for start in range(0, self.out_features, tile):
            part = slice(start, min(start + tile, self.out_features))
            y[:, part] = F.linear(rows, self.dequantize(part).to(rows.dtype))
        return y


class QuantizedEmbedding(_QuantizedWeight):
    """ids [...] -> [..., embedding_dim] float32, dequantizing only the rows looked up.
    out_features is the vocabulary, in_features the embedding dimension (GGUF's ne1, ne0)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"token id out of range [0, {self.out_features})")
        unique, inverse = torch.unique(flat, return_inverse=True)
        picked = self.blocks.index_select(0, unique.to(self.blocks.device))
        values = _dequantize_blocks(self, picked)
        return values[inverse].reshape(*ids.shape, self.in_features)


def _dequantize_blocks(weight: _QuantizedWeight, picked: torch.Tensor) -> torch.Tensor:
    ops = weight._native()
    if ops is not None:
        return ops.quant_dequantize(
            picked, int(weight.ggml_type), picked.shape[0], weight.in_features
        )
    values = gguf.quants.dequantize(picked.cpu().numpy(), weight.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(picked.device)


# byte offsets of the float16 fields in each block (ggml-common.h); the rest may be any bits
HALF_OFFSETS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip


def random_blocks(qtype, out_features: int, in_features: int, rng) -> np.ndarray:
    """[out, row_bytes] uint8 of random quants and scales with finite float16 scale fields: test
    and benchmark weights for every type, K-quants included (gguf-py cannot quantize those)."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    count = out_features * in_features // block_values
    blocks = rng.integers(0, 256, (count, block_bytes)).astype(np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        halves = rng.uniform(-0.02, 0.02, count).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(out_features, -1)
