"""Gemma 3 270M (base, Q4_K_M) loaded straight from its GGUF against transformers loading the
same file (float32): prompts past 1,000 tokens, so that the 512-token window of five layers in
six matters, greedy ids equal under chunked prefill, a preemption mid-window and a prefix-cache
hit. Its own module: one real model in memory at a time."""

from __future__ import annotations

import itertools

import pytest
from test_gguf_models import NUM_NEW, README, greedy, transformers_greedy

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models.catalog import pull

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GEMMA = "gemma-3-270m"
PROMPT_LENS = [1100, 1300]  # 120 blocks of 16 cannot hold both: one is preempted


@pytest.fixture(scope="module")
def gemma() -> Engine:
    pull(GEMMA)
    return Engine(
        EngineConfig(
            model=GEMMA,
            dtype="float32",
            quantization="none",
            num_kv_blocks=120,
            max_batch_tokens=256,
            max_num_seqs=4,
        )
    )


@pytest.fixture(scope="module")
def gemma_prompts(gemma) -> list[list[int]]:
    bos = gemma.tokenizer.hf_tokenizer.bos_token_id
    text = gemma.tokenizer.encode(README.read_text(), add_special_tokens=False)
    assert len(text) > sum(PROMPT_LENS)
    starts = [0, *itertools.accumulate(PROMPT_LENS)]  # disjoint: no prefix shared
    return [[bos, *text[start : start + n - 1]] for start, n in zip(starts, PROMPT_LENS)]


@pytest.fixture(scope="module")
def gemma_expected(gemma, gemma_prompts) -> list[list[int]]:
    return transformers_greedy(gemma.source.path, gemma_prompts)


def test_gemma_config_comes_from_the_file(gemma):
    config = gemma.runner.model_config
    assert config.architecture == "Gemma3ForCausalLM" and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3  # layers 6, 12, 18 of 18
    assert config.tie_word_embeddings and config.qk_norm
    assert not gemma.tokenizer.has_chat_template  # the base model


def test_gemma_greedy_equals_transformers_chunked_and_preempted(
    gemma, gemma_prompts, gemma_expected
):
    outputs = [r.output_token_ids for r in gemma.generate(gemma_prompts, greedy())]
    assert sum(gemma.scheduler.num_preemptions.values()) > 0
    assert outputs == gemma_expected
    assert all(len(ids) == NUM_NEW for ids in outputs)


def test_gemma_prefix_cache_hit_gives_the_same_ids(gemma, gemma_prompts, gemma_expected):
    first = gemma.generate([gemma_prompts[0]], greedy())[0]
    again = gemma.generate([gemma_prompts[0]], greedy())[0]
    assert again.num_cached_prefix_tokens >= 1024
    assert first.output_token_ids == again.output_token_ids == gemma_expected[0]
