"""Batched sampling operations on device tensors: penalties, temperature, top-k/top-p/min-p
candidates, logprobs. No per-row Python; the callers pass what the host already knows (which
rows need what) so that no branch here reads a device value, except where noted for CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.native import native_ops

CANDIDATE_STAGES = (256, 4096)  # top-k/top-p look at this many best tokens, then the whole vocab
CDF_BLOCK = 1024  # draw_from_probs: columns a block of the first level


def draw_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [num_rows, n] >= 0, not normalised, each row some mass; uniforms: [num_rows]
    float32 in [0, 1). -> [num_rows] int64: column i with probability probs[i] / the row's mass,
    the first whose cumulative mass exceeds uniform * mass (the inverse CDF: one uniform a
    token). Two levels, so that no pass over the row is sequential: the mass of each block of
    CDF_BLOCK columns (float32 sums), their running total in float64, then the running total
    inside the one block the uniform lands in, rescaled to that block's sum. Never a column of
    zero probability (a rounding that overshoots takes the block's last positive column); a row
    without mass (all zero, NaN) gets a column in range, never an error."""
    num_rows, n = probs.shape
    block = min(CDF_BLOCK, n)
    whole = n // block * block
    sums = probs[:, :whole].reshape(num_rows, -1, block).sum(dim=-1)  # [num_rows, blocks]
    if whole < n:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    sums = sums.double()
    cumulative = sums.cumsum(dim=-1)  # [num_rows, num_blocks]
    target = uniforms.double() * cumulative[:, -1]  # [num_rows], below the row's mass
    chosen = _first_above(cumulative, target).clamp_(max=sums.shape[1] - 1)[:, None]
    block_mass = sums.gather(1, chosen)
    landed = cumulative.gather(1, chosen) - block_mass  # mass before the block
    share = ((target[:, None] - landed) / block_mass).clamp_(0.0, 1.0)
    columns = chosen * block + torch.arange(block, device=probs.device)  # [num_rows, block]
    values = probs.gather(1, columns.clamp(max=n - 1)) * (columns < n)
    inside = values.double().cumsum(dim=-1)  # [num_rows, block]
    picked = _first_above(inside, (share * inside[:, -1:]).squeeze(1))
    last_positive = ((values > 0) * torch.arange(1, block + 1, device=probs.device)).amax(-1) - 1
    picked = torch.where(picked < block, picked, last_positive).clamp_(min=0)  # no mass: 0
    return chosen.squeeze(1) * block + picked


def _first_above(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """cumulative: [num_rows, n] non-decreasing; target: [num_rows]. -> [num_rows] int64, the
    first column above the target (n where none is)."""
    return torch.searchsorted(cumulative, target[:, None].contiguous(), right=True).squeeze(1)


@dataclass
class PenaltyInputs:
    """The tokens each penalised row has seen, padded with -1."""

    rows: torch.Tensor  # [num_penalised] rows of the logits
    prompt_ids: torch.Tensor  # [num_penalised, max_len] int64
    output_ids: torch.Tensor  # [num_penalised, max_len] int64
    repetition: torch.Tensor  # [num_penalised] float32
    frequency: torch.Tensor  # [num_penalised] float32
    presence: torch.Tensor  # [num_penalised] float32


def apply_penalty_inputs(logits: torch.Tensor, penalties: PenaltyInputs) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only); a new tensor.

    logits: [num_rows, vocab] float32. Only seen tokens change, as in vLLM and HF. On CPU the
    native kernel (kernels/cpu/sampling.cpp) changes just those, bit for bit as below, in a copy
    of the logits (eight [rows, vocab] tensors here: a median 28-32 ms a step at 32 rows of
    Qwen's vocab)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and native_ops() is not None:
        logits = logits.clone(memory_format=torch.contiguous_format)  # one copy, strided or not
        native_ops().apply_penalties_(
            logits, penalties.rows, penalties.prompt_ids, penalties.output_ids,
            penalties.repetition, penalties.frequency, penalties.presence,
        )  # fmt: skip
        return logits
    return penalised_by_torch(logits, penalties)


def penalised_by_torch(logits: torch.Tensor, penalties: PenaltyInputs) -> torch.Tensor:
    """apply_penalty_inputs in torch operations: the GPU's path and the native kernel's oracle."""
    num_rows, vocab_size = penalties.prompt_ids.shape[0], logits.shape[1]
    device = logits.device
    output_ids = _padding_to_dummy(penalties.output_ids, vocab_size)
    counts = torch.zeros(num_rows, vocab_size + 1, device=device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]  # [num_penalised, vocab], output occurrences
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, _padding_to_dummy(penalties.prompt_ids, vocab_size), True)
    seen = seen[:, :vocab_size] | (counts > 0)
    values = logits[penalties.rows]  # [num_penalised, vocab]
    repetition = penalties.repetition[:, None]
    repeated = torch.where(values > 0, values / repetition, values * repetition)
    values = torch.where(seen, repeated, values)
    values = values - penalties.frequency[:, None] * counts
    values = values - penalties.presence[:, None] * (counts > 0).float()
    logits = logits.clone(memory_format=torch.contiguous_format)
    logits[penalties.rows] = values
    return logits


def _padding_to_dummy(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-1 padding -> column vocab_size, which is dropped after the scatter."""
    return torch.where(token_ids < 0, vocab_size, token_ids)


@dataclass
class Candidates:
    """The tokens each random row may still pick."""

    probs: torch.Tensor  # [num_rows, num_candidates], unnormalised; 0 = excluded
    token_ids: torch.Tensor | None  # [num_rows, num_candidates]; None: candidate j is token j


@dataclass
class FilterSettings:
    """Per-row filters of rows that sample at random, plus host-side facts about them."""

    temperature: torch.Tensor  # [num_rows] float32
    top_k: torch.Tensor  # [num_rows] int64; vocab_size where top-k is off
    top_p: torch.Tensor  # [num_rows] float32
    min_p: torch.Tensor  # [num_rows] float32
    is_filtered: bool  # some row cuts by top-k or top-p
    max_cutting_top_k: int  # largest top-k that cuts (1 if none)
    all_cut_by_top_k: bool  # every row's top-k cuts: the best max_cutting_top_k suffice
    any_min_p: bool


def draws_natively(logits: torch.Tensor) -> bool:
    """Random rows of these logits draw in one native pass a row (draw_natively): CPU, float32
    or bfloat16, columns contiguous, the kernels built. Decided by the process (the device, the
    model's dtype), never by the batch, so that a seeded row draws alike in any."""
    if logits.device.type != "cpu" or logits.stride(-1) != 1:
        return False
    return logits.dtype in (torch.float32, torch.bfloat16) and native_ops() is not None


def draw_natively(
    logits: torch.Tensor, vocab_size: int, settings: FilterSettings, uniforms: torch.Tensor
) -> torch.Tensor:
    """prepare_candidates then draw_from_probs at each row's uniform, in one pass a row of
    kernels/cpu/sampling.cpp over logits [num_rows, >= vocab] that makes no [num_rows, vocab]
    tensor (the torch path makes three to six, and sorts the whole vocab where a nucleus is wide:
    at 32 rows of Qwen's 151,936 tokens its median was 4.6 ms a step at temperature 1 and 222 ms
    with top-p 0.9 on the server's engine thread). -> [num_rows] int64."""
    top_k = settings.top_k if settings.is_filtered else None
    top_p = settings.top_p if settings.is_filtered else None
    min_p = settings.min_p if settings.any_min_p else None
    return native_ops().draw_tempered(
        logits, vocab_size, settings.temperature, min_p, top_k, top_p, uniforms
    )


def prepare_candidates(logits: torch.Tensor, settings: FilterSettings) -> Candidates:
    """Temperature, top-k, top-p, then min-p, for rows that all sample at random."""
    probs = (logits / settings.temperature[:, None]).softmax(dim=-1)
    if settings.is_filtered:
        candidates = top_k_top_p_candidates_of(probs, settings)
    else:
        candidates = Candidates(probs, None)
    if settings.any_min_p:
        candidates.probs = apply_min_p(candidates.probs, settings.min_p[:, None])
    return candidates


def top_k_top_p_candidates_of(probs: torch.Tensor, settings: FilterSettings) -> Candidates:
    """Top-k then top-p over probs [num_rows, vocab]: first among the few most likely tokens,
    over the whole vocab only when some row's nucleus reaches past them. Deciding that reads a
    device flag, so on CUDA it goes straight to the whole vocab unless top-k bounds every row."""
    vocab_size = probs.shape[1]
    top_ks, top_ps = settings.top_k[:, None], settings.top_p[:, None]
    total_probs = probs.sum(dim=-1, keepdim=True)  # [num_rows, 1], about 1
    if settings.all_cut_by_top_k:
        stages = (settings.max_cutting_top_k,)
    elif probs.device.type == "cpu":
        stages = CANDIDATE_STAGES
    else:
        stages = ()
    for num_candidates in stages:
        num_candidates = min(vocab_size, max(num_candidates, settings.max_cutting_top_k))
        candidates, fits = keep_top_k_top_p(probs, top_ks, top_ps, total_probs, num_candidates)
        if settings.all_cut_by_top_k or bool(fits):
            return candidates
    candidates, _ = keep_top_k_top_p(probs, top_ks, top_ps, total_probs, vocab_size)
    return candidates


def keep_top_k_top_p(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    total_probs: torch.Tensor,
    num_candidates: int,
) -> tuple[Candidates, torch.Tensor]:
    """Candidates among the num_candidates best tokens; fits (a device bool): no row needs more.

    top_ks, top_ps, total_probs: [num_rows, 1]; invariant: top_ks <= num_candidates or = vocab.
    """
    best_probs, best_ids = probs.topk(num_candidates, dim=-1)  # [num_rows, num_candidates]
    positions = torch.arange(num_candidates, device=probs.device)
    best_probs = best_probs * (positions < top_ks)
    cumulative = best_probs.cumsum(dim=-1)
    top_k_cuts = top_ks < probs.shape[1]
    mass = torch.where(top_k_cuts, cumulative[:, -1:], total_probs)  # left after top-k
    # Keep a token while the mass of the better ones is below top_p; the best always stays.
    in_top_p = (cumulative - best_probs < top_ps * mass) | (top_ps >= 1.0) | (positions == 0)
    nucleus_closed = cumulative[:, -1:] >= top_ps * mass
    fits = (top_k_cuts | nucleus_closed).all() | (num_candidates == probs.shape[1])
    return Candidates(best_probs * in_top_p, best_ids), fits


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """probs: [num_rows, num_candidates]; min_ps: [num_rows, 1]. Drop tokens below min_p * best."""
    threshold = min_ps * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def pack_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, max_top_n: int
) -> torch.Tensor:
    """The sampled ids and, for `rows`, the chosen token's logprob and the top-n of the raw
    logits, in one float64 tensor (exact for ids and float32 values) so one copy brings all back:
    [num_seqs, 2 + 2 * max_top_n] = id, chosen logprob, top logprobs, top ids."""
    packed = torch.zeros(
        token_ids.shape[0], 2 + 2 * max_top_n, dtype=torch.float64, device=logits.device
    )
    packed[:, 0] = token_ids
    logprobs = logits[rows].log_softmax(dim=-1)  # [num_rows, vocab]
    packed[rows, 1] = logprobs.gather(1, token_ids[rows, None]).squeeze(1).double()
    top_logprobs, top_ids = logprobs.topk(max_top_n, dim=-1)
    packed[rows, 2 : 2 + max_top_n] = top_logprobs.double()
    packed[rows, 2 + max_top_n :] = top_ids.double()
    return packed
