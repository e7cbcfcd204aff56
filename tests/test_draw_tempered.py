"""kernels/cpu/sampling.cpp's draw_tempered against its oracle, the softmax path: the tempered
softmax, min-p's drops, then ops.draw_from_probs at the same uniform."""

from __future__ import annotations

import pytest
import torch
from test_sampling_support import sample

from kernels.native import native_ops
from runtime.sampling.ops import CDF_BLOCK, apply_min_p, draw_from_probs
from runtime.sampling.sampler import Sampler
from scheduler.request import Request, SamplingParams

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels turned off")

QWEN_VOCAB = 151_936


def oracle(logits, vocab, temperature, min_p, uniforms) -> torch.Tensor:
    probs = (logits[:, :vocab].float() / temperature[:, None]).softmax(dim=-1)
    if min_p is not None:
        probs = apply_min_p(probs, min_p[:, None])
    return draw_from_probs(probs, uniforms)


def settings(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=generator) * 1.5 + 0.2
    return temperature, torch.rand(rows, generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [QWEN_VOCAB, 3 * CDF_BLOCK + 5, 7])
@pytest.mark.parametrize("with_min_p", [False, True])
def test_draws_are_the_softmax_paths(dtype, vocab, with_min_p):
    """The same token as the oracle at each row's uniform, in logits wider than the vocab (a
    padded output projection) whose padding would win every draw."""
    rows = 48
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab + 40, generator=generator) * 3).to(dtype)
    logits[:, vocab:] = 80.0
    temperature, uniforms = settings(rows, vocab)
    min_p = torch.full((rows,), 0.05) if with_min_p else None
    got = native_ops().draw_tempered(logits, vocab, temperature, min_p, uniforms)
    expected = oracle(logits, vocab, temperature, min_p, uniforms)
    assert got.dtype == torch.int64 and bool((got < vocab).all())
    # a uniform on a boundary of the cumulative mass may round to the neighbour: none here
    assert (got == expected).float().mean().item() >= 0.99


def test_evenly_spaced_uniforms_draw_each_token_as_often_as_its_probability():
    """The inverse CDF at n evenly spaced uniforms gives token i about n * p_i times."""
    n, vocab = 20_000, 2 * CDF_BLOCK + 300
    row = torch.full((vocab,), float("-inf"))
    columns = [0, 5, CDF_BLOCK + 17, 2 * CDF_BLOCK - 1, vocab - 1]
    row[columns] = torch.tensor([1.0, 2.5, 0.0, -1.0, 0.7])
    uniforms = (torch.arange(n) + 0.5) / n
    temperature = torch.full((n,), 0.8)
    drawn = native_ops().draw_tempered(row.expand(n, -1), vocab, temperature, None, uniforms)
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
        drawn = native_ops().draw_tempered(logits, vocab, temperature, None, uniforms).tolist()
        assert drawn == [7, 3, 0, 0], uniform


def test_a_row_draws_alike_alone_in_a_batch_and_in_either_dtype():
    vocab = QWEN_VOCAB
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, vocab, generator=generator) * 2).bfloat16()
    temperature, uniforms = settings(16, 4)
    ops = native_ops()
    together = ops.draw_tempered(logits, vocab, temperature, None, uniforms)
    in_float32 = ops.draw_tempered(logits.float(), vocab, temperature, None, uniforms)
    assert torch.equal(together, in_float32)
    for row in (0, 9, 15):
        alone = ops.draw_tempered(logits[row : row + 1], vocab, temperature[row : row + 1],
                                  None, uniforms[row : row + 1])  # fmt: skip
        assert int(alone) == int(together[row])


def test_bad_settings_are_refused():
    ops = native_ops()
    logits = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="vocab"):
        ops.draw_tempered(logits, 11, torch.ones(2), None, torch.zeros(2))
    with pytest.raises(RuntimeError, match="float32"):
        ops.draw_tempered(logits, 10, torch.ones(3), None, torch.zeros(2))


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
