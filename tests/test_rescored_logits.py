"""Where the output projection rounds x to 8 bits, each row's largest logits are recomputed from
the float activations (QuantizedWeight.rescore_largest): the argmax and the top logits are the
float path's, the other logits keep the kernel's values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from benchmarks.quant_accuracy import final_hidden_states, fixed_text_ids
from kernels.row_max import largest
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models import cpu_kernels
from runtime.models.layers import RESCORED_LOGITS
from runtime.models.quant import QuantizedLinear, random_blocks

Q = gguf.GGMLQuantizationType

needs_int8_dots = pytest.mark.skipif(
    not cpu_kernels.int8_dots(), reason="8-bit activations need the AVX2 kernels"
)


@pytest.mark.parametrize(("rows", "columns"), [(1, 151_936), (5, 49_152), (3, 1000), (2, 512)])
def test_largest_are_the_topk_values(rows, columns):
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(columns))
    x[0, 100:120] = x[0].max()  # ties at the top
    picked = largest(x, 8)
    assert picked.shape == (rows, 8)
    assert all(len(set(row)) == 8 for row in picked.tolist())
    expected = x.topk(8, dim=-1).values.sort(dim=-1).values
    assert torch.equal(x.gather(1, picked).sort(dim=-1).values, expected)


def near_tied_projection(qtype, vocab: int, hidden: int) -> QuantizedLinear:
    """Rows that differ from one base row by a little: many logits within 8-bit rounding."""
    rng = np.random.default_rng(7)
    if qtype == Q.Q8_0:
        base = rng.standard_normal(hidden).astype(np.float32)
        spread = 0.05 * rng.standard_normal((vocab, hidden)).astype(np.float32)
        blocks = gguf.quants.quantize(base + spread, qtype)
    else:  # gguf-py cannot make K-quants
        blocks = random_blocks(qtype, vocab, hidden, rng)
    return QuantizedLinear(blocks, qtype, vocab, hidden)


@needs_int8_dots
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 4, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_largest_logits_are_the_float_activations(qtype, rows, dtype):
    projection = near_tied_projection(qtype, 4096, 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    exact = (x.double() @ projection.dequantize().double().T).to(dtype)
    with torch.inference_mode(), cpu_kernels.step_kind(False):
        rounded = projection(x)
        rescored = rounded.clone()
        projection.rescore_largest(x, rescored, RESCORED_LOGITS)
    top = largest(rounded, RESCORED_LOGITS)
    assert torch.equal(rescored.gather(1, top), exact.gather(1, top))
    untouched = torch.ones_like(rounded, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(rescored[untouched], rounded[untouched])
    assert torch.equal(rescored.argmax(-1), exact.argmax(-1))


@needs_int8_dots
def test_the_8_bit_argmax_misses_where_the_rescored_one_does_not():
    projection = near_tied_projection(Q.Q8_0, 4096, 512)
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ projection.dequantize().double().T
    with torch.inference_mode(), cpu_kernels.step_kind(False):
        rounded = projection(x)
        rescored = rounded.clone()
        projection.rescore_largest(x, rescored, RESCORED_LOGITS)
    assert (rounded.argmax(-1) != exact.argmax(-1)).any()  # near ties: 8 bits flip some
    assert torch.equal(rescored.argmax(-1), exact.argmax(-1))


def test_rows_the_kernels_keep_in_float_are_left_alone():
    projection = near_tied_projection(Q.Q8_0, 1024, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), cpu_kernels.step_kind(False, int8_activations=False):
        logits = projection(x)
        rescored = logits.clone()
        projection.rescore_largest(x, rescored, RESCORED_LOGITS)
    assert torch.equal(rescored, logits)


@pytest.mark.real_model
@pytest.mark.slow
@needs_int8_dots
def test_8_bit_smollm2_argmaxes_are_those_of_its_float_hidden_states():
    """SmolLM2's tied Q8_0 embedding is its output projection. Teacher-forced under 8-bit
    activations, the logits' argmax at each position is that of the final hidden state times the
    dequantized embedding in float64, where the 8-bit projection alone misses some."""
    engine = Engine(
        EngineConfig(
            model="smollm2-135m-instruct", dtype="float32", quantized_activations="int8",
            num_kv_blocks=64, max_batch_tokens=64,
        )
    )  # fmt: skip
    model = engine.runner.model
    hidden = torch.cat(final_hidden_states(engine, fixed_text_ids(engine, 512)))  # [512, hidden]
    exact = (hidden.double() @ model.embed_tokens.dequantize().double().T).argmax(-1)
    with torch.inference_mode(), cpu_kernels.step_kind(True):
        rounded = model.embed_tokens.matmul(hidden).argmax(-1)
        rescored = model.compute_logits(hidden).argmax(-1)
    assert (rounded != exact).any()  # 5 of 512 on a Zen 4 (AVX-512 VNNI)
    assert torch.equal(rescored, exact)
