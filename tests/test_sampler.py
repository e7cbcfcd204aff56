from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from test_sampling_support import apply_penalties, sample, top_k_top_p_candidates

from runtime.sampling.ops import CDF_BLOCK, draw_from_probs
from runtime.sampling.plan import SamplerOutput, TokenLogprobs
from runtime.sampling.sampler import Sampler
from scheduler.request import Request, SamplingParams

VOCAB_SIZE = 32


def make_request(request_id: str = "r", prompt=(1, 2, 3), output=(), **params) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(**params))
    request.output_token_ids = list(output)
    return request


def random_logits(num_rows: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 2


def draw_many(sampler: Sampler, logits_row: torch.Tensor, num_draws: int, **params) -> Counter:
    """num_draws samples from one distribution, as one batch of distinct requests."""
    requests = [make_request(f"r{i}", **params) for i in range(num_draws)]
    output = sample(sampler, logits_row.expand(num_draws, -1), requests)
    return Counter(output.token_ids)


def test_greedy_is_argmax():
    logits = random_logits(6)
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(6)]
    output = sample(Sampler(VOCAB_SIZE), logits, requests)
    assert isinstance(output, SamplerOutput)
    assert output.token_ids == logits.argmax(dim=-1).tolist()
    assert output.logprobs == [None] * 6


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(8, seed=1)
    requests = [make_request(f"r{i}", temperature=1.5, top_k=1) for i in range(8)]
    assert sample(Sampler(VOCAB_SIZE), logits, requests).token_ids == logits.argmax(-1).tolist()


def test_any_float_dtype_and_padded_vocab():
    logits = random_logits(3, vocab_size=VOCAB_SIZE + 8)
    logits[:, VOCAB_SIZE:] = 100.0  # padding columns beyond the vocab never win
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(3)]
    output = sample(Sampler(VOCAB_SIZE), logits.to(torch.bfloat16), requests)
    assert all(t < VOCAB_SIZE for t in output.token_ids)
    random_output = sample(Sampler(VOCAB_SIZE, seed=0), logits[:1].half(), [make_request(seed=1)])
    assert random_output.token_ids[0] < VOCAB_SIZE
    penalised = make_request(temperature=0.0, output=[3], repetition_penalty=1.5)
    assert sample(Sampler(VOCAB_SIZE), logits[:1], [penalised]).token_ids[0] < VOCAB_SIZE


def crafted_logits() -> torch.Tensor:
    """Probabilities: 0.306, 0.153, 0.077, 0.038, 0.019, 0.010, then 0.015 for each other token."""
    logits = torch.full((VOCAB_SIZE,), -3.0)
    logits[:6] = torch.tensor([-math.log(2) * t for t in range(6)])
    return logits


def test_top_k_stays_in_the_top_k():
    counts = draw_many(Sampler(VOCAB_SIZE, seed=0), crafted_logits(), 2000, top_k=3)
    assert set(counts) == {0, 1, 2}


def test_top_p_stays_in_the_nucleus():
    # {0, 1} hold 0.459 < 0.5; {0, 1, 2} hold 0.536
    counts = draw_many(Sampler(VOCAB_SIZE, seed=0), crafted_logits(), 2000, top_p=0.5)
    assert set(counts) == {0, 1, 2}


@pytest.mark.parametrize("top_p", [0.0, 5e-324])
def test_a_top_p_of_zero_keeps_the_best_token(top_p):
    """The nucleus always holds the best token: a top_p that rounds to 0 in float32 (the fuzzer's
    5e-324) left no candidate, and the draw had no mass to land in."""
    counts = draw_many(Sampler(VOCAB_SIZE, seed=0), crafted_logits(), 50, top_p=top_p)
    assert set(counts) == {0}


def test_min_p_drops_unlikely_tokens():
    # tokens 0..3 have at least 1/8 of the best token's probability, the others 1/16 or less
    counts = draw_many(Sampler(VOCAB_SIZE, seed=0), crafted_logits(), 2000, min_p=0.1)
    assert set(counts) == {0, 1, 2, 3}


def test_top_k_and_top_p_mixed_in_one_batch():
    logits = crafted_logits().expand(3, -1)
    sampler = Sampler(VOCAB_SIZE, seed=0)
    for i in range(300):
        requests = [
            make_request(f"k{i}", top_k=2),
            make_request(f"p{i}", top_p=0.2),
            make_request(f"g{i}", temperature=0.0),
        ]
        k_token, p_token, greedy_token = sample(sampler, logits, requests).token_ids
        assert k_token in (0, 1) and p_token == 0 and greedy_token == 0


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (VOCAB_SIZE - 5))
    num_draws, temperature = 8000, 0.7
    counts = draw_many(Sampler(VOCAB_SIZE, seed=1234), logits, num_draws, temperature=temperature)
    expected = torch.softmax(logits / temperature, dim=-1)
    for token in range(5):
        p = expected[token].item()
        tolerance = 5 * math.sqrt(p * (1 - p) / num_draws)  # five standard errors
        assert abs(counts[token] / num_draws - p) < tolerance, (token, counts[token], p)


@pytest.mark.parametrize("num_columns", [5, CDF_BLOCK, 2 * CDF_BLOCK + 300])
def test_inverse_cdf_frequencies_match_the_probs_across_blocks(num_columns):
    """Mass in the first, a middle and the last (short) block, zeros between: the draws follow
    the probs (five standard errors), and none lands on a column of zero probability."""
    probs = torch.zeros(1, num_columns)
    columns = sorted({0, num_columns // 2, num_columns - 1, min(3, num_columns - 1)})
    probs[0, columns] = torch.tensor([4.0, 2.0, 1.0, 0.5][: len(columns)])
    num_draws = 8000
    uniforms = torch.rand(num_draws, generator=torch.Generator().manual_seed(5))
    drawn = draw_from_probs(probs.expand(num_draws, -1), uniforms)
    counts = Counter(drawn.tolist())
    assert set(counts) <= set(columns)
    for column in columns:
        p = (probs[0, column] / probs.sum()).item()
        tolerance = 5 * math.sqrt(p * (1 - p) / num_draws)
        assert abs(counts[column] / num_draws - p) < tolerance, (column, counts[column], p)


def test_inverse_cdf_extreme_uniforms_pick_columns_that_have_mass():
    probs = torch.zeros(2, 3 * CDF_BLOCK)
    probs[0, 7] = 1.0  # the first block's only mass
    probs[1, 2 * CDF_BLOCK - 1] = 1e-30  # a block's last column, tiny, zeros after it
    largest_below_one = 1.0 - 2.0**-24
    for uniform in (0.0, largest_below_one):
        drawn = draw_from_probs(probs, torch.tensor([uniform, uniform])).tolist()
        assert drawn == [7, 2 * CDF_BLOCK - 1], uniform


def test_a_row_without_mass_gets_a_column_in_range():
    probs = torch.zeros(3, 2 * CDF_BLOCK + 5)
    probs[1] = float("nan")
    probs[2, 9] = 1.0
    drawn = draw_from_probs(probs, torch.tensor([0.5, 0.5, 0.5])).tolist()
    assert all(0 <= column < probs.shape[1] for column in drawn) and drawn[2] == 9


def seeded_tokens(sampler: Sampler, logits_row: torch.Tensor, others: int, position: int) -> int:
    """The seeded request's token when sampled among `others` unseeded requests."""
    requests = [make_request(f"other{i}", temperature=1.3) for i in range(others)]
    requests.insert(position, make_request("seeded", seed=42, temperature=1.0))
    logits = random_logits(others + 1, seed=others + 7)
    logits[position] = logits_row
    output = sample(sampler, logits, requests)
    sampler.release("seeded")
    return output.token_ids[position]


def test_same_seed_same_token_alone_in_batch_and_in_other_position():
    logits_row = torch.zeros(VOCAB_SIZE)  # uniform: every token equally likely
    sampler = Sampler(VOCAB_SIZE)
    alone = seeded_tokens(sampler, logits_row, others=0, position=0)
    assert seeded_tokens(sampler, logits_row, others=5, position=0) == alone
    assert seeded_tokens(sampler, logits_row, others=5, position=3) == alone
    assert seeded_tokens(Sampler(VOCAB_SIZE, seed=99), logits_row, others=7, position=7) == alone


def test_different_seeds_differ():
    logits = torch.zeros(1, VOCAB_SIZE)
    tokens = {
        sample(Sampler(VOCAB_SIZE), logits, [make_request(seed=seed)]).token_ids[0]
        for seed in range(20)
    }
    assert len(tokens) > 5


def test_generator_state_survives_across_calls_and_interleaving():
    logits_row = torch.zeros(1, VOCAB_SIZE)

    def seeded_sequence(sampler: Sampler, interleave: bool) -> list[int]:
        tokens = []
        for step in range(5):
            request = make_request("seeded", seed=7)
            if interleave:
                others = [make_request(f"o{step}", seed=step), make_request(f"u{step}")]
                sample(sampler, random_logits(2, seed=step), others)
                batch = [others[1], request, others[0]]
                tokens.append(sample(sampler, torch.zeros(3, VOCAB_SIZE), batch).token_ids[1])
            else:
                tokens.append(sample(sampler, logits_row, [request]).token_ids[0])
        return tokens

    plain = seeded_sequence(Sampler(VOCAB_SIZE), interleave=False)
    assert seeded_sequence(Sampler(VOCAB_SIZE), interleave=True) == plain
    assert len(set(plain)) > 1  # the generator advances between calls


def test_release_restarts_the_seed():
    sampler = Sampler(VOCAB_SIZE)
    logits = torch.zeros(1, VOCAB_SIZE)
    first = [sample(sampler, logits, [make_request(seed=3)]).token_ids[0] for _ in range(4)]
    sampler.release("r")
    again = [sample(sampler, logits, [make_request(seed=3)]).token_ids[0] for _ in range(4)]
    assert again == first


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    request = make_request(
        prompt=[1, 4],
        output=[2, 2, 3],
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        temperature=0.0,
    )
    # repetition over prompt + output {1, 2, 3, 4}; frequency and presence over output {2: 2, 3: 1}
    expected = torch.tensor(
        [
            2.0,
            -1.0 * 2.0,
            0.5 / 2.0 - 0.25 * 2 - 0.5,
            3.0 / 2.0 - 0.25 * 1 - 0.5,
            -2.0 * 2.0,
            1.0,
        ]
    )
    penalised = apply_penalties(logits, [request])
    torch.testing.assert_close(penalised[0], expected)
    assert logits[0, 3] == 3.0  # the caller's logits are untouched
    output = sample(Sampler(6), logits, [request])
    assert output.token_ids == [0]  # token 3 led before the penalties


def test_penalties_apply_only_to_their_rows():
    logits = random_logits(3, seed=5)
    logits[:, 4] = 10.0
    requests = [
        make_request("a", output=[4], temperature=0.0),
        make_request("b", output=[4], temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
        make_request("c", output=[4], temperature=0.0),
    ]
    penalised = sample(Sampler(VOCAB_SIZE), logits, requests).token_ids
    assert penalised[0] == penalised[2] == 4
    assert penalised[1] == (logits[1] - 4.0 * (torch.arange(VOCAB_SIZE) == 4)).argmax().item()


def test_logprobs_match_log_softmax():
    logits = random_logits(4, seed=3)
    requests = [
        make_request("a", temperature=0.0, logprobs=5),
        make_request("b", logprobs=0, seed=1),
        make_request("c"),
        make_request("d", logprobs=2, presence_penalty=1.0, output=[0, 1]),
    ]
    output = sample(Sampler(VOCAB_SIZE, seed=0), logits, requests)
    expected = torch.log_softmax(logits, dim=-1)
    assert output.logprobs[2] is None
    for row in (0, 1, 3):
        entry = output.logprobs[row]
        assert isinstance(entry, TokenLogprobs)
        assert entry.token_id == output.token_ids[row]
        assert entry.logprob == pytest.approx(expected[row, entry.token_id].item(), abs=1e-5)
        top_n = requests[row].sampling_params.logprobs
        values, ids = expected[row].topk(top_n)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_tokens_that_cannot_be_sampled_are_left_out_of_the_top_logprobs():
    """A grammar's mask leaves two tokens possible: asked for five, the top lists those two, not
    three of -inf (which JSON cannot carry: the API answered null, against its own schema)."""
    logits = torch.full((2, VOCAB_SIZE), float("-inf"))
    logits[:, 3], logits[:, 7] = 2.0, 1.0
    requests = [make_request("a", temperature=0.0, logprobs=5), make_request("b", logprobs=5)]
    output = sample(Sampler(VOCAB_SIZE, seed=0), logits, requests)
    for entry in output.logprobs:
        assert [token for token, _ in entry.top] == [3, 7]
        assert all(math.isfinite(lp) for _, lp in entry.top) and math.isfinite(entry.logprob)


def reference_top_k_top_p_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens survive top-k then top-p, by sorting the whole vocab (as vLLM does)."""
    sorted_probs, sorted_ids = probs.sort(descending=True)
    if top_k > 0:
        sorted_probs = sorted_probs * (torch.arange(len(probs)) < top_k)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    keep = (mass_before < top_p * sorted_probs.sum()) | (top_p >= 1.0)
    keep &= sorted_probs > 0
    return torch.zeros(len(probs), dtype=torch.bool).scatter(0, sorted_ids, keep)


@pytest.mark.parametrize("scale", [0.1, 2.0, 4.0, 12.0])  # flat (whole vocab) to peaked (256)
def test_top_k_top_p_candidates_match_full_sort(scale):
    vocab_size = 8192
    logits = torch.randn(7, vocab_size, generator=torch.Generator().manual_seed(11)) * scale
    all_params = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=300, top_p=0.95),
        SamplingParams(top_p=0.5),
        SamplingParams(top_k=2000, top_p=0.99),
        SamplingParams(top_k=40),
        SamplingParams(top_k=10**6, top_p=0.7),
    ]
    probs = logits.softmax(dim=-1)
    candidates = top_k_top_p_candidates(probs, all_params)
    for row, params in enumerate(all_params):
        kept = candidates.token_ids[row][candidates.probs[row] > 0]
        expected = reference_top_k_top_p_mask(probs[row], params.top_k, params.top_p)
        assert set(kept.tolist()) == set(expected.nonzero().flatten().tolist()), params


def test_seeded_token_is_the_same_with_and_without_filters_in_the_batch():
    vocab_size = 4096
    sampler = Sampler(vocab_size, seed=0)
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(2))
    tokens = set()
    for others in ([], [dict(top_k=20)], [dict(top_p=0.999), dict(top_k=3000)]):
        requests = [make_request("s", seed=5, top_p=0.8)]
        requests += [make_request(f"o{i}", **params) for i, params in enumerate(others)]
        tokens.add(sample(sampler, logits[: len(requests)], requests).token_ids[0])
        sampler.release("s")
    assert len(tokens) == 1
