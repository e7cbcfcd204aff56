"""Verification of drafts: greedy acceptance is exact, and rejection sampling's output follows
the target's distribution (a chi-square test that a wrong rejection rule fails)."""

import torch

from runtime.spec.verify import RejectionSampler, VerifyRow, accept_greedy
from scheduler.request import SamplingParams

VOCAB = 5
# chi-square critical values at p = 0.001 by degrees of freedom (tables)
CHI2_CRITICAL_0_001 = {3: 16.27, 4: 18.47}
NUM_SAMPLES = 4000


def one_hot_logits(token_ids):
    logits = torch.zeros(len(token_ids), VOCAB)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 5.0
    return logits


def greedy_row(name, drafts):
    return VerifyRow(name, SamplingParams(temperature=0.0), drafts)


def test_greedy_accepts_the_longest_matching_prefix_then_the_correction():
    assert accept_greedy([1, 2, 3], [1, 2, 4, 0]) == (2, [1, 2, 4])
    assert accept_greedy([1, 2, 3], [1, 2, 3, 0]) == (3, [1, 2, 3, 0])
    assert accept_greedy([1, 2, 3], [4, 2, 3, 0]) == (0, [4])
    assert accept_greedy([], [2]) == (0, [2])


def test_a_batch_with_variable_k_is_verified_row_by_row():
    sampler = RejectionSampler(VOCAB, seed=0)
    rows = [greedy_row("a", [1, 2]), greedy_row("b", []), greedy_row("c", [3, 3, 3])]
    targets = [1, 4, 0] + [2] + [3, 3, 1, 0]  # flat: sum(k_i + 1) = 3 + 1 + 4 positions
    result = sampler.verify(one_hot_logits(targets), rows)
    assert result.num_accepted == [1, 0, 2]
    assert result.token_ids == [[1, 4], [2], [3, 3, 1]]


def target_distribution(params, logits):
    """What the plain sampler draws from: the verifier's own target at one position."""
    sampler = RejectionSampler(VOCAB)
    return sampler.target_probs(logits[None], [VerifyRow("x", params, [])], [1], [0])[0][0]


def chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target never gives was sampled"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def first_tokens(sampler, logits, params, drafts, draft_probs=None):
    """NUM_SAMPLES independent verifications (each its own seeded request) with the same target
    at every position; drafts: fixed ids (prompt lookup), or None: one id drawn from
    draft_probs [1, vocab] each time (a draft model). -> counts of the first and second token."""
    counts = torch.zeros(2, VOCAB)
    draw = torch.Generator().manual_seed(1234)
    for seed in range(NUM_SAMPLES):
        if draft_probs is not None:
            drafts = torch.multinomial(draft_probs[0], 1, generator=draw).tolist()
        k = len(drafts)
        seeded = SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=seed)
        row = VerifyRow(f"r{seed}", seeded, drafts, draft_probs)
        result = sampler.verify(logits.repeat(k + 1, 1), [row])
        tokens = result.token_ids[0]
        counts[0, tokens[0]] += 1
        if len(tokens) > 1 and tokens[0] == drafts[0]:
            counts[1, tokens[1]] += 1
    return counts


def assert_follows(counts, probs):
    statistic, dof = chi_square(counts, probs)
    assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, counts, probs)


LOGITS = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.0])


def test_prompt_lookup_drafts_keep_the_target_distribution():
    params = SamplingParams(temperature=0.8)
    p = target_distribution(params, LOGITS)
    counts = first_tokens(RejectionSampler(VOCAB), LOGITS, params, [3, 1])
    assert_follows(counts[0], p)
    assert_follows(counts[1], p)  # the token after an accepted draft, too


def test_the_target_is_the_samplers_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_k=4)
    p = target_distribution(params, LOGITS)
    assert p[4] == 0 and abs(float(p.sum()) - 1) < 1e-6
    counts = first_tokens(RejectionSampler(VOCAB), LOGITS, params, [4])  # a draft top-k cuts
    assert counts[0, 4] == 0
    assert_follows(counts[0][:4], p[:4])


def test_draft_model_drafts_keep_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    p = target_distribution(params, LOGITS)
    q = torch.tensor([0.05, 0.5, 0.05, 0.2, 0.2])
    counts = first_tokens(RejectionSampler(VOCAB), LOGITS, params, None, q[None])
    assert_follows(counts[0], p)


class ResampleFromTarget(RejectionSampler):
    """A wrong rule: on reject, draw from p itself (the draft keeps its mass twice)."""

    def _rejection_sample(self, p, row):
        accepted, tokens = super()._rejection_sample(p, row)
        if accepted < len(row.draft_token_ids):
            generator = self._generator(row, p.device)
            tokens[-1] = int(torch.multinomial(p[accepted], 1, generator=generator))
        return accepted, tokens


def test_a_wrong_rejection_rule_is_detected():
    params = SamplingParams(temperature=0.8)
    p = target_distribution(params, LOGITS)
    counts = first_tokens(ResampleFromTarget(VOCAB), LOGITS, params, [0])
    statistic, dof = chi_square(counts[0], p)
    assert statistic > CHI2_CRITICAL_0_001[dof]


def test_a_seeded_request_gets_the_same_tokens_whatever_the_batch():
    logits = LOGITS.repeat(3, 1)
    seeded = VerifyRow("s", SamplingParams(temperature=1.0, seed=7), [0, 3])
    alone = RejectionSampler(VOCAB).verify(logits, [seeded])
    other = VerifyRow("o", SamplingParams(temperature=1.0), [2])
    batched = RejectionSampler(VOCAB).verify(
        torch.cat([LOGITS.repeat(2, 1), logits]), [other, seeded]
    )
    assert batched.token_ids[1] == alone.token_ids[0]
    assert batched.num_accepted[1] == alone.num_accepted[0]
