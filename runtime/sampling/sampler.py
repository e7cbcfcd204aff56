"""Turn one row of logits per request into one token, following each request's SamplingParams.

The whole batch is sampled on the logits' device in float32, and one copy brings the sampled ids
(and logprobs, when asked) back. The host decides beforehand, from its own copy of the settings,
which rows need what (`SamplingPlan`); the device never has to answer a question mid-way.

Random rows draw by the inverse CDF (ops.draw_from_probs): one uniform a token, so a seeded
request consumes exactly one draw of its own generator per sampled token, whatever else is in
the batch; a filtered row's candidates are put in token-id order first, so that the same uniform
picks the same token however many candidates the batch looked at. (The exponential race it
replaced, argmax(probs / Exp(1) noise), drew a vocab of noise a token: torch's CPU exponential_
took 106 ms a step at 32 rows of Qwen's 151,936 tokens, 2.9 ms at one, where this takes 1.2 ms.)
On CPU the same draw, filters included, runs in one native pass a row (ops.draw_natively), and
where one random group is the whole batch and nothing else touches the logits, from the logits
as they come (no float32 copy). Seeded rows are the only per-row Python: each owns a
torch.Generator.
"""

from __future__ import annotations

import torch

from kernels.row_max import argmax
from runtime.sampling.ops import (
    Candidates,
    PenaltyInputs,
    apply_penalty_inputs,
    draw_from_probs,
    draw_natively,
    draws_natively,
    pack_logprobs,
    prepare_candidates,
)
from runtime.sampling.plan import (
    GroupIndices,
    RandomGroup,
    SamplingIndices,
    SamplingPlan,
    settings_of,
)
from runtime.structured.masks import GrammarMask


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        self.vocab_size = vocab_size
        self.seed = seed  # seeds the shared generator of unseeded requests; None = random
        self._request_generators: dict[str, torch.Generator] = {}
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def sample_on_device(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        params: torch.Tensor | None,
        indices: SamplingIndices,
        penalties: PenaltyInputs | None,
        grammar_mask: GrammarMask | None = None,
    ) -> torch.Tensor:
        """logits: [num_seqs, >= vocab]; params: [num_seqs, NUM_PARAMS] on the device (None where
        plan.is_plain_greedy: unread); indices: the plan's index tensors on the device;
        grammar_mask: the allowed tokens of the constrained rows, applied first. -> sampled ids
        [num_seqs] int64, or the packed ids and logprobs (see pack_logprobs) when some row asks
        for logprobs."""
        if _one_random_group(plan, grammar_mask) and draws_natively(logits):  # no float32 copy
            return self._draw_group(logits, params, plan.random_groups[0], indices.random[0])
        logits = logits[:, : self.vocab_size].float()  # [num_seqs, vocab]
        if grammar_mask is not None:
            logits = grammar_mask.apply(logits)
        if plan.is_plain_greedy:
            token_ids = argmax(logits)
        else:
            token_ids = self._sample_processed(logits, plan, params, indices, penalties)
        if plan.max_top_n is None:
            return token_ids
        return pack_logprobs(logits, token_ids, indices.logprob_rows, plan.max_top_n)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._request_generators.pop(request_id, None)

    def _sample_processed(self, logits, plan, params, indices, penalties) -> torch.Tensor:
        if penalties is not None:
            logits = apply_penalty_inputs(logits, penalties)
        groups = list(zip(plan.random_groups, indices.random))
        if any(group.covers_all for group, _ in groups):  # no greedy row
            return self._draw_group(logits, params, *groups[0])
        token_ids = argmax(logits)  # [num_seqs], right for the greedy rows
        for group, group_indices in groups:
            rows = group_indices.rows
            group_logits, group_params = logits.index_select(0, rows), params.index_select(0, rows)
            drawn = self._draw_group(group_logits, group_params, group, group_indices)
            token_ids.index_copy_(0, rows, drawn)
        return token_ids

    def _draw_group(self, logits, params, group: RandomGroup, indices: GroupIndices):
        """One token per row of a random group; logits and params its rows."""
        settings = settings_of(params, group, self.vocab_size)
        uniforms = self._draw_uniforms(group, indices, logits.shape[0], logits.device)
        if draws_natively(logits):
            return draw_natively(logits, self.vocab_size, settings, uniforms)
        probs, token_ids = in_token_order(prepare_candidates(logits, settings), self.vocab_size)
        winners = draw_from_probs(probs, uniforms)  # [num_rows]
        if token_ids is None:
            return winners
        return token_ids.gather(1, winners[:, None]).squeeze(1)

    def _draw_uniforms(self, group: RandomGroup, indices: GroupIndices, num_rows: int, device):
        """[num_rows] float32 in [0, 1): a seeded row's from its own generator."""
        uniforms = torch.empty(num_rows, device=device)
        for row, request_id, seed in group.seeded:
            generator = self.request_generator(request_id, seed, device)
            uniforms[row] = torch.rand(1, generator=generator, device=device)[0]
        if group.num_unseeded:
            shared = torch.rand(
                group.num_unseeded, generator=self.shared_generator(device), device=device
            )
            if group.num_unseeded == num_rows:
                return shared
            uniforms[indices.unseeded] = shared
        return uniforms

    def request_generator(self, request_id: str, seed: int, device) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator

    def shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._shared_generators[device] = generator
        return generator


def _one_random_group(plan: SamplingPlan, grammar_mask: GrammarMask | None) -> bool:
    """Every row samples at random alike (one group) and nothing else touches the logits."""
    if plan.has_penalties or plan.max_top_n is not None or grammar_mask is not None:
        return False
    return len(plan.random_groups) == 1 and plan.random_groups[0].covers_all


def in_token_order(
    candidates: Candidates, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row's candidates ordered by token id -> (probs, their token ids; None: column j is token
    j). Candidates come best first, and ties among them may fall in another order when a batch
    looks at more of them: in token-id order a uniform picks the same token either way."""
    probs, token_ids = candidates.probs, candidates.token_ids
    if token_ids is None:
        return probs, None
    if token_ids.shape[1] == vocab_size:  # every token: a permutation, undone by a scatter
        return torch.zeros_like(probs).scatter_(1, token_ids, probs), None
    token_ids, order = token_ids.sort(dim=-1)
    return probs.gather(1, order), token_ids
