"""The native greedy projection (kernels/cpu/greedy_projection.cpp) against its oracle, torch's
argmax of F.linear (kernels/reference.py), and the engine's greedy outputs with and without it.

The kernel sums each logit in its own order (float32, sequential over hidden), oneDNN or MKL in
another, so two logits closer than the rounding error of a dot product may legitimately swap. A
disagreement is accepted only when it is so explained: with the exact logits z (float64) and the
standard bound on a float32 dot product of length n in any order, |fl(z_v) - z_v| <= gamma_n *
sum_h |x_h w_vh| (gamma_n = n u / (1 - n u), u = 2^-24), the kernel's pick k and the oracle's pick
o must satisfy z_o - z_k <= bound_k + bound_o (plus one bfloat16 rounding step of the logits in
bfloat16, whose rounding is monotone but coarse). Everything else must agree exactly, and the
disagreements must stay rare.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native, reference

U = 2.0**-24


@pytest.fixture(scope="module")
def greedy_projection():
    op = native.greedy_projection_for(torch.device("cpu"), torch.float32)
    assert op is not None, "the native CPU kernels did not build (or CONVEYOR_NATIVE_KERNELS=0)"
    return op


def _allowed_gap(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, vocab] float64: how far apart two exact logits may be and still swap places."""
    n = x.shape[1]
    gamma = n * U / (1 - n * U)
    bound = gamma * (x.double().abs() @ w.double().abs().T)  # [rows, vocab]
    if dtype == torch.bfloat16:
        exact = x.double() @ w.double().T
        bound = bound + exact.abs() * 2.0**-8  # half a bfloat16 step, either side
    return bound


def _check(op, x: torch.Tensor, w: torch.Tensor, max_disagreements: int = 0) -> None:
    got, expected = op(x, w), reference.greedy_projection(x, w)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    differ = (got != expected).nonzero().flatten()
    assert differ.numel() <= max_disagreements, f"{differ.numel()} rows differ"
    if differ.numel():
        exact = x.double() @ w.double().T  # [rows, vocab]
        bound = _allowed_gap(x, w, x.dtype)
        for row in differ.tolist():
            k, o = int(got[row]), int(expected[row])
            gap = exact[row, o] - exact[row, k]
            assert gap <= bound[row, k] + bound[row, o], (row, k, o, float(gap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 128])
@pytest.mark.parametrize("hidden_size,vocab_size", [(64, 49152), (576, 4099), (13, 1001), (72, 17)])
def test_matches_torch_argmax_of_linear(
    greedy_projection, dtype, num_rows, hidden_size, vocab_size
):
    """Odd vocabularies (not a multiple of a panel or tile), hidden sizes not a multiple of 8."""
    generator = torch.Generator().manual_seed(num_rows * 1000 + hidden_size)
    x = torch.randn(num_rows, hidden_size, generator=generator).to(dtype)
    w = (torch.randn(vocab_size, hidden_size, generator=generator) * 0.5).to(dtype)
    # bfloat16 logits are coarse: their near-ties are frequent, each explained by the bound
    _check(
        greedy_projection,
        x,
        w,
        max_disagreements=0 if dtype == torch.float32 else num_rows // 8 + 1,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_first_index(greedy_projection, dtype):
    """Equal vocabulary rows give bit-equal logits in any sum order: the first one wins, in the
    same panel, in different panels and tiles, and in the leftover rows past the last panel."""
    generator = torch.Generator().manual_seed(5)
    vocab_size, hidden_size = 5000, 64
    w = torch.randn(vocab_size, hidden_size, generator=generator).to(dtype) * 0.1
    x = torch.randn(6, hidden_size, generator=generator).to(dtype)
    best = x.float() * 10  # a row far above the others, copied to several places
    for row, places in enumerate([(3, 7), (40, 4000), (4990, 4995), (17, 4999), (0, 1), (16, 32)]):
        for place in places:
            w[place] = best[row].to(dtype)
    expected = [3, 40, 4990, 17, 0, 16]
    assert greedy_projection(x, w).tolist() == expected
    assert reference.greedy_projection(x, w).tolist() == expected


def test_nan_is_the_maximum_and_the_first_nan_wins(greedy_projection):
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=generator)
    w = torch.randn(3000, 64, generator=generator)
    w[2500, 5] = float("nan")
    w[2900, 0] = float("nan")
    x[2] = 0.0
    w[1234] = float("inf")  # a NaN logit in every row (inf - inf, inf * 0): the first NaN
    got = greedy_projection(x, w)
    assert got.tolist() == reference.greedy_projection(x, w).tolist() == [1234, 1234, 1234]


def test_all_minus_infinity_gives_index_zero(greedy_projection):
    x = torch.ones(2, 16)
    w = torch.full((100, 16), float("-inf"))
    assert greedy_projection(x, w).tolist() == reference.greedy_projection(x, w).tolist() == [0, 0]


def test_threads_do_not_change_the_result(greedy_projection):
    """Each logit is summed whole by one thread, in one order: any thread count, same ids."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(37, 64, generator=generator)
    w = torch.randn(49152, 64, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = greedy_projection(x, w)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(greedy_projection(x, w), one)
    finally:
        torch.set_num_threads(threads)


def test_refuses_mismatched_inputs(greedy_projection):
    x, w = torch.randn(2, 8), torch.randn(10, 8)
    with pytest.raises(RuntimeError, match="hidden sizes"):
        greedy_projection(x, torch.randn(10, 9))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        greedy_projection(x.double(), w.double())
    with pytest.raises(RuntimeError, match="share a dtype"):
        greedy_projection(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        greedy_projection(x, torch.randn(8, 10).T)
    assert F.linear(x, w).shape == (2, 10)  # the shapes themselves were right


def test_engine_greedy_outputs_equal_with_and_without_it(tiny_model_dir):
    """Greedy steps take the fused path (counted) and produce the tokens the logits path does."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from scheduler.request import SamplingParams

    engine = Engine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    )
    model = engine.runner.model
    fused, calls = model.greedy_projection, []
    assert fused is not None

    def counted(hidden, weight):
        calls.append(hidden.shape[0])
        return fused(hidden, weight)

    def generate() -> list[list[int]]:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[5 + i, 6, 7, 8 * (i + 1)] * (i + 1) for i in range(6)]
        return [list(r.output_token_ids) for r in engine.generate(prompts, params)]

    model.greedy_projection = counted
    with_kernel = generate()
    assert calls and max(calls) == 6
    model.greedy_projection = None
    assert generate() == with_kernel


@pytest.mark.parametrize("tied", [True, False])
def test_loaded_model_greedy_tokens_are_the_argmax_of_its_logits(tmp_path, tied):
    """Tied (the embedding) or untied (the lm_head keeps its plain weight beside the packed one
    for the kernel): compute_greedy_tokens = compute_logits(...).argmax(-1)."""
    from benchmarks.step import NEAR_ZERO, write_random_llama
    from runtime.models.attention import AttentionBackend
    from runtime.models.config import ModelConfig
    from runtime.models.loader import load_model

    config = dict(NEAR_ZERO, vocab_size=3001, tie_word_embeddings=tied)
    model_dir = write_random_llama(tmp_path, config)
    if not tied:  # an lm_head of its own, unlike the embedding
        from safetensors.torch import load_file, save_file

        weights = load_file(str(model_dir / "model.safetensors"))
        weights["lm_head.weight"] = torch.randn(
            3001, 64, generator=torch.Generator().manual_seed(1)
        )
        save_file(weights, str(model_dir / "model.safetensors"))
    cpu = torch.device("cpu")
    model = load_model(
        model_dir, ModelConfig.from_dir(model_dir), torch.float32, cpu, AttentionBackend(cpu, 16)
    )
    assert model.greedy_projection is not None and (model.lm_head is None) == tied
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    expected = model.compute_logits(hidden).argmax(-1)
    assert torch.equal(model.compute_greedy_tokens(hidden), expected)
