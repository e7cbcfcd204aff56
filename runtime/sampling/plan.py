"""What a step's sampling needs, decided on the host from its own copy of the settings.

Each request's SamplingParams become one row of floats (`param_rows`), kept on the host and on
the device. From the host rows, `plan_sampling` works out which rows are greedy, random (plain or
filtered), penalised, seeded or want logprobs, as small index tensors that travel to the device
with the step's inputs; the device then gathers the float settings it needs from its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.sampling.ops import FilterSettings, PenaltyInputs
from scheduler.request import Request, SamplingParams

# columns of a parameter row (float64: exact for every int a setting holds)
TEMPERATURE, TOP_K, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE, HAS_SEED, LOGPROBS = range(9)
NUM_PARAMS = 9


def param_row(params: SamplingParams) -> list[float]:
    return [
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
        params.frequency_penalty,
        params.presence_penalty,
        float(params.seed is not None),
        -1.0 if params.logprobs is None else params.logprobs,
    ]


def param_rows(all_params: Sequence[SamplingParams]) -> torch.Tensor:
    """-> [num_rows, NUM_PARAMS] float64 on the host."""
    rows = [param_row(p) for p in all_params]
    return torch.tensor(rows, dtype=torch.float64).view(len(rows), NUM_PARAMS)


@dataclass
class RandomGroup:
    """Rows that sample at random and share one candidate shape (all plain or all filtered)."""

    rows_key: str  # name of its [num_rows] index tensor (rows of the logits)
    covers_all: bool  # every row of the batch, in order (no gather needed)
    unseeded_key: str  # name of its [num_unseeded] index tensor (rows within the group)
    num_unseeded: int
    seeded: list[tuple[int, str, int]]  # (row within the group, request id, seed)
    is_filtered: bool
    max_cutting_top_k: int
    all_cut_by_top_k: bool
    any_min_p: bool


@dataclass
class SamplingPlan:
    is_plain_greedy: bool  # every row greedy, nothing penalised: one max over the vocab
    has_penalties: bool
    max_top_n: int | None  # None: nobody wants logprobs
    logprob_top_ns: list[tuple[int, int]]  # (row, top n) of rows that want logprobs
    random_groups: list[RandomGroup]
    host_indices: dict[str, torch.Tensor] = field(default_factory=dict)  # int64, to the device
    penalty_rows: list[int] = field(default_factory=list)


def plan_sampling(params: torch.Tensor, requests: Sequence[Request]) -> SamplingPlan:
    """params: [num_rows, NUM_PARAMS] host rows of the requests, in sampling order."""
    greedy = (params[:, TEMPERATURE] < 1e-5) | (params[:, TOP_K] == 1)
    penalised = (
        (params[:, PRESENCE] != 0) | (params[:, FREQUENCY] != 0) | (params[:, REPETITION] != 1)
    )
    wants_logprobs = params[:, LOGPROBS] >= 0
    plan = SamplingPlan(
        is_plain_greedy=bool(greedy.all()) and not bool(penalised.any()),
        has_penalties=bool(penalised.any()),
        max_top_n=int(params[:, LOGPROBS].max()) if bool(wants_logprobs.any()) else None,
        logprob_top_ns=[],
        random_groups=[],
    )
    if plan.max_top_n is not None:
        rows = wants_logprobs.nonzero().flatten()
        plan.host_indices["logprob_rows"] = rows
        plan.logprob_top_ns = list(zip(rows.tolist(), params[rows, LOGPROBS].long().tolist()))
    if plan.has_penalties:
        plan.host_indices["penalty_rows"] = penalised.nonzero().flatten()
        plan.penalty_rows = plan.host_indices["penalty_rows"].tolist()
    filtered = (params[:, TOP_K] > 0) | (params[:, TOP_P] < 1.0)
    for name, mask in (("plain", ~greedy & ~filtered), ("filtered", ~greedy & filtered)):
        rows = mask.nonzero().flatten()
        if rows.numel():
            plan.random_groups.append(_random_group(name, params, rows, requests, plan))
    return plan


def _random_group(name, params, rows, requests, plan: SamplingPlan) -> RandomGroup:
    group_params = params[rows]  # [num_rows, NUM_PARAMS]
    seeded = group_params[:, HAS_SEED] > 0
    seeded_rows = seeded.nonzero().flatten().tolist()
    unseeded_rows = (~seeded).nonzero().flatten()
    plan.host_indices[f"{name}_rows"] = rows
    plan.host_indices[f"{name}_unseeded"] = unseeded_rows
    top_ks = group_params[:, TOP_K]
    cutting = top_ks > 0  # a cut past the vocab is treated as a cut: its candidates cover it
    return RandomGroup(
        rows_key=f"{name}_rows",
        covers_all=len(rows) == len(params),
        unseeded_key=f"{name}_unseeded",
        num_unseeded=int(unseeded_rows.numel()),
        seeded=[(i, *_id_and_seed(requests[int(rows[i])])) for i in seeded_rows],  # few
        is_filtered=name == "filtered",
        max_cutting_top_k=int(top_ks[cutting].max()) if bool(cutting.any()) else 1,
        all_cut_by_top_k=bool(cutting.all()),
        any_min_p=bool((group_params[:, MIN_P] > 0).any()),
    )


def _id_and_seed(request: Request) -> tuple[str, int]:
    return request.request_id, request.sampling_params.seed


def settings_of(params: torch.Tensor, group: RandomGroup, vocab_size: int) -> FilterSettings:
    """params: [num_rows, NUM_PARAMS] device rows of one random group."""
    top_k = params[:, TOP_K].long()
    return FilterSettings(
        temperature=params[:, TEMPERATURE].float(),
        top_k=torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size),
        top_p=params[:, TOP_P].float(),
        min_p=params[:, MIN_P].float(),
        is_filtered=group.is_filtered,
        max_cutting_top_k=min(group.max_cutting_top_k, vocab_size),
        all_cut_by_top_k=group.is_filtered and group.all_cut_by_top_k,
        any_min_p=group.any_min_p,
    )


def filter_settings(params: torch.Tensor, vocab_size: int) -> FilterSettings:
    """Settings of rows all filtered, facts read from the rows themselves (tests, tools)."""
    top_ks = params[:, TOP_K]
    cutting = (top_ks > 0) & (top_ks < vocab_size)
    group = RandomGroup(
        rows_key="",
        covers_all=True,
        unseeded_key="",
        num_unseeded=0,
        seeded=[],
        is_filtered=True,
        max_cutting_top_k=int(top_ks[cutting].max()) if bool(cutting.any()) else 1,
        all_cut_by_top_k=bool(cutting.all()),
        any_min_p=bool((params[:, MIN_P] > 0).any()),
    )
    return settings_of(params, group, vocab_size)


def penalty_inputs(
    params: torch.Tensor, rows: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor
) -> PenaltyInputs:
    """params: [num_seqs, NUM_PARAMS] device rows; rows: [num_penalised]; ids padded with vocab."""
    penalised = params[rows]
    return PenaltyInputs(
        rows=rows,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        repetition=penalised[:, REPETITION].float(),
        frequency=penalised[:, FREQUENCY].float(),
        presence=penalised[:, PRESENCE].float(),
    )


def penalty_inputs_from_requests(
    requests: list[Request],
    params: torch.Tensor,
    indices: dict[str, torch.Tensor],
) -> PenaltyInputs:
    """The seen tokens from the requests' own lists (the sampler's standalone path)."""
    rows = indices["penalty_rows"]
    penalised = [requests[i] for i in rows.tolist()]
    prompt = padded_token_ids([r.prompt_token_ids for r in penalised]).to(rows.device)
    output = padded_token_ids([r.output_token_ids for r in penalised]).to(rows.device)
    return penalty_inputs(params, rows, prompt, output)


def padded_token_ids(token_lists: list[list[int]]) -> torch.Tensor:
    """[num_lists, longest] int64, padded with -1 (apply_penalty_inputs skips it)."""
    width = max(1, max(len(t) for t in token_lists))
    return torch.tensor([t + [-1] * (width - len(t)) for t in token_lists], dtype=torch.long)
