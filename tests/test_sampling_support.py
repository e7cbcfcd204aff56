"""The production sampling path (plan_sampling -> Sampler.sample_on_device -> unpack) driven from
`Request` objects, for tests that sample a batch of logits without an engine."""

from __future__ import annotations

import torch

from runtime.sampling.ops import Candidates, apply_penalty_inputs, top_k_top_p_candidates_of
from runtime.sampling.plan import (
    GroupIndices,
    RandomGroup,
    SamplerOutput,
    SamplingIndices,
    padded_token_ids,
    param_rows,
    penalty_inputs,
    plan_sampling,
    settings_of,
    unpack,
)
from runtime.sampling.sampler import Sampler
from scheduler.request import Request, SamplingParams


def plan_for(requests: list[Request], device=None):
    """-> (plan, indices on the device, params [num_rows, NUM_PARAMS] on the device)."""
    params = param_rows([r.sampling_params for r in requests])
    ids = [r.request_id for r in requests]
    seeds = [r.sampling_params.seed for r in requests]
    plan, indices = plan_sampling(params, ids, seeds)
    if plan.has_penalties:
        penalised = [requests[i] for i in indices.penalty_rows.tolist()]
        indices.prompt_ids = padded_token_ids([r.prompt_token_ids for r in penalised])
        indices.output_ids = padded_token_ids([r.output_token_ids for r in penalised])
    return plan, _to(indices, device), params.to(device)


def _to(indices: SamplingIndices, device) -> SamplingIndices:
    def move(t):
        return None if t is None else t.to(device)

    return SamplingIndices(
        logprob_rows=move(indices.logprob_rows),
        penalty_rows=move(indices.penalty_rows),
        prompt_ids=move(indices.prompt_ids),
        output_ids=move(indices.output_ids),
        random=[GroupIndices(move(g.rows), move(g.unseeded)) for g in indices.random],
    )


def penalties_for(plan, indices: SamplingIndices, params):
    if not plan.has_penalties:
        return None
    return penalty_inputs(params, indices.penalty_rows, indices.prompt_ids, indices.output_ids)


def sample(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """logits: [num_seqs, >= vocab], row i belongs to requests[i]."""
    assert logits.dim() == 2 and logits.shape[0] == len(requests), logits.shape
    plan, indices, params = plan_for(requests, logits.device)
    penalties = penalties_for(plan, indices, params)
    packed = sampler.sample_on_device(logits, plan, params, indices, penalties)
    return unpack(packed.cpu(), plan)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only); a new tensor."""
    plan, indices, params = plan_for(requests, logits.device)
    if not plan.has_penalties:
        return logits
    return apply_penalty_inputs(logits.float(), penalties_for(plan, indices, params))


def top_k_top_p_candidates(probs: torch.Tensor, all_params: list[SamplingParams]) -> Candidates:
    """Top-k then top-p over probs [num_rows, vocab], each row with its own params."""
    params = param_rows(all_params).to(probs.device)
    top_ks = params[:, 1]
    vocab_size = probs.shape[1]
    cutting = (top_ks > 0) & (top_ks < vocab_size)
    group = RandomGroup(
        covers_all=True,
        num_unseeded=0,
        seeded=[],
        is_filtered=True,
        max_cutting_top_k=int(top_ks[cutting].max()) if bool(cutting.any()) else 1,
        all_cut_by_top_k=bool(cutting.all()),
        any_min_p=bool((params[:, 3] > 0).any()),
    )
    return top_k_top_p_candidates_of(probs, settings_of(params, group, vocab_size))
