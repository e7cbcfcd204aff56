"""GGUF-quantized weights kept in the file's block layout: QuantizedLinear and QuantizedEmbedding.

The raw blocks stay a uint8 tensor [out_features, row_bytes] (a view of the file's memory map where
the caller passes one). On CPU with the native kernels built (kernels/native.py), the kernel
runtime/models/cpu_kernels.py picks for the step's rows multiplies the blocks in place;
otherwise many rows dequantize tiles of output rows and run torch's blocked matmul on them. On
CUDA kernels/triton_gguf.py multiplies (and dequantizes) the blocks; triton is imported only
there, on first use. Elsewhere, and for types without a kernel, the weight is dequantized with
gguf-py (the oracle) and F.linear runs.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.native import native_ops
from kernels.row_max import largest
from runtime.models.cpu_kernels import native_kernel, rounds_to_int8, vector_dequantize

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
NATIVE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
TRITON_TYPES = NATIVE_TYPES  # kernels/triton_gguf.py's
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
TILE_VALUES = 1 << 20  # dequantized values per tile (2 MiB in bfloat16: stays in L2)
MATMUL_ROWS = 64  # torch's matmul on a dequantized tile always takes this many rows (the last
# chunk zero-padded): oneDNN picks its kernel by the row count, and with AMX a row rounded
# differently in a 40-row prompt than in the 8 rows a prefix-cache hit left of it
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


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight of the file kept in its blocks: [out_features, row_bytes] uint8 rows standing
    for float rows of in_features values."""

    blocks: torch.Tensor
    ggml_type: Q
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]


def quantized_kernel_types(device: torch.device | str) -> frozenset:
    """The GGUF types a kernel multiplies in their blocks on `device`: weights of these types
    stay quantized there; the rest are dequantized at load."""
    device = torch.device(device)
    if device.type == "cpu":
        return NATIVE_TYPES
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return TRITON_TYPES
    return frozenset()


def _fixed_rows_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(rows, weight), MATMUL_ROWS rows a call: a row's result does not depend on how
    many rows come with it."""
    y = rows.new_empty(rows.shape[0], weight.shape[0])
    for start in range(0, rows.shape[0], MATMUL_ROWS):
        chunk = rows[start : start + MATMUL_ROWS]
        count = chunk.shape[0]
        if count < MATMUL_ROWS:
            chunk = F.pad(chunk, (0, 0, 0, MATMUL_ROWS - count))
        y[start : start + count] = F.linear(chunk, weight)[:count]
    return y


def _triton_gguf():
    from kernels import triton_gguf  # imports triton: CUDA only

    return triton_gguf


def gemv_input(rows: torch.Tensor, planes: list):
    """On CUDA, rows quantized once for the parts (their planes) of a projection that the
    integer-dot GEMV multiplies (kernels/triton_gguf_dot.py); None where every part quantizes
    them inside its GEMV."""
    from kernels.triton_gguf_dot import quantize_x, quantizes_in_kernel

    if all(quantizes_in_kernel(part) for part in planes):
        return None
    return quantize_x(rows)


class QuantizedSpec(NamedTuple):
    """What a quantized weight will be, before its blocks are read."""

    ggml_type: Q
    out_features: int
    in_features: int


def row_bytes(ggml_type, in_features: int) -> int:
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    if in_features % block_values:
        raise ValueError(f"in_features {in_features} is not a multiple of {block_values}")
    return in_features // block_values * block_bytes


class QuantizedWeight(nn.Module):
    """The blocks, their type and the float shape [out_features, in_features] they stand for.
    blocks None: an empty buffer of the right size (on the default device: meta while the model
    is built), filled later by load_rows. On CUDA the GPU kernels read kernels/gguf_planes.py's
    planes instead, made from the blocks once they are loaded (`gpu_planes`)."""

    def __init__(self, blocks, ggml_type, out_features: int, in_features: int):
        super().__init__()
        self.ggml_type = Q(ggml_type)
        self.out_features, self.in_features = out_features, in_features
        size = row_bytes(self.ggml_type, in_features)
        if blocks is None:
            raw = torch.empty(out_features, size, dtype=torch.uint8)
        else:
            raw = _raw_blocks(blocks, out_features)
        if raw.shape[1] != size:
            raise ValueError(
                f"{tuple(raw.shape)} bytes do not hold [{out_features}, {in_features}]"
            )
        self.register_buffer("blocks", raw, persistent=False)
        self.planes = None

    @property
    def weight_nbytes(self) -> int:
        return self.blocks.numel() if self.planes is None else self.planes.data.nbytes

    def __call__(self, *args):  # layers.StepModule's: called in every layer of every step
        return self.forward(*args)

    def load_rows(self, start: int, blocks: torch.Tensor) -> None:
        self.blocks[start : start + blocks.shape[0]].copy_(blocks)

    def gpu_planes(self):
        """The planes the GPU kernels read, repacked from the blocks on first use (the loader
        asks once every weight is loaded); the blocks are dropped then."""
        if self.planes is None:
            from kernels.gguf_planes import repack

            self.planes = repack(self.blocks, self.ggml_type, self.in_features)
            self.blocks = self.blocks.new_empty(0, self.blocks.shape[1])
        return self.planes

    def _on_gpu(self) -> bool:
        return self.blocks.is_cuda and self.ggml_type in TRITON_TYPES

    def _native(self):
        if self.blocks.device.type != "cpu" or self.ggml_type not in NATIVE_TYPES:
            return None
        return native_ops()

    def dequantize(self, rows: slice = slice(None), dtype=torch.float32) -> torch.Tensor:
        """[len(rows), in_features] in dtype of the given output rows (all by default)."""
        if self._on_gpu():
            ids = torch.arange(self.out_features, device=self.blocks.device)[rows]
            return _triton_gguf().gguf_dequantize(self.gpu_planes(), dtype, ids)
        return _dequantize_blocks(self, self.blocks[rows], dtype)

    def matmul(self, rows: torch.Tensor, quantized=None, out=None, bias=None) -> torch.Tensor:
        """rows [n, in_features] -> [n, out_features] in rows' dtype (+ bias). quantized: on
        CUDA, what gemv_input made of rows (shared by the parts of a projection); out: where the
        result goes (a new tensor if None)."""
        if self._on_gpu():
            return _triton_gguf().gguf_matmul(rows, self.gpu_planes(), quantized, out, bias)
        y = self._matmul_here(rows)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y if out is None else out.copy_(y)

    def _matmul_here(self, rows: torch.Tensor) -> torch.Tensor:
        kernel = native_kernel(self._native(), rows)
        if kernel is not None:
            return kernel(
                rows, self.blocks, int(self.ggml_type), self.out_features, self.in_features
            )
        y = rows.new_empty(rows.shape[0], self.out_features)
        tile = max(1, TILE_VALUES // self.in_features)
        for start in range(0, self.out_features, tile):
            part = slice(start, min(start + tile, self.out_features))
            y[:, part] = _fixed_rows_linear(rows, self.dequantize(part, rows.dtype))
        return y

    def rescore_largest(self, rows: torch.Tensor, outputs: torch.Tensor, count: int) -> None:
        """outputs [n, out_features]: matmul(rows). Where that rounded rows to 8 bits, each
        row's `count` largest outputs are recomputed in place from rows as they are (float64
        sums): the largest logits, and so the argmax, as float activations give them."""
        if self._native() is None or not rounds_to_int8(rows):
            return
        n, count = rows.shape[0], min(count, self.out_features)
        columns = largest(outputs, count)  # [n, count]
        picked = self.blocks.index_select(0, columns.reshape(-1))
        weights = _dequantize_blocks(self, picked).view(n, count, self.in_features)
        exact = torch.bmm(weights.double(), rows.double().unsqueeze(-1))  # [n, count, 1]
        outputs.scatter_(1, columns, exact.squeeze(-1).to(outputs.dtype))

    @classmethod
    def from_reader_tensor(cls, tensor, **kwargs):
        """From a gguf-py ReaderTensor: shape lists ne0 (in_features, contiguous) first."""
        in_features, out_features = (int(n) for n in tensor.shape[:2])
        return cls(tensor.data, tensor.tensor_type, out_features, in_features, **kwargs)


class QuantizedLinear(QuantizedWeight):
    """y [n, out] = x [n, in] @ W^T (+ bias), W in GGUF blocks. A fused projection (q/k/v,
    gate/up) whose parts share a type is one QuantizedLinear: `part_rows` says where each part
    starts."""

    def __init__(
        self, blocks, ggml_type, out_features: int, in_features: int, bias=None,
        part_rows: tuple[int, ...] | None = None,
    ):  # fmt: skip
        super().__init__(blocks, ggml_type, out_features, in_features)
        if bias is True:  # filled when the checkpoint is loaded
            bias = torch.zeros(out_features)
        if bias is None or bias is False:
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.as_tensor(bias), requires_grad=False)
        self.part_starts = _starts(part_rows or (out_features,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2
        y = self.matmul(x if flat else x.reshape(-1, self.in_features), bias=self.bias)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def load_part(self, part: int, tensor: QuantizedTensor) -> None:
        self.load_rows(self.part_starts[part], tensor.blocks)


class ConcatLinear(nn.Module):
    """A fused projection whose parts have different types (Q4_K_M files mix Q4_K and Q6_K
    within q/k/v): one QuantizedLinear per part, their outputs side by side."""

    def __init__(self, parts: list[tuple[Q, int]], in_features: int, bias: bool):
        super().__init__()
        self.parts = nn.ModuleList(
            QuantizedLinear(None, ggml_type, rows, in_features) for ggml_type, rows in parts
        )
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in parts)
        self.starts = _starts(tuple(rows for _, rows in parts))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False)

    @property
    def weight_nbytes(self) -> int:
        return sum(part.weight_nbytes for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.parts[0]._on_gpu() and rows.shape[0] <= _triton_gguf().GEMV_ROWS:
            y = self._gemv(rows)
        else:
            y = torch.cat([part.matmul(rows) for part in self.parts], dim=-1)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _gemv(self, rows: torch.Tensor) -> torch.Tensor:
        """Each part's GEMV writes its columns of the output in place (no torch.cat), its bias
        added, x quantized at most once for all of them."""
        quantized = gemv_input(rows, [part.gpu_planes() for part in self.parts])
        y = rows.new_empty(rows.shape[0], self.out_features)
        for part, start in zip(self.parts, self.starts):
            columns = slice(start, start + part.out_features)
            bias = None if self.bias is None else self.bias[columns]
            part.matmul(rows, quantized, y[:, columns], bias)
        return y

    def load_part(self, part: int, tensor: QuantizedTensor) -> None:
        self.parts[part].load_rows(0, tensor.blocks)


def repack_for_gpu(module: nn.Module) -> None:
    """Every quantized weight of module on CUDA into the GPU kernels' planes, once loaded."""
    for weight in module.modules():
        if isinstance(weight, QuantizedWeight) and weight._on_gpu():
            weight.gpu_planes()


def quantized_projection(parts: list[tuple[Q, int]], in_features: int, bias: bool) -> nn.Module:
    """The module for a (fused) projection whose parts, in order, are (type, rows)."""
    types = {ggml_type for ggml_type, _ in parts}
    if len(types) > 1:
        return ConcatLinear(parts, in_features, bias)
    rows = tuple(r for _, r in parts)
    return QuantizedLinear(None, parts[0][0], sum(rows), in_features, bias, part_rows=rows)


def _starts(rows: tuple[int, ...]) -> tuple[int, ...]:
    starts, total = [], 0
    for count in rows:
        starts.append(total)
        total += count
    return tuple(starts)


class QuantizedEmbedding(QuantizedWeight):
    """ids [...] -> [..., embedding_dim] in `dtype`, dequantizing only the rows looked up.
    out_features is the vocabulary, in_features the embedding dimension (GGUF's ne1, ne0). A tied
    lm_head multiplies by the same blocks (`matmul`)."""

    def __init__(self, blocks, ggml_type, out_features, in_features, dtype=torch.float32):
        super().__init__(blocks, ggml_type, out_features, in_features)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.is_cuda:  # no host sync (CUDA graphs capture it)
            values = _triton_gguf().gguf_dequantize(self.gpu_planes(), self.dtype, flat)
            return values.reshape(*ids.shape, self.in_features)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"token id out of range [0, {self.out_features})")
        unique, inverse = torch.unique(flat, return_inverse=True)
        picked = self.blocks.index_select(0, unique.to(self.blocks.device))
        values = _dequantize_blocks(self, picked, self.dtype)
        return values[inverse].reshape(*ids.shape, self.in_features)

    def load_part(self, part: int, tensor: QuantizedTensor) -> None:
        self.load_rows(0, tensor.blocks)


def _dequantize_blocks(
    weight: QuantizedWeight, picked: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """[len(picked), in_features] in dtype of picked rows of weight's blocks (on the CPU)."""
    ops = weight._native()
    shape = (int(weight.ggml_type), picked.shape[0], weight.in_features)
    if ops is not None and dtype in (torch.float32, torch.bfloat16) and vector_dequantize():
        return ops.quant_dequantize_as(picked, *shape, dtype)
    if ops is not None:
        return ops.quant_dequantize(picked, *shape).to(dtype)
    if weight.ggml_type not in NATIVE_TYPES and weight.ggml_type not in _logged_slow_types:
        _logged_slow_types.add(weight.ggml_type)
        log.info("no quantized kernel for %s: dequantized with gguf-py", weight.ggml_type.name)
    values = gguf.quants.dequantize(picked.cpu().numpy(), weight.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(picked.device, dtype)


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
