"""Turn one row of logits per request into one token, following each request's SamplingParams.

The whole batch is sampled on the logits' device in float32, and one copy brings the sampled ids
(and logprobs, when asked) back. The host decides beforehand, from its own copy of the settings,
which rows need what (`SamplingPlan`); the device never has to answer a question mid-way.

Random rows use the exponential race: with q ~ Exp(1) per token, argmax(probs / q) is a sample
from probs, so a seeded request consumes exactly one vocab-sized draw of its own generator per
sampled token, whatever else is in the batch. Seeded rows are the only per-row Python: each owns
a torch.Generator.
"""

from __future__ import annotations

import torch

from runtime.sampling.ops import (
    Candidates,
    PenaltyInputs,
    apply_penalty_inputs,
    argmax,
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
        params: torch.Tensor,
        indices: SamplingIndices,
        penalties: PenaltyInputs | None,
        grammar_mask: GrammarMask | None = None,
    ) -> torch.Tensor:
        """logits: [num_seqs, >= vocab]; params: [num_seqs, NUM_PARAMS] on the device; indices:
        the plan's index tensors on the device; grammar_mask: the allowed tokens of the
        constrained rows, applied first. -> sampled ids [num_seqs] int64, or the packed ids and
        logprobs (see pack_logprobs) when some row asks for logprobs."""
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
            group, group_indices = groups[0]
            settings = settings_of(params, group, self.vocab_size)
            return self._race(prepare_candidates(logits, settings), group, group_indices)
        token_ids = argmax(logits)  # [num_seqs], right for the greedy rows
        for group, group_indices in groups:
            rows = group_indices.rows
            settings = settings_of(params.index_select(0, rows), group, self.vocab_size)
            candidates = prepare_candidates(logits.index_select(0, rows), settings)
            token_ids.index_copy_(0, rows, self._race(candidates, group, group_indices))
        return token_ids

    def _race(self, candidates: Candidates, group: RandomGroup, indices: GroupIndices):
        """One token per row: the candidate with the largest prob / Exp(1) noise."""
        noise = self._draw_exponential_noise(group, indices, candidates)
        winners = argmax(candidates.probs / noise)  # [num_rows]
        if candidates.token_ids is None:
            return winners
        return candidates.token_ids.gather(1, winners[:, None]).squeeze(1)

    def _draw_exponential_noise(self, group: RandomGroup, indices: GroupIndices, candidates):
        probs, candidate_ids = candidates.probs, candidates.token_ids
        device = probs.device
        noise = torch.empty_like(probs)  # [num_rows, num_candidates]
        for row, request_id, seed in group.seeded:
            # A seeded request draws a whole vocab of noise per token, whatever its candidates.
            token_noise = torch.empty(self.vocab_size, device=device)
            token_noise.exponential_(generator=self.request_generator(request_id, seed, device))
            noise[row] = token_noise if candidate_ids is None else token_noise[candidate_ids[row]]
        if group.num_unseeded:
            shared = torch.empty(group.num_unseeded, probs.shape[1], device=device)
            shared.exponential_(generator=self.shared_generator(device))
            if group.num_unseeded == probs.shape[0]:
                noise = shared
            else:
                noise[indices.unseeded] = shared
        # Exp(1) can return exactly 0; keep the division finite so excluded tokens stay at 0.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

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
