"""The real GGUF files of the known models, loaded straight from the file, against transformers
loading the same file (float32): greedy ids equal under chunked prefill, a preemption and a
prefix-cache hit. The files are pulled once into the cache directory (`make models`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers_reference import transformers_model

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models.catalog import pull
from scheduler.request import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

QWEN = "qwen2.5-coder-0.5b-instruct"
PROMPT_LENS = [250, 400, 650]  # 60 blocks of 16 cannot hold all three: one is preempted
NUM_NEW = 8
README = Path(__file__).resolve().parents[1] / "README.md"


def greedy(max_tokens=NUM_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def transformers_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers_model(path)
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def qwen() -> Engine:
    pull(QWEN)
    return Engine(
        EngineConfig(
            model=QWEN,
            dtype="float32",
            quantization="none",
            num_kv_blocks=60,
            max_batch_tokens=128,
            max_num_seqs=4,
        )
    )


@pytest.fixture(scope="module")
def qwen_prompts(qwen) -> list[list[int]]:
    chat = qwen.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}]
    )
    text = qwen.tokenizer.encode(README.read_text(), add_special_tokens=False)
    assert len(text) > sum(PROMPT_LENS)
    starts = [0, *itertools.accumulate(PROMPT_LENS)]  # disjoint: no prefix shared
    return [chat + text[start : start + n - len(chat)] for start, n in zip(starts, PROMPT_LENS)]


@pytest.fixture(scope="module")
def qwen_expected(qwen, qwen_prompts) -> list[list[int]]:
    return transformers_greedy(qwen.source.path, qwen_prompts)


def test_qwen_config_comes_from_the_file(qwen):
    config = qwen.runner.model_config
    assert config.architecture == "Qwen2ForCausalLM" and config.qkv_bias
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (24, 14, 2)
    assert not config.tie_word_embeddings and config.rope_theta == 1_000_000.0
    assert 151645 in qwen.eos_token_ids  # <|im_end|>


def test_qwen_greedy_equals_transformers_chunked_and_preempted(qwen, qwen_prompts, qwen_expected):
    outputs = [r.output_token_ids for r in qwen.generate(qwen_prompts, greedy())]
    assert max(PROMPT_LENS) > qwen.config.max_batch_tokens  # chunked prefill
    assert sum(qwen.scheduler.num_preemptions.values()) > 0
    assert outputs == qwen_expected


def test_qwen_prefix_cache_hit_gives_the_same_ids(qwen, qwen_prompts, qwen_expected):
    first = qwen.generate([qwen_prompts[1]], greedy())[0]
    again = qwen.generate([qwen_prompts[1]], greedy())[0]
    assert again.num_cached_prefix_tokens >= 192
    assert first.output_token_ids == again.output_token_ids == qwen_expected[1]
