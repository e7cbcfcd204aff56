"""Grammar masks against a brute-force check on a tiny vocabulary: after any valid prefix, the
tokens a mask allows are exactly those that keep the text a prefix of some answer the schema
accepts (the end-of-sequence token exactly when the text is a whole answer), padded logits
columns are never allowed, and only constrained rows of a mixed batch are touched."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import xgrammar as xgr
from test_sampling_support import plan_for

from runtime.sampling.sampler import Sampler
from runtime.structured.compiler import GrammarCompiler
from runtime.structured.masks import MaskBuilder
from runtime.structured.matchers import GrammarMatchers
from scheduler.request import GrammarSpec, Request, SamplingParams

VOCAB = [
    "{",
    "}",
    '"',
    "a",
    "b",
    ":",
    " ",
    ",",
    "true",
    "false",
    "1",
    "2",
    "tr",
    "ue",
    '"a"',
    ": ",
    ', "',
    'b": ',
    "<eos>",
    "x",
    '{"',
    "3",
    "fal",
    "se}",
    "t",
    "r",
    "u",
    "e",
    "f",
    "l",
    "s",
]  # fmt: skip (every character of the answers: any valid prefix can go on)
EOS = VOCAB.index("<eos>")
NUM_PADDING = 40  # the model's logits are wider than the tokenizer's vocabulary
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# every answer the schema accepts, written as the grammar writes JSON (", " and ": ")
ANSWERS = {json.dumps({"a": a, "b": b}) for a, b in itertools.product([True, False], [1, 2])}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    info = xgr.TokenizerInfo(
        VOCAB,
        xgr.VocabType.RAW,
        vocab_size=len(VOCAB) + NUM_PADDING,
        stop_token_ids=[EOS],
    )
    return GrammarCompiler(info)


def brute_force_allowed(prefix: str) -> set[int]:
    allowed = {
        t for t, text in enumerate(VOCAB)
        if t != EOS and any(answer.startswith(prefix + text) for answer in ANSWERS)
    }  # fmt: skip
    return allowed | ({EOS} if prefix in ANSWERS else set())


def masked_logits(builder: MaskBuilder, requests: list[Request], logits: torch.Tensor):
    pending = builder.start([r.request_id for r in requests])
    return pending.result().apply(logits.clone())


@pytest.mark.parametrize("seed", range(8))
def test_masks_allow_exactly_the_tokens_that_keep_a_valid_prefix(compiler, seed):
    prepared = compiler.prepare(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    matchers = GrammarMatchers()
    matchers.add("r", prepared.compiled)
    builder = MaskBuilder(matchers, compiler.vocab_size, torch.device("cpu"))
    request = Request("r", [0])
    rng = random.Random(seed)
    prefix = ""
    while True:
        logits = torch.randn(1, compiler.vocab_size)
        allowed = set(
            masked_logits(builder, [request], logits)[0].isfinite().nonzero().flatten().tolist()
        )
        assert allowed == brute_force_allowed(prefix), prefix
        assert allowed, prefix
        token = rng.choice(sorted(allowed))
        matchers.accept("r", token)
        if token == EOS:
            break
        prefix += VOCAB[token]
    assert prefix in ANSWERS
    assert matchers.get("r").is_terminated()


def test_only_constrained_rows_are_masked_and_sampled_within_their_grammar(compiler):
    prepared = compiler.prepare(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    matchers = GrammarMatchers()
    requests = [Request(f"r{i}", [0]) for i in range(4)]
    for i in (1, 3):
        matchers.add(f"r{i}", prepared.compiled)
    builder = MaskBuilder(matchers, compiler.vocab_size, torch.device("cpu"))
    logits = torch.randn(4, compiler.vocab_size)
    masked = masked_logits(builder, requests, logits)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    first = {VOCAB.index("{"), VOCAB.index('{"')}
    for row in (1, 3):
        assert set(masked[row].isfinite().nonzero().flatten().tolist()) == first
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    for r, p in zip(requests, params):
        r.sampling_params = p
    plan, indices, host_params = plan_for(requests)
    mask = builder.start([r.request_id for r in requests]).result()
    sampler = Sampler(compiler.vocab_size)
    for _ in range(5):
        ids = sampler.sample_on_device(logits.clone(), plan, host_params, indices, None, mask)
        assert {int(ids[1]), int(ids[3])} <= first


def test_no_constrained_request_means_no_mask_work(compiler):
    builder = MaskBuilder(GrammarMatchers(), compiler.vocab_size, torch.device("cpu"))
    assert builder.start(["x"]) is None


def test_mask_warm_up_runs_both_apply_paths_and_allows_everything(compiler, monkeypatch):
    builder = MaskBuilder(GrammarMatchers(), compiler.vocab_size, torch.device("cpu"))
    applied = []
    real_apply = xgr.apply_token_bitmask_inplace
    monkeypatch.setattr(
        xgr,
        "apply_token_bitmask_inplace",
        lambda logits, bitmask: applied.append(logits.shape) or real_apply(logits, bitmask),
    )
    builder.warm_up(compiler.vocab_size)
    assert applied == [(2, compiler.vocab_size), (1, compiler.vocab_size)]


def test_padding_columns_are_never_allowed(compiler):
    prepared = compiler.prepare(GrammarSpec("json_object"))
    matchers = GrammarMatchers()
    matchers.add("r", prepared.compiled)
    builder = MaskBuilder(matchers, compiler.vocab_size, torch.device("cpu"))
    logits = torch.zeros(1, compiler.vocab_size)
    masked = masked_logits(builder, [Request("r", [0])], logits)
    assert not masked[0, len(VOCAB) :].isfinite().any()


def test_compiled_grammars_are_cached_by_spec_and_bounded():
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiler = GrammarCompiler(info, max_entries=2)
    specs = [GrammarSpec("json_schema", json.dumps({"enum": [i]})) for i in range(3)]
    first = compiler.prepare(specs[0])
    again = compiler.prepare(specs[0])
    assert not first.cache_hit and again.cache_hit and again.compiled is first.compiled
    assert again.compile_s == 0.0 and first.compile_s > 0
    compiler.prepare(specs[1])
    compiler.prepare(specs[2])
    assert compiler.num_cached == 2
    assert not compiler.prepare(specs[0]).cache_hit  # the least recently used went first
