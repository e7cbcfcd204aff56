"""Turn one row of logits per request into one token, following each request's SamplingParams.

Everything is vectorised over the batch in float32; per-request Python runs only to build small
index lists and to draw seeded noise. Random rows use the exponential race: with q ~ Exp(1) per
token, argmax(probs / q) is a sample from probs, so a seeded request consumes exactly one
vocab-sized draw of its own generator per sampled token, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.request import Request, SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-n (token_id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row of logits
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


CANDIDATE_STAGES = (256, 4096)  # top-k/top-p look at this many best tokens, then the whole vocab


def is_filtered(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        self.vocab_size = vocab_size
        self.seed = seed  # seeds the shared generator of unseeded requests; None = random
        self._request_generators: dict[str, torch.Generator] = {}
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_seqs, >= vocab] (any float dtype), row i belongs to requests[i]."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), logits.shape
        logits = logits[:, : self.vocab_size].float()  # [num_seqs, vocab]
        all_params = [request.sampling_params for request in requests]
        if all(p.is_greedy and not has_penalties(p) for p in all_params):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_processed(logits, requests)
        logprobs = compute_logprobs(logits, token_ids, all_params)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._request_generators.pop(request_id, None)

    def _sample_processed(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        logits = apply_penalties(logits, requests)
        token_ids = logits.argmax(dim=-1)  # [num_seqs], right for the greedy rows
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        filtered_rows = [i for i in random_rows if is_filtered(requests[i].sampling_params)]
        plain_rows = [i for i in random_rows if not is_filtered(requests[i].sampling_params)]
        for rows in (plain_rows, filtered_rows):
            if rows:
                group = [requests[i] for i in rows]
                candidates = prepare_candidates(logits[rows], [r.sampling_params for r in group])
                token_ids[torch.tensor(rows, device=logits.device)] = self._race(candidates, group)
        return token_ids

    def _race(self, candidates: Candidates, requests: list[Request]) -> torch.Tensor:
        """One token per row: the candidate with the largest prob / Exp(1) noise."""
        noise = self._draw_exponential_noise(requests, candidates.token_ids, candidates.probs)
        winners = (candidates.probs / noise).argmax(dim=-1)  # [num_rows]
        if candidates.token_ids is None:
            return winners
        return candidates.token_ids.gather(1, winners[:, None]).squeeze(1)

    def _draw_exponential_noise(
        self, requests: list[Request], candidate_ids: torch.Tensor | None, probs: torch.Tensor
    ) -> torch.Tensor:
        device = probs.device
        noise = torch.empty_like(probs)  # [num_rows, num_candidates]
        unseeded_rows = []
        for row, request in enumerate(requests):
            if request.sampling_params.seed is None:
                unseeded_rows.append(row)
                continue
            # A seeded request draws a whole vocab of noise per token, whatever its candidates.
            token_noise = torch.empty(self.vocab_size, device=device)
            token_noise.exponential_(generator=self._request_generator(request, device))
            noise[row] = token_noise if candidate_ids is None else token_noise[candidate_ids[row]]
        if unseeded_rows:
            shared = torch.empty(len(unseeded_rows), probs.shape[1], device=device)
            noise[unseeded_rows] = shared.exponential_(generator=self._shared_generator(device))
        # Exp(1) can return exactly 0; keep the division finite so excluded tokens stay at 0.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _request_generator(self, request: Request, device: torch.device) -> torch.Generator:
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(request.sampling_params.seed)
            self._request_generators[request.request_id] = generator
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


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only); a new tensor.

    Sparse: only the (row, token) pairs a request has seen are read and written.
    """
    rows = [i for i, r in enumerate(requests) if has_penalties(r.sampling_params)]
    if not rows:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    prompt_ids = flat_token_ids(rows, [requests[i].prompt_token_ids for i in rows], vocab_size)
    output_ids = flat_token_ids(rows, [requests[i].output_token_ids for i in rows], vocab_size)
    seen_ids, position = torch.cat([prompt_ids, output_ids]).to(device).unique(return_inverse=True)
    is_output = torch.arange(len(position), device=device) >= len(prompt_ids)
    output_counts = torch.zeros(len(seen_ids), device=device)
    output_counts.index_add_(0, position, is_output.float())  # [num_seen]

    all_params = [r.sampling_params for r in requests]
    seen_rows = seen_ids // vocab_size
    repetition = _per_row([p.repetition_penalty for p in all_params], device)[seen_rows]
    frequency = _per_row([p.frequency_penalty for p in all_params], device)[seen_rows]
    presence = _per_row([p.presence_penalty for p in all_params], device)[seen_rows]

    logits = logits.clone(memory_format=torch.contiguous_format)
    values = logits.view(-1)[seen_ids]  # [num_seen]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * output_counts - presence * (output_counts > 0).float()
    logits.view(-1)[seen_ids] = values
    return logits


def flat_token_ids(rows: list[int], token_lists: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Index of (row, token) in the flattened [num_seqs * vocab] logits, for every listed token."""
    flat = [row * vocab_size + token for row, tokens in zip(rows, token_lists) for token in tokens]
    return torch.tensor(flat, dtype=torch.long)


@dataclass
class Candidates:
    """The tokens each random row may still pick."""

    probs: torch.Tensor  # [num_rows, num_candidates], unnormalised; 0 = excluded
    token_ids: torch.Tensor | None  # [num_rows, num_candidates]; None: candidate j is token j


def prepare_candidates(logits: torch.Tensor, all_params: list[SamplingParams]) -> Candidates:
    """Temperature, top-k, top-p, then min-p, for rows that all sample at random."""
    device = logits.device
    probs = (logits / _column([p.temperature for p in all_params], device)).softmax(dim=-1)
    if any(is_filtered(p) for p in all_params):
        candidates = top_k_top_p_candidates(probs, all_params)
    else:
        candidates = Candidates(probs, None)
    min_ps = [p.min_p for p in all_params]
    if any(min_ps):
        candidates.probs = apply_min_p(candidates.probs, _column(min_ps, device))
    return candidates


def top_k_top_p_candidates(probs: torch.Tensor, all_params: list[SamplingParams]) -> Candidates:
    """Top-k then top-p over probs [num_rows, vocab]: first among the few most likely tokens,
    over the whole vocab only when some row's nucleus reaches past them."""
    vocab_size, device = probs.shape[1], probs.device
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in all_params]
    top_k_column = _column(top_ks, device)
    max_cutting_top_k = max((k for k in top_ks if k < vocab_size), default=1)
    top_p_column = _column([p.top_p for p in all_params], device)
    total_probs = probs.sum(dim=-1, keepdim=True)  # [num_rows, 1], about 1
    for num_candidates in CANDIDATE_STAGES:
        num_candidates = min(vocab_size, max(num_candidates, max_cutting_top_k))
        candidates, fits = keep_top_k_top_p(
            probs, top_k_column, top_p_column, total_probs, num_candidates
        )
        if fits:
            return candidates
    candidates, _ = keep_top_k_top_p(probs, top_k_column, top_p_column, total_probs, vocab_size)
    return candidates


def keep_top_k_top_p(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    total_probs: torch.Tensor,
    num_candidates: int,
) -> tuple[Candidates, bool]:
    """Candidates among the num_candidates best tokens; fits: no row needs more of them.

    top_ks, top_ps, total_probs: [num_rows, 1]; invariant: top_ks <= num_candidates or = vocab.
    """
    best_probs, best_ids = probs.topk(num_candidates, dim=-1)  # [num_rows, num_candidates]
    positions = torch.arange(num_candidates, device=probs.device)
    best_probs = best_probs * (positions < top_ks)
    cumulative = best_probs.cumsum(dim=-1)
    top_k_cuts = top_ks < probs.shape[1]
    mass = torch.where(top_k_cuts, cumulative[:, -1:], total_probs)  # left after top-k
    # Keep a token while the mass of the better ones is below top_p; the best always stays.
    in_top_p = (cumulative - best_probs < top_ps * mass) | (top_ps >= 1.0)
    nucleus_closed = cumulative[:, -1:] >= top_ps * mass
    fits = num_candidates == probs.shape[1] or bool((top_k_cuts | nucleus_closed).all())
    return Candidates(best_probs * in_top_p, best_ids), fits


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """probs: [num_rows, num_candidates]; min_ps: [num_rows, 1]. Drop tokens below min_p * best."""
    threshold = min_ps * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, all_params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Logprobs of the raw logits: the chosen token's and the top-n of each row that asks."""
    results: list[TokenLogprobs | None] = [None] * len(all_params)
    rows = [i for i, p in enumerate(all_params) if p.logprobs is not None]
    if not rows:
        return results
    logprobs = logits[rows].log_softmax(dim=-1)  # [num_rows, vocab]
    chosen_ids = token_ids[rows]  # [num_rows]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    chosen_ids = chosen_ids.tolist()
    max_top_n = max(all_params[i].logprobs for i in rows)
    top_logprobs, top_ids = logprobs.topk(max_top_n, dim=-1)
    top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        top_n = all_params[row].logprobs
        top = list(zip(top_ids[j][:top_n], top_logprobs[j][:top_n]))
        results[row] = TokenLogprobs(chosen_ids[j], chosen[j], top)
    return results


def _per_row(values: list[float] | list[int], device: torch.device) -> torch.Tensor:
    """[len(values)] float32, one value per row."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _column(values: list[float] | list[int], device: torch.device) -> torch.Tensor:
    """[len(values), 1] float32, to broadcast one value per row."""
    return _per_row(values, device)[:, None]
