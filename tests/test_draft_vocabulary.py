"""The draft model's vocabulary subset (runtime/spec/draft_vocabulary.py): its greedy token is
the best logit among the frequent ids and the seen ones, column for column what the whole head's
product gives; it stays off where it cannot help."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from runtime.models.layers import CausalLM
from runtime.models.quant import QuantizedLinear, random_blocks
from runtime.spec.draft_vocabulary import DraftVocabulary

Q = gguf.GGMLQuantizationType


def head(vocab: int = 300, hidden: int = 64, seed: int = 0) -> QuantizedLinear:
    blocks = random_blocks(Q.Q8_0, vocab, hidden, np.random.default_rng(seed))
    return QuantizedLinear(torch.from_numpy(blocks.copy()), Q.Q8_0, vocab, hidden)


def masked_argmax(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]
    return masked.argmax(dim=-1)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_the_greedy_token_is_the_best_among_frequent_and_seen_ids(rows):
    weight = head()
    vocabulary = DraftVocabulary(weight, 128)
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    logits = weight.matmul(hidden)  # [rows, 300]
    best = logits.argmax(dim=-1)
    for seen in (set(), {200, 299}, set(best.tolist()) | {130}):
        allowed = list(range(128)) + sorted(seen)
        got = vocabulary.greedy(hidden, {t for t in seen if t >= 128})
        assert torch.equal(got, masked_argmax(logits, allowed)), seen
    assert torch.equal(vocabulary.greedy(hidden, set(best.tolist()) | {130}), best)


def test_the_seen_rows_are_gathered_again_only_when_the_set_changes():
    vocabulary = DraftVocabulary(head(), 128)
    hidden = torch.randn(2, 64)
    vocabulary.greedy(hidden, {140, 150})
    first = vocabulary._seen
    vocabulary.greedy(hidden, {150, 140})
    assert vocabulary._seen is first
    vocabulary.greedy(hidden, {140, 150, 160})
    assert vocabulary._seen is not first and vocabulary._seen.out_features == 3
    assert vocabulary.rare_ids([3, 127, 128, 299]) == {128, 299}


class Heads:
    """A model's two places for the vocabulary's rows, with CausalLM's choice between them."""

    output_projection = CausalLM.output_projection

    def __init__(self, lm_head, embed_tokens):
        self.lm_head, self.embed_tokens = lm_head, embed_tokens


def test_no_subset_where_it_cannot_help():
    weight = head()
    quantized = Heads(lm_head=weight, embed_tokens=None)
    assert DraftVocabulary.of(quantized, 128) is not None
    tied = Heads(lm_head=None, embed_tokens=weight)
    assert DraftVocabulary.of(tied, 128) is not None
    for size in (0, 300, 400):  # off, or no smaller than the vocabulary
        assert DraftVocabulary.of(quantized, size) is None
    floats = Heads(lm_head=nn.Linear(64, 300, bias=False), embed_tokens=None)
    assert DraftVocabulary.of(floats, 128) is None
