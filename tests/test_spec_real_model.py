"""Prompt-lookup speculation on the real SmolLM2: greedy tokens identical with speculation on and
off, at batch 1 and in a mixed batch, with real drafts accepted and rejected; in float32 with
the weights dequantized, and on the Q4_1 file's own blocks in the engine's default dtype."""

from __future__ import annotations

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.spec.policy import FixedK
from scheduler.request import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PASSAGE = (
    "The printing press was invented by Johannes Gutenberg around 1440. It used movable metal "
    "type, oil-based ink and a wooden press adapted from wine presses. Within decades, printing "
    "spread to more than two hundred cities across Europe."
)


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine(
        EngineConfig(
            dtype="float32",
            quantization="none",
            num_kv_blocks=400,
            max_num_seqs=8,
            speculative="ngram",
        )
    )
    engine.speculator.policy = FixedK(5)
    return engine


def copy_prompt(engine: Engine, passage: str) -> list[int]:
    text = f"Text: {passage}\nThe same text again, word for word: {passage[:40]}"
    return engine.tokenizer.encode(text)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def generate(engine: Engine, prompts, params, speculate: bool) -> list[list[int]]:
    engine.scheduler.drafter = engine.speculator if speculate else None
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def test_greedy_identical_at_batch_1(engine):
    prompt = copy_prompt(engine, PASSAGE)
    plain = generate(engine, [prompt], greedy(90), speculate=False)
    before = engine.speculator.stats.num_accepted_tokens
    assert generate(engine, [prompt], greedy(90), speculate=True) == plain
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens - before > 20
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some rejected too


def test_greedy_identical_in_a_mixed_batch(engine):
    prompts = [
        copy_prompt(engine, PASSAGE),
        engine.tokenizer.encode("Write a short poem about the sea."),
        copy_prompt(engine, PASSAGE.upper()),
        engine.tokenizer.encode("List three colours: red, green,"),
    ]
    params = [greedy(40), greedy(24), greedy(33), greedy(17)]
    plain = generate(engine, prompts, params, speculate=False)
    assert generate(engine, prompts, params, speculate=True) == plain


@pytest.fixture(scope="module")
def gguf_engine() -> Engine:
    """SmolLM2's Q4_1 file on its own blocks, in the engine's default dtype (bfloat16 where the
    CPU runs it natively): rounding is coarse enough there that a verified token computed any
    other way than a plain decode's (attention as a prefill chunk, or 6 rows on the many-rows
    matmul where one row takes the integer kernel) flips a greedy near-tie."""
    engine = Engine(
        EngineConfig(
            model="smollm2-135m-instruct",  # the Q4_1 file
            num_kv_blocks=400,
            max_num_seqs=4,
            speculative="ngram",
        )
    )
    engine.speculator.policy = FixedK(5)
    return engine


def test_greedy_identical_on_quantized_weights(gguf_engine):
    story = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
    prompts = [gguf_engine.tokenizer.apply_chat_template(story), copy_prompt(gguf_engine, PASSAGE)]
    for prompt in prompts:
        plain = generate(gguf_engine, [prompt], greedy(96), speculate=False)
        assert generate(gguf_engine, [prompt], greedy(96), speculate=True) == plain
    assert gguf_engine.speculator.stats.num_accepted_tokens > 10
