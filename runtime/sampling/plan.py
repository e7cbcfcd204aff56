"""What a step's sampling needs, decided on the host from its own copy of the settings, and how
to read the sampled result back.

Each request's SamplingParams become one row of floats (`param_row`), kept on the host and on
the device. From the host rows, `plan_sampling` works out which rows are greedy, random (plain or
filtered), penalised, seeded or want logprobs, as small index tensors (`SamplingIndices`) that
travel to the device with the step's inputs; the device then gathers the float settings it needs
from its own rows. `unpack` reads the one copy that comes back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.sampling.ops import FilterSettings, PenaltyInputs
from scheduler.request import SamplingParams

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
class GroupIndices:
    rows: torch.Tensor  # [num_rows] the group's rows of the logits
    unseeded: torch.Tensor  # [num_unseeded] its unseeded rows, within the group


@dataclass
class SamplingIndices:
    """The plan's index tensors (int64), staged with the step's inputs."""

    logprob_rows: torch.Tensor | None = None  # [num_logprob_rows]
    penalty_rows: torch.Tensor | None = None  # [num_penalised]
    prompt_ids: torch.Tensor | None = None  # [num_penalised, longest], padded with -1
    output_ids: torch.Tensor | None = None  # [num_penalised, longest], padded with -1
    random: list[GroupIndices] = field(default_factory=list)  # as plan.random_groups


@dataclass
class RandomGroup:
    """Rows that sample at random and share one candidate shape (all plain or all filtered)."""

    covers_all: bool  # every row of the batch, in order (no gather needed)
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


def plan_sampling(
    params: np.ndarray | torch.Tensor, request_ids: Sequence[str], seeds: Sequence[int | None]
) -> tuple[SamplingPlan, SamplingIndices]:
    """params: [num_rows, NUM_PARAMS] host rows of the requests, in sampling order (a numpy
    array or a CPU tensor: read in numpy, a step's few rows cost microseconds, not the 0.1 ms of
    torch calls); seeds: each row's seed (seeded rows draw from a generator of their own, kept
    by request id)."""
    params = np.asarray(params)
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
    indices = SamplingIndices()
    if plan.max_top_n is not None:
        rows = np.flatnonzero(wants_logprobs)
        indices.logprob_rows = torch.from_numpy(rows)
        plan.logprob_top_ns = list(
            zip(rows.tolist(), params[rows, LOGPROBS].astype(np.int64).tolist())
        )
    if plan.has_penalties:
        indices.penalty_rows = torch.from_numpy(np.flatnonzero(penalised))
    filtered = (params[:, TOP_K] > 0) | (params[:, TOP_P] < 1.0)
    for is_filtered, mask in ((False, ~greedy & ~filtered), (True, ~greedy & filtered)):
        rows = np.flatnonzero(mask)
        if rows.size:
            seeded = [(request_ids[r], seeds[r]) for r in rows.tolist()]
            group, group_indices = _random_group(is_filtered, params, rows, seeded)
            plan.random_groups.append(group)
            indices.random.append(group_indices)
    return plan, indices


def _random_group(
    is_filtered: bool, params: np.ndarray, rows: np.ndarray, ids_and_seeds
) -> tuple[RandomGroup, GroupIndices]:
    group_params = params[rows]  # [num_rows, NUM_PARAMS]
    seeded = group_params[:, HAS_SEED] > 0
    seeded_rows = np.flatnonzero(seeded).tolist()
    unseeded_rows = np.flatnonzero(~seeded)
    top_ks = group_params[:, TOP_K]
    cutting = top_ks > 0  # a cut past the vocab is treated as a cut: its candidates cover it
    group = RandomGroup(
        covers_all=len(rows) == len(params),
        num_unseeded=int(unseeded_rows.size),
        seeded=[(i, *ids_and_seeds[i]) for i in seeded_rows],  # few
        is_filtered=is_filtered,
        max_cutting_top_k=int(top_ks[cutting].max()) if bool(cutting.any()) else 1,
        all_cut_by_top_k=bool(cutting.all()),
        any_min_p=bool((group_params[:, MIN_P] > 0).any()),
    )
    return group, GroupIndices(torch.from_numpy(rows), torch.from_numpy(unseeded_rows))


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
    """Settings of rows all filtered, facts read from the rows themselves (the speculative
    verifier, whose rows are not grouped by a plan)."""
    top_ks = params[:, TOP_K]
    cutting = (top_ks > 0) & (top_ks < vocab_size)
    group = RandomGroup(
        covers_all=True,
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


def padded_token_ids(token_lists: list[list[int]]) -> torch.Tensor:
    """[num_lists, longest] int64, padded with -1 (apply_penalty_inputs skips it)."""
    width = max(1, max(len(t) for t in token_lists))
    return torch.tensor([t + [-1] * (width - len(t)) for t in token_lists], dtype=torch.long)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-n (token_id, logprob), best first; only possible tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row of logits
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def is_filtered(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0


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
        # a token the row cannot sample (a grammar's mask: -inf) is no candidate: fewer than n
        pairs = zip(row[2 + n : 2 + n + top_n], row[2 : 2 + top_n])
        top = [(int(t), lp) for t, lp in pairs if lp > -math.inf]
        logprobs[i] = TokenLogprobs(token_ids[i], row[1], top)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
