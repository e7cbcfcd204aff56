"""Which native CPU kernel multiplies a step's rows by GGUF weights (runtime/models/quant.py's
QuantizedWeight asks). With 8-bit activations: few rows kernels/cpu/quant_dot_int8.cpp, many
quant_gemm_int8.cpp (AVX-512 VNNI or AVX2), which round a row bit for bit alike. Otherwise: few
rows quant_dot.cpp (integer dots, int16 activations) or quant_matmul.cpp (float), and on AVX2
without AVX-512 decode steps of 7-96 rows quant_gemm_int16.cpp (the same integers); many rows, for
bfloat16, quant_gemm.cpp (bfloat16 tiles, AVX-512 BF16); else none (tiles dequantized for
torch's matmul). There the running step's kind (step_kind) decides with the row count, so that a
row rounds the same way wherever the scheduler puts it."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch

from kernels.native import cpu_flags, native_ops

DECODE_ROWS = 6  # at most this many rows run the integer-dot kernel (one pass: kMaxRows with
# AVX-512); more dequantize tiles (quant_gemm for bfloat16: at 4-6 rows it took 1.5-1.8x longer)
INT8_DECODE_ROWS = 4  # at most this many 8-bit rows take quant_dot_int8, more quant_gemm_int8:
# Qwen 1.5B's layer shapes on a Zen 4, pairs of rows sharing a reduction (quant_dot_int8.cpp), at
# 4 rows 49 against 63 ms (AVX-512), 63 against 82-88 (AVX2 build); at 6 rows 81 against 63 and
# 98 against 85 (docs/benchmarks.md, 2026-11-28, afternoon)
SCALAR_DEQUANTIZE_DECODE_ROWS = 48  # the same without AVX-512 (AVX2) and 8-bit activations:
# dequantizing a tile is scalar there, and quant_dot, a pass per 4 rows, stays faster up to
# about 48 rows
INT16_TILE_DECODE_ROWS = 96  # where quant_gemm_int16 runs (int16_tiles): against tiles
# dequantized for torch's sgemm, Gemma 3's ffn shapes on a Zen 3 1.18-1.28x at 64 rows, 0.96-0.98x
# at 128, 0.89-0.90x at 256


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
def int16_tiles() -> bool:
    """Where quant_dot would serve decode steps of up to SCALAR_DEQUANTIZE_DECODE_ROWS sequences
    (AVX2 without AVX-512) and activations are not 8-bit, steps of DECODE_ROWS + 1 to
    INT16_TILE_DECODE_ROWS multiply in
    kernels/cpu/quant_gemm_int16.cpp: quant_dot's integers in a GEMM's layout, 8 rows a vector.
    Gemma 3's layer shapes on a Zen 3, 8 to 48 rows: 1.25-1.86x quant_dot's speed (at 6 rows
    1.06-1.22x, at 12 rows 0.94-1.23x; docs/benchmarks.md, 2026-11-29, noon)."""
    ops = native_ops()
    return integer_dots() and ops.quant_gemm_int16_available() and not vector_dequantize()


@functools.cache
def int8_dots() -> bool:
    """Few 8-bit rows multiply in kernels/cpu/quant_dot_int8.cpp, bit for bit as
    quant_gemm_int8 would (llama.cpp's vec_dot on Q8_0 activations), wherever that kernel runs."""
    ops = native_ops()
    return int8_tiles() and ops.quant_dot_int8_available()


@functools.cache
def int8_tiles() -> bool:
    """Many rows multiply in kernels/cpu/quant_gemm_int8.cpp (AVX-512 VNNI, or AVX2): x rounded
    to 8 bits per group as llama.cpp's Q8 activations, twice the products a cycle of
    vdpbf16ps, four times an AVX2 FMA's. Where the CPU has AMX too: torch's AMX matmul needs
    the weights dequantized every step, and 32 decode rows ran 2.7-3x slower that way on a
    Sapphire Rapids Xeon (docs/benchmarks.md, 2026-11-28, late night)."""
    ops = native_ops()
    return ops is not None and ops.quant_gemm_int8_available()


def int8_activations(setting: str, model_class: type, dtype_setting: str = "auto") -> bool:
    """--quantized-activations: int8, dtype, or auto: the model family's default, except where
    --dtype float32 was asked for by name (the oracle setting: rows stay in float32; the float32
    that --dtype auto picks on a CPU without bfloat16 takes 8-bit rows as bfloat16 does)."""
    if setting == "auto":
        return model_class.int8_activations_by_default and dtype_setting != "float32"
    return setting == "int8"


class _StepKind(threading.local):
    has_prompt_rows = False  # the step running on this thread computes prompt tokens
    drafted_seqs = 0  # its sequences, where speculative drafts give them more rows (else 0)
    int8_activations = True  # --quantized-activations int8


_STEP = _StepKind()


@contextmanager
def step_kind(has_prompt_rows: bool, drafted_seqs: int = 0, int8_activations: bool = True):
    """While a step runs on this thread, its kind picks its quantized matmuls' kernel where its
    activations are not 8-bit (8-bit rows take quant_dot_int8 or quant_gemm_int8 by their count
    alone: the two round a row alike):
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
    """Where activations are not 8-bit: at most this many rows (a decode step's sequences) run
    the few-rows kernels (quant_dot or quant_matmul; quant_gemm_int16 past DECODE_ROWS)."""
    if vector_dequantize():
        return DECODE_ROWS
    return INT16_TILE_DECODE_ROWS if int16_tiles() else SCALAR_DEQUANTIZE_DECODE_ROWS


def _counted_rows(rows: int) -> int:
    """What picks a decode step's kernel: its sequences where drafts give them more rows."""
    return _STEP.drafted_seqs or rows


def few_rows_step(rows: int) -> bool:
    """The running step's quantized matmuls of `rows` rows take the few-rows kernel."""
    return _counted_rows(rows) <= integer_dot_rows() and not _STEP.has_prompt_rows


def rounds_to_int8(rows: torch.Tensor) -> bool:
    """The running step's quantized matmuls round these rows to 8 bits (quant_dot_int8 or
    quant_gemm_int8), where the native kernels run."""
    is_float = rows.dtype in (torch.float32, torch.bfloat16)
    return is_float and _STEP.int8_activations and int8_dots()


def native_kernel(ops, rows: torch.Tensor):
    """The native op that multiplies these rows in the running step, or None (tiles dequantized
    for torch's matmul)."""
    if ops is None:
        return None
    if rounds_to_int8(rows):
        # the two 8-bit kernels round a row alike: the row count alone picks the faster
        few = rows.shape[0] <= INT8_DECODE_ROWS
        return ops.quant_dot_int8 if few else ops.quant_gemm_int8
    if few_rows_step(rows.shape[0]):
        if int16_tiles() and _counted_rows(rows.shape[0]) > DECODE_ROWS:
            return ops.quant_gemm_int16
        return ops.quant_dot if integer_dots() else ops.quant_matmul
    return ops.quant_gemm if bf16_tiles() and rows.dtype == torch.bfloat16 else None


@functools.cache
def vector_dequantize() -> bool:
    """AVX-512 dequantization straight into float32 or bfloat16 (quant_dot.cpp's unpacking);
    else quant_matmul.cpp's float32 one, then a cast."""
    ops = native_ops()
    return ops is not None and ops.quant_dequantize_as_available()
