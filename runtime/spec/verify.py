"""Verify a batch of drafts against the target model's logits, k drafts per row (k may differ).

Logits are flat: row i owns k_i + 1 consecutive positions, position j scoring the token after
draft j - 1 (position 0: after the row's last accepted token). Greedy rows accept the longest
prefix where draft == argmax, then append the argmax at the first mismatch (or the bonus token
after the last draft): exactly plain greedy decoding's tokens. Random rows use rejection
sampling (Leviathan et al. 2023; Chen et al. 2023) so that every appended token is distributed
exactly as the target's p: draft d with draft probability q(d) is accepted with probability
min(1, p(d) / q(d)); on reject the token is drawn from norm(max(0, p - q)). A prompt-lookup
draft is a point mass (q = one-hot d): accept with p(d), on reject draw from p without d.

The target p is the sampler's own (runtime.sampling.ops: temperature, top-k, top-p, min-p), so
speculation changes how fast tokens come, never which distribution they come from. Penalties
depend on the tokens before each position; rows with penalties must get k = 0 (the policy's
caller decides), as must rows whose grammar is not advanced per draft position.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.row_max import argmax
from runtime.sampling.ops import draw_from_probs, prepare_candidates
from runtime.sampling.plan import filter_settings, param_rows
from scheduler.request import SamplingParams


@dataclass
class VerifyRow:
    """One row's facts: its request, settings, drafts and (draft model only) draft probs."""

    request_id: str
    params: SamplingParams
    draft_token_ids: Sequence[int]  # k ids
    draft_probs: torch.Tensor | None = None  # [k, vocab] q of a draft model; None: point mass


@dataclass
class VerifyResult:
    num_accepted: list[int]  # per row: drafts accepted (0..k)
    token_ids: list[list[int]]  # per row: the tokens to append, num_accepted + 1 of them


class RejectionSampler:
    """Batched verification; owns one generator per seeded request, as the Sampler does, or
    draws from the engine's Sampler's (`generators`), so that a seeded request's draws form
    one stream whether a step verifies drafts or samples plainly."""

    def __init__(self, vocab_size: int, seed: int | None = None, generators=None):
        self.vocab_size = vocab_size
        self.generators = generators  # a runtime.sampling.Sampler, or None: own generators
        self.seed = seed  # seeds the shared generator of unseeded requests; None = random
        self._request_generators: dict[str, torch.Generator] = {}
        self._shared: torch.Generator | None = None

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def verify(self, logits: torch.Tensor, rows: Sequence[VerifyRow]) -> VerifyResult:
        """logits: [sum(k_i + 1), >= vocab] -> per row the accepted count and the new tokens."""
        counts = [len(row.draft_token_ids) + 1 for row in rows]
        assert logits.dim() == 2 and logits.shape[0] == sum(counts), (logits.shape, counts)
        logits = logits[:, : self.vocab_size].float()
        greedy_ids = argmax(logits).tolist()  # [num_positions], right for greedy rows
        random_rows = [i for i, row in enumerate(rows) if row.params.temperature > 0]
        probs = self.target_probs(logits, rows, counts, random_rows)
        result = VerifyResult([], [])
        offset = 0
        for i, row in enumerate(rows):
            span = slice(offset, offset + counts[i])
            if row.params.temperature > 0:
                accepted, tokens = self._rejection_sample(probs[i], row)
            else:
                accepted, tokens = accept_greedy(row.draft_token_ids, greedy_ids[span])
            result.num_accepted.append(accepted)
            result.token_ids.append(tokens)
            offset += counts[i]
        return result

    def target_probs(self, logits, rows, counts, random_rows) -> dict[int, torch.Tensor]:
        """Per random row its target distributions [k + 1, vocab], normalised, from the
        sampler's own temperature / top-k / top-p / min-p operations."""
        if not random_rows:
            return {}
        starts = [0, *itertools.accumulate(counts)]
        positions = torch.cat(
            [torch.arange(starts[i], starts[i + 1], device=logits.device) for i in random_rows]
        )
        expanded = [rows[i].params for i in random_rows for _ in range(counts[i])]
        params = param_rows(expanded).to(logits.device)
        settings = filter_settings(params, self.vocab_size)
        # the sampler's plan filters only where some row asks (a full-vocab sort otherwise)
        settings.is_filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in expanded)
        settings.all_cut_by_top_k &= settings.is_filtered
        candidates = prepare_candidates(logits[positions], settings)
        dense = candidates.probs
        if candidates.token_ids is not None:
            dense = torch.zeros(len(expanded), self.vocab_size, device=logits.device).scatter_(
                1, candidates.token_ids, candidates.probs
            )
        dense = dense / dense.sum(dim=-1, keepdim=True)  # [num_random_positions, vocab]
        split = dense.split([counts[i] for i in random_rows])
        return dict(zip(random_rows, split))

    def _rejection_sample(self, p: torch.Tensor, row: VerifyRow) -> tuple[int, list[int]]:
        """p: [k + 1, vocab] target distributions of one row. Draws k + 1 uniforms: one per
        draft to accept it, the last to draw the final token (the inverse CDF, as the sampler
        draws)."""
        drafts = torch.tensor(list(row.draft_token_ids), dtype=torch.long, device=p.device)
        k = drafts.shape[0]
        generator = self._generator(row, p.device)
        uniforms = torch.rand(k + 1, generator=generator, device=p.device)
        target_of_draft = p[:k].gather(1, drafts[:, None]).squeeze(1)  # [k]
        if row.draft_probs is None:  # prompt lookup: q is a point mass, q(d) = 1
            accepted = uniforms[:k] < target_of_draft
        else:
            draft_of_draft = row.draft_probs.gather(1, drafts[:, None]).squeeze(1)  # [k]
            accepted = uniforms[:k] * draft_of_draft < target_of_draft  # u < min(1, p / q)
        num_accepted = k if bool(accepted.all()) else int((~accepted).int().argmax())
        last_probs = p[k] if num_accepted == k else self._residual(p, row, drafts, num_accepted)
        last = int(draw_from_probs(last_probs[None], uniforms[k:])[0])
        return num_accepted, [*drafts[:num_accepted].tolist(), last]

    def _residual(self, p, row: VerifyRow, drafts, position: int) -> torch.Tensor:
        """norm(max(0, p - q)) at a rejected position, unnormalised; [vocab]."""
        if row.draft_probs is None:  # q = one-hot(d): p without d
            return p[position].index_fill(0, drafts[position : position + 1], 0.0)
        residual = (p[position] - row.draft_probs[position]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q: a reject is then impossible; stay finite
            return p[position]
        return residual

    def _generator(self, row: VerifyRow, device: torch.device) -> torch.Generator:
        """A seeded request's own generator (same seed, same tokens whatever the batch)."""
        if self.generators is not None:
            if row.params.seed is None:
                return self.generators.shared_generator(device)
            return self.generators.request_generator(row.request_id, row.params.seed, device)
        if row.params.seed is None:
            if self._shared is None:
                self._shared = torch.Generator(device=device)
                if self.seed is None:
                    self._shared.seed()
                else:
                    self._shared.manual_seed(self.seed)
            return self._shared
        generator = self._request_generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(row.params.seed)
            self._request_generators[row.request_id] = generator
        return generator


def accept_greedy(draft_ids: Sequence[int], target_ids: Sequence[int]) -> tuple[int, list[int]]:
    """target_ids: the argmax at each of the k + 1 positions. -> accepted count, new tokens."""
    num_accepted = 0
    for draft, target in zip(draft_ids, target_ids):
        if draft != target:
            break
        num_accepted += 1
    return num_accepted, list(target_ids[: num_accepted + 1])
