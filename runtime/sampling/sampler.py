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

from dataclasses import dataclass

import torch

from runtime.sampling.ops import (
    CANDIDATE_STAGES,
    Candidates,
    PenaltyInputs,
    apply_penalty_inputs,
    argmax,
    keep_top_k_top_p,
    pack_logprobs,
    prepare_candidates,
    top_k_top_p_candidates_of,
)
from runtime.sampling.plan import (
    RandomGroup,
    SamplingPlan,
    filter_settings,
    param_rows,
    penalty_inputs_from_requests,
    plan_sampling,
    settings_of,
)
from runtime.structured.masks import GrammarMask
from scheduler.request import Request, SamplingParams

__all__ = [
    "CANDIDATE_STAGES",
    "Sampler",
    "SamplerOutput",
    "TokenLogprobs",
    "apply_penalties",
    "is_filtered",
    "keep_top_k_top_p",
    "top_k_top_p_candidates",
]


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-n (token_id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row of logits
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def is_filtered(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        self.vocab_size = vocab_size
        self.seed = seed  # seeds the shared generator of unseeded requests; None = random
        self._request_generators: dict[str, torch.Generator] = {}
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_seqs, >= vocab] (any float dtype), row i belongs to requests[i]."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), logits.shape
        device = logits.device
        params = param_rows([r.sampling_params for r in requests])  # [num_seqs, NUM_PARAMS]
        plan = plan_sampling(params, requests)
        indices = {name: index.to(device) for name, index in plan.host_indices.items()}
        penalties = None
        if plan.has_penalties:
            penalties = penalty_inputs_from_requests(requests, params.to(device), indices)
        packed = self.sample_on_device(logits, plan, params.to(device), indices, penalties)
        return unpack(packed.cpu(), plan)  # standalone use: no pinned copy

    def sample_on_device(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        params: torch.Tensor,
        indices: dict[str, torch.Tensor],
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
        return pack_logprobs(logits, token_ids, indices["logprob_rows"], plan.max_top_n)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._request_generators.pop(request_id, None)

    def _sample_processed(self, logits, plan, params, indices, penalties) -> torch.Tensor:
        if penalties is not None:
            logits = apply_penalty_inputs(logits, penalties)
        if any(group.covers_all for group in plan.random_groups):  # no greedy row
            group = plan.random_groups[0]
            settings = settings_of(params, group, self.vocab_size)
            return self._race(prepare_candidates(logits, settings), group, indices)
        token_ids = argmax(logits)  # [num_seqs], right for the greedy rows
        for group in plan.random_groups:
            rows = indices[group.rows_key]
            settings = settings_of(params.index_select(0, rows), group, self.vocab_size)
            candidates = prepare_candidates(logits.index_select(0, rows), settings)
            token_ids.index_copy_(0, rows, self._race(candidates, group, indices))
        return token_ids

    def _race(self, candidates: Candidates, group: RandomGroup, indices) -> torch.Tensor:
        """One token per row: the candidate with the largest prob / Exp(1) noise."""
        noise = self._draw_exponential_noise(group, indices, candidates)
        winners = argmax(candidates.probs / noise)  # [num_rows]
        if candidates.token_ids is None:
            return winners
        return candidates.token_ids.gather(1, winners[:, None]).squeeze(1)

    def _draw_exponential_noise(self, group: RandomGroup, indices, candidates: Candidates):
        probs, candidate_ids = candidates.probs, candidates.token_ids
        device = probs.device
        noise = torch.empty_like(probs)  # [num_rows, num_candidates]
        for row, request_id, seed in group.seeded:
            # A seeded request draws a whole vocab of noise per token, whatever its candidates.
            token_noise = torch.empty(self.vocab_size, device=device)
            token_noise.exponential_(generator=self._request_generator(request_id, seed, device))
            noise[row] = token_noise if candidate_ids is None else token_noise[candidate_ids[row]]
        if group.num_unseeded:
            shared = torch.empty(group.num_unseeded, probs.shape[1], device=device)
            shared.exponential_(generator=self._shared_generator(device))
            if group.num_unseeded == probs.shape[0]:
                noise = shared
            else:
                noise[indices[group.unseeded_key]] = shared
        # Exp(1) can return exactly 0; keep the division finite so excluded tokens stay at 0.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _request_generator(self, request_id: str, seed: int, device) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._shared_generators[device] = generator
        return generator


def unpack(host: torch.Tensor, plan: SamplingPlan) -> SamplerOutput:
    """The host copy of sample_on_device's result -> token ids and logprobs."""
    if plan.max_top_n is None:
        token_ids = host.tolist()
        return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(token_ids))
    n = plan.max_top_n
    rows = host.tolist()
    token_ids = [int(row[0]) for row in rows]
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    for i, top_n in plan.logprob_top_ns:
        row = rows[i]
        top = [(int(t), lp) for t, lp in zip(row[2 + n : 2 + n + top_n], row[2 : 2 + top_n])]
        logprobs[i] = TokenLogprobs(token_ids[i], row[1], top)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only); a new tensor."""
    params = param_rows([r.sampling_params for r in requests])
    plan = plan_sampling(params, requests)
    if not plan.has_penalties:
        return logits
    indices = {name: index.to(logits.device) for name, index in plan.host_indices.items()}
    penalties = penalty_inputs_from_requests(requests, params.to(logits.device), indices)
    return apply_penalty_inputs(logits.float(), penalties)


def top_k_top_p_candidates(probs: torch.Tensor, all_params: list[SamplingParams]) -> Candidates:
    """Top-k then top-p over probs [num_rows, vocab], each row with its own params."""
    params = param_rows(all_params).to(probs.device)
    return top_k_top_p_candidates_of(probs, filter_settings(params, probs.shape[1]))
