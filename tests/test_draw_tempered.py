"""kernels/cpu/sampling.cpp against its oracles, the torch paths: draw_tempered (ops.draw_natively)
against prepare_candidates (temperature, top-k, top-p, min-p), the candidates in token order and
ops.draw_from_probs at the same uniform; apply_penalties_ against ops.penalised_by_torch."""

from __future__ import annotations

import pytest
import torch
from test_sampling_support import sample

from kernels.native import native_ops
from runtime.sampling.ops import (
    CDF_BLOCK,
    PenaltyInputs,
    apply_penalty_inputs,
    draw_from_probs,
    draw_natively,
    penalised_by_torch,
    prepare_candidates,
)
from runtime.sampling.plan import filter_settings, param_rows
from runtime.sampling.sampler import Sampler, in_token_order
from scheduler.request import Request, SamplingParams

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels turned off")

QWEN_VOCAB = 151_936


def settings_for(params: list[SamplingParams], vocab: int):
    settings = filter_settings(param_rows(params), vocab)
    settings.any_min_p = any(p.min_p > 0 for p in params)
    return settings


def oracle(logits, vocab, params, uniforms) -> torch.Tensor:
    candidates = prepare_candidates(logits[:, :vocab].float(), settings_for(params, vocab))
    probs, token_ids = in_token_order(candidates, vocab)
    winners = draw_from_probs(probs, uniforms)
    return winners if token_ids is None else token_ids.gather(1, winners[:, None]).squeeze(1)


def native(logits, vocab, params, uniforms) -> torch.Tensor:
    return draw_natively(logits, vocab, settings_for(params, vocab), uniforms)


def mixed_params(rows: int, seed: int, with_min_p: bool, filtered: bool) -> list[SamplingParams]:
    """Plain rows, top-k (small, large, past the vocab), top-p (tight, wide), both (filtered)."""
    generator = torch.Generator().manual_seed(seed)
    filters = [{}, {"top_k": 1}, {"top_k": 40}, {"top_k": 5000}, {"top_k": 10**6},
               {"top_p": 0.0}, {"top_p": 0.3}, {"top_p": 0.95}, {"top_k": 50, "top_p": 0.8}]  # fmt: skip
    params = []
    for row in range(rows):
        temperature = float(torch.rand(1, generator=generator)) * 1.5 + 0.2
        min_p = 0.05 if with_min_p and row % 2 else 0.0
        row_filters = filters[row % 9] if filtered else {}
        params.append(SamplingParams(temperature=temperature, min_p=min_p, **row_filters))
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [QWEN_VOCAB, 3 * CDF_BLOCK + 5, 7])
@pytest.mark.parametrize("with_min_p", [False, True])
def test_draws_are_the_torch_paths(dtype, vocab, with_min_p):
    """The same token as the oracle at each row's uniform, in logits wider than the vocab (a
    padded output projection) whose padding would win every draw. Filters over float32 logits
    only: bfloat16's few values tie often, and where a tie straddles a top-k or top-p boundary
    torch's topk keeps either, the kernel the lower token id."""
    rows = 54
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab + 40, generator=generator) * 3).to(dtype)
    logits[:, vocab:] = 80.0
    params = mixed_params(rows, vocab, with_min_p, filtered=dtype == torch.float32)
    uniforms = torch.rand(rows, generator=generator)
    got = native(logits, vocab, params, uniforms)
    expected = oracle(logits, vocab, params, uniforms)
    assert got.dtype == torch.int64 and bool((got < vocab).all())
    # a uniform on a boundary of the cumulative mass may round to the neighbour: none here
    assert (got == expected).float().mean().item() >= 0.98, (got != expected).nonzero()


@pytest.mark.parametrize("top_k, top_p", [(40, 1.0), (3000, 1.0), (0, 0.9), (0, 0.999), (200, 0.5)])
def test_filters_keep_the_oracles_candidates(top_k, top_p):
    """Evenly spaced uniforms over a wide, flat row (many tokens within the first 12 bits of
    one another: the radix select's second level and its sort) draw only tokens the torch path
    keeps, each as often as the oracle draws it to within 2 of 4,000 (a uniform next to a
    boundary of the running mass may round to the neighbour)."""
    n, vocab = 4000, 20_000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(top_k)) * 0.3
    row[:50] += 4.0  # a head above a flat tail
    params = [SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)] * n
    uniforms = (torch.arange(n) + 0.5) / n
    logits = row.expand(n, -1)
    got = torch.bincount(native(logits, vocab, params, uniforms), minlength=vocab)
    expected = torch.bincount(oracle(logits, vocab, params, uniforms), minlength=vocab)
    candidates = prepare_candidates(logits[:1], settings_for(params[:1], vocab))
    kept = candidates.token_ids[candidates.probs > 0]
    assert set(got.nonzero().flatten().tolist()) <= set(kept.tolist())
    assert int((got - expected).abs().max()) <= 2


def test_top_k_keeps_the_k_best_and_ties_by_token_id():
    vocab = 5000
    row = torch.full((vocab,), -3.0)
    row[[10, 20, 30, 4000]] = 1.0  # four tied best: top-k 2 keeps the two lowest ids
    uniforms = (torch.arange(64) + 0.5) / 64
    drawn = native(row.expand(64, -1), vocab, [SamplingParams(top_k=2)] * 64, uniforms)
    assert set(drawn.tolist()) == {10, 20}


def test_evenly_spaced_uniforms_draw_each_token_as_often_as_its_probability():
    """The inverse CDF at n evenly spaced uniforms gives token i about n * p_i times."""
    n, vocab = 20_000, 2 * CDF_BLOCK + 300
    row = torch.full((vocab,), float("-inf"))
    columns = [0, 5, CDF_BLOCK + 17, 2 * CDF_BLOCK - 1, vocab - 1]
    row[columns] = torch.tensor([1.0, 2.5, 0.0, -1.0, 0.7])
    uniforms = (torch.arange(n) + 0.5) / n
    temperature = torch.full((n,), 0.8)
    drawn = native_ops().draw_tempered(
        row.expand(n, -1), vocab, temperature, None, None, None, uniforms
    )
    counts = torch.bincount(drawn, minlength=vocab)
    probs = torch.softmax(row / 0.8, dim=-1)
    assert int(counts.sum()) == n and set(drawn.unique().tolist()) <= set(columns)
    for column in columns:
        assert abs(int(counts[column]) - n * probs[column].item()) <= 2, column


def test_extreme_uniforms_and_rows_without_mass_stay_in_range():
    vocab = 3 * CDF_BLOCK
    logits = torch.full((4, vocab), float("-inf"))
    logits[0, 7] = 0.0  # the first block's only mass
    logits[1, 2 * CDF_BLOCK - 1] = -60.0  # a block's last column, zeros after it
    logits[1, 3] = 30.0  # ... beside one that outweighs it: e^-90 is no float, so never drawn
    logits[3] = float("nan")  # row 2: all -inf
    largest_below_one = 1.0 - 2.0**-24
    temperature = torch.ones(4)
    for uniform in (0.0, largest_below_one):
        uniforms = torch.full((4,), uniform)
        drawn = native_ops().draw_tempered(logits, vocab, temperature, None, None, None, uniforms)
        drawn = drawn.tolist()
        assert drawn == [7, 3, 0, 0], uniform


def test_a_row_draws_alike_alone_in_a_batch_and_in_either_dtype():
    vocab = QWEN_VOCAB
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, vocab, generator=generator) * 2).bfloat16()
    generator = torch.Generator().manual_seed(4)
    temperature, uniforms = (
        torch.rand(16, generator=generator) + 0.3,
        torch.rand(16, generator=generator),
    )
    ops = native_ops()
    together = ops.draw_tempered(logits, vocab, temperature, None, None, None, uniforms)
    in_float32 = ops.draw_tempered(logits.float(), vocab, temperature, None, None, None, uniforms)
    assert torch.equal(together, in_float32)
    for row in (0, 9, 15):
        alone = ops.draw_tempered(logits[row : row + 1], vocab, temperature[row : row + 1],
                                  None, None, None, uniforms[row : row + 1])  # fmt: skip
        assert int(alone) == int(together[row])


def test_bad_settings_are_refused():
    ops = native_ops()
    logits = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="vocab"):
        ops.draw_tempered(logits, 11, torch.ones(2), None, None, None, torch.zeros(2))
    with pytest.raises(RuntimeError, match="draw_tempered: temperature .rows. float32"):
        ops.draw_tempered(logits, 10, torch.ones(3), None, None, None, torch.zeros(2))
    ids, one = torch.zeros(1, 3, dtype=torch.long), torch.ones(1)
    with pytest.raises(RuntimeError, match="apply_penalties_: frequency .rows. float32"):
        ops.apply_penalties_(logits, torch.tensor([0]), ids, ids, one, torch.ones(2), one)
    assert torch.equal(logits, torch.zeros(2, 10))


def test_the_sampler_draws_a_seeded_row_alike_with_or_without_the_float32_copy():
    """Alone, a tempered row draws from the logits as they come (bfloat16 here); beside a greedy
    row, from the float32 copy every other path takes: the same token."""
    vocab = QWEN_VOCAB
    logits = (torch.randn(2, vocab, generator=torch.Generator().manual_seed(8)) * 2).bfloat16()
    tokens = []
    for others in ([], [SamplingParams(temperature=0.0)], [SamplingParams(top_p=0.5)]):
        requests = [Request("s", [1, 2], SamplingParams(temperature=0.9, min_p=0.01, seed=11))]
        requests += [Request(f"o{i}", [1, 2], params) for i, params in enumerate(others)]
        sampler = Sampler(vocab, seed=0)
        tokens.append(sample(sampler, logits[: len(requests)], requests).token_ids[0])
    assert len(set(tokens)) == 1, tokens


def test_native_penalties_are_the_torch_paths_bit_for_bit():
    """Repetition over prompt and output, frequency and presence over the output, in rows picked
    out of the batch; repeated ids, -1 padding, negative and positive logits, a -inf one."""
    vocab, rows = QWEN_VOCAB, 6
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[1, 17] = float("-inf")
    prompt_ids = torch.randint(0, vocab, (3, 40), generator=generator)
    output_ids = torch.randint(0, 300, (3, 40), generator=generator)  # repeats: counts above 1
    prompt_ids[0, 30:], output_ids[2, 5:] = -1, -1
    prompt_ids[1, 0], output_ids[1, :4] = 17, 17
    penalties = PenaltyInputs(
        rows=torch.tensor([1, 3, 4]),
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        repetition=torch.tensor([1.3, 1.0, 0.8]),
        frequency=torch.tensor([0.0, 0.37, -0.2]),
        presence=torch.tensor([0.5, 1.1, 0.0]),
    )
    before = logits.clone()
    got = apply_penalty_inputs(logits, penalties)
    assert torch.equal(logits, before)  # a new tensor: the logprobs read the logits unpenalised
    expected = penalised_by_torch(logits, penalties)
    assert torch.equal(got, expected)
    assert not torch.equal(got[penalties.rows], before[penalties.rows])
