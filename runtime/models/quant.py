"""GGUF-quantized weights kept in the file's block layout: QuantizedLinear and QuantizedEmbedding.

The raw blocks stay a uint8 tensor [out_features, row_bytes] (a view of the file's memory map where
the caller passes one). On CPU with the native kernels built (kernels/native.py) a few rows run
kernels/cpu/quant_dot.cpp (integer dots, x86) or quant_matmul.cpp (float), which read each weight
byte once; many rows (prefill, batched decode) in bfloat16 run quant_gemm_int8.cpp (x in 8 bits,
weights unpacked a tile per thread, vpdpbusd, AVX-512 VNNI) from INT8_GEMM_ROWS rows and for every
prompt step, and quant_gemm.cpp (tiles dequantized to bfloat16, AVX-512 BF16) below that;
otherwise many rows dequantize tiles of output rows and run torch's blocked matmul on them. On CUDA kernels/triton_gguf.py multiplies
(and dequantizes) the blocks; triton is imported only there, on first use. Elsewhere, and for
types without a kernel, the weight is dequantized with gguf-py (the oracle) and F.linear runs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.native import cpu_flags, native_ops

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
NATIVE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
TRITON_TYPES = NATIVE_TYPES  # kernels/triton_gguf.py's
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
DECODE_ROWS = 6  # at most this many rows run the integer-dot kernel (one pass: kMaxRows with
# AVX-512); more dequantize tiles (quant_gemm for bfloat16: at 4-6 rows it took 1.5-1.8x longer)
SCALAR_DEQUANTIZE_DECODE_ROWS = 48  # the same without AVX-512 (AVX2): dequantizing a tile is
# scalar there, and quant_dot, a pass per 4 rows, stays faster up to about 48 rows
INT8_GEMM_ROWS = 16  # from this many rows bfloat16 rows take quant_gemm_int8: it multiplies 16
# rows at a time, and below 16 the bfloat16 tiles were faster (docs/benchmarks.md)
TILE_VALUES = 1 << 20  # dequantized values per tile (2 MiB in bfloat16: stays in L2)
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


@functools.cache
def integer_dots() -> bool:
    """Activations quantized to int16 per group (near float32's error), weights unpacked to int16
    and integer dot products (kernels/cpu/quant_dot.cpp, x86 with AVX2 at least); else the float
    kernel (quant_matmul.cpp)."""
    ops = native_ops()
    return ops is not None and ops.quant_dot_available()


@functools.cache
def bf16_tiles() -> bool:
    """Many bfloat16 rows multiply in kernels/cpu/quant_gemm.cpp (AVX-512 BF16): each thread
    dequantizes a tile that stays in its L2 and multiplies it at once. Not where the CPU has AMX:
    there torch's matmul (oneDNN's AMX tiles) multiplies far faster than vdpbf16ps."""
    ops = native_ops()
    return ops is not None and ops.quant_gemm_available() and "amx_bf16" not in cpu_flags()


@functools.cache
def int8_tiles() -> bool:
    """Many bfloat16 rows multiply in kernels/cpu/quant_gemm_int8.cpp (AVX-512 VNNI): x rounded
    to 8 bits per group as llama.cpp's Q8 activations, twice the products a cycle of
    vdpbf16ps. Not where the CPU has AMX (torch's matmul is faster there)."""
    ops = native_ops()
    return ops is not None and ops.quant_gemm_int8_available() and "amx_bf16" not in cpu_flags()


class _StepKind(threading.local):
    has_prompt_rows = False  # the step running on this thread computes prompt tokens
    drafted_seqs = 0  # its sequences, where speculative drafts give them more rows (else 0)
    int8_activations = True  # --quantized-activations int8


_STEP = _StepKind()


@contextmanager
def step_kind(has_prompt_rows: bool, drafted_seqs: int = 0, int8_activations: bool = True):
    """While a step runs on this thread, its kind picks its quantized matmuls' kernel:
    - computing prompt tokens: the many-rows kernel for every row count, so that a prompt's
      rows round the same whether they come in one chunk or as the two or three tokens a
      prefix-cache hit leaves (the integer kernel rounds otherwise, and a greedy near-tie
      followed the cache: tests/test_quantized_model.py);
    - with drafts, drafted_seqs sequences: the kernel the same step without drafts would take,
      so that verified tokens round as plain decodes do (tests/test_spec_real_model.py);
    - int8_activations false (--quantized-activations dtype): no 8-bit activations."""
    previous = _STEP.has_prompt_rows, _STEP.drafted_seqs, _STEP.int8_activations
    _STEP.has_prompt_rows, _STEP.drafted_seqs = has_prompt_rows, drafted_seqs
    _STEP.int8_activations = int8_activations
    try:
        yield
    finally:
        _STEP.has_prompt_rows, _STEP.drafted_seqs, _STEP.int8_activations = previous


def integer_dot_rows() -> int:
    """At most this many rows run the few-rows kernel (quant_dot or quant_matmul)."""
    return DECODE_ROWS if vector_dequantize() else SCALAR_DEQUANTIZE_DECODE_ROWS


def few_rows_step(rows: int) -> bool:
    """The running step's quantized matmuls of `rows` rows take the few-rows kernel."""
    counted = _STEP.drafted_seqs or rows
    return counted <= integer_dot_rows() and not _STEP.has_prompt_rows


def int8_rows_step(rows: int) -> bool:
    """The running step's quantized matmuls of `rows` bfloat16 rows take quant_gemm_int8: every
    prompt step (a prompt's rows round the same in any chunk), and decode steps of at least
    INT8_GEMM_ROWS sequences; never with --quantized-activations dtype."""
    counted = _STEP.drafted_seqs or rows
    return _STEP.int8_activations and (_STEP.has_prompt_rows or counted >= INT8_GEMM_ROWS)


def _native_kernel(ops, rows: torch.Tensor):
    """The native op that multiplies these rows in the running step, or None (tiles dequantized
    for torch's matmul)."""
    if ops is None:
        return None
    if few_rows_step(rows.shape[0]):
        return ops.quant_dot if integer_dots() else ops.quant_matmul
    if rows.dtype != torch.bfloat16:
        return None
    if int8_tiles() and int8_rows_step(rows.shape[0]):
        return ops.quant_gemm_int8
    return ops.quant_gemm if bf16_tiles() else None


@functools.cache
def vector_dequantize() -> bool:
    """AVX-512 dequantization straight into float32 or bfloat16 (quant_dot.cpp's unpacking);
    else quant_matmul.cpp's float32 one, then a cast."""
    ops = native_ops()
    return ops is not None and ops.quant_dequantize_as_available()


def quantized_kernel_types(device: torch.device | str) -> frozenset:
    """The GGUF types a kernel multiplies in their blocks on `device`: weights of these types
    stay quantized there; the rest are dequantized at load."""
    device = torch.device(device)
    if device.type == "cpu":
        return NATIVE_TYPES
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return TRITON_TYPES
    return frozenset()


def _triton_gguf():
    from kernels import triton_gguf  # imports triton: CUDA only

    return triton_gguf


def gemv_input(rows: torch.Tensor):
    """On CUDA, rows quantized once for every part of a projection that the integer-dot GEMV
    multiplies (kernels/triton_gguf_dot.py); None where the tiled kernel takes them."""
    if rows.shape[0] > _triton_gguf().GEMV_ROWS:
        return None
    from kernels.triton_gguf_dot import quantize_x

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

    def matmul(self, rows: torch.Tensor, quantized=None) -> torch.Tensor:
        """rows [n, in_features] -> [n, out_features] in rows' dtype. quantized: on CUDA, what
        gemv_input made of rows (shared by the parts of a projection)."""
        if self._on_gpu():
            return _triton_gguf().gguf_matmul(rows, self.gpu_planes(), quantized)
        kernel = _native_kernel(self._native(), rows)
        if kernel is not None:
            return kernel(
                rows, self.blocks, int(self.ggml_type), self.out_features, self.in_features
            )
        y = rows.new_empty(rows.shape[0], self.out_features)
        tile = max(1, TILE_VALUES // self.in_features)
        for start in range(0, self.out_features, tile):
            part = slice(start, min(start + tile, self.out_features))
            y[:, part] = F.linear(rows, self.dequantize(part, rows.dtype))
        return y

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
        y = self.matmul(x if flat else x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
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
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False)

    @property
    def weight_nbytes(self) -> int:
        return sum(part.weight_nbytes for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized = gemv_input(rows) if self.parts[0]._on_gpu() else None
        y = torch.cat([part.matmul(rows, quantized) for part in self.parts], dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

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
