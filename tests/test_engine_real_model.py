"""The engine on the real SmolLM2 against HF transformers (something nobody here wrote)."""

from __future__ import annotations

import pytest
import torch
from transformers_reference import transformers_model

from runtime.config import EngineConfig
from runtime.engine import Engine
from scheduler.request import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPT_LENS = [5, 9, 17, 33, 64, 100, 150, 200, 256, 300, 400, 500, 640, 777, 900, 1000]
NUM_NEW = 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        EngineConfig(
            dtype="float32",
            quantization="none",
            num_kv_blocks=1200,
            max_batch_tokens=512,
            max_num_seqs=16,
        )
    )


@pytest.fixture(scope="module")
def hf_model(engine):
    return transformers_model(engine.source.path)  # the GGUF file the engine loaded


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    text_ids = engine.tokenizer.encode(
        "The history of the printing press begins in the fifteenth century."
    )
    out = []
    for n in PROMPT_LENS:
        random_ids = torch.randint(200, 40000, (n,), generator=gen).tolist()
        out.append((text_ids + random_ids)[:n])
    return out


def greedy(max_tokens=NUM_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [
            hf_model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def test_greedy_equals_transformers_in_one_crowded_chunked_batch(engine, prompts, hf_greedy):
    requests = engine.generate(prompts, greedy())
    assert max(r.num_prompt_tokens for r in requests) > engine.config.max_batch_tokens  # chunked
    mismatches = [i for i, r in enumerate(requests) if r.output_token_ids != hf_greedy[i]]
    assert not mismatches, (
        f"prompts {[PROMPT_LENS[i] for i in mismatches]} differ from transformers"
    )


def test_logits_match_transformers(engine, hf_model, prompts):
    from runtime.step.model_runner import ModelRunner

    runner: ModelRunner = engine.runner
    captured = []
    original, fused = runner.model.compute_logits, runner.model.greedy_projection
    runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
    runner.model.greedy_projection = None  # greedy steps compute their logits here
    try:
        requests = engine.generate([prompts[1], prompts[6]], greedy(4))
    finally:
        runner.model.compute_logits, runner.model.greedy_projection = original, fused
    for slot, (prompt, request) in enumerate(zip([prompts[1], prompts[6]], requests)):
        ids = torch.tensor([prompt + request.output_token_ids[:-1]])
        with torch.no_grad():
            hf_logits = hf_model(ids).logits[0, len(prompt) - 1 :]
        ours = torch.stack([step[slot] for step in captured])
        assert torch.allclose(ours, hf_logits, atol=1e-3, rtol=0), (ours - hf_logits).abs().max()


def test_same_output_alone_in_a_batch_and_with_prefix_hits(engine, prompts, hf_greedy):
    alone = engine.generate([prompts[7]], greedy())[0].output_token_ids
    hits_before = engine.block_manager.num_prefix_hits
    again = engine.generate([prompts[7]], greedy())[0]
    assert engine.block_manager.num_prefix_hits > hits_before
    assert again.num_cached_prefix_tokens >= 192
    assert alone == again.output_token_ids == hf_greedy[7]


def run_under_pressure(engine_config: EngineConfig, prompts, params):
    engine = Engine(engine_config)
    requests = engine.generate(prompts, params)
    assert engine.block_manager.num_free_gpu_blocks == engine.block_manager.num_gpu_blocks
    return [r.output_token_ids for r in requests], engine.scheduler.num_preemptions


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_outputs_identical(engine, prompts, mode):
    batch = prompts[:8]
    params = [
        greedy(24)
        if i % 2
        else SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(len(batch))
    ]
    ample, _ = run_under_pressure(
        EngineConfig(dtype="float32", quantization="none", num_kv_blocks=400), batch, params
    )
    # 24 blocks of 16 tokens cannot hold these 8 requests at once: someone must be preempted
    tight, preemptions = run_under_pressure(
        EngineConfig(
            dtype="float32",
            quantization="none",
            num_kv_blocks=24,
            preemption_mode=mode,
            swap_space=0.5,
            enable_prefix_caching=False,
            async_scheduling="on",  # preempted while their next token is still on the device
        ),
        batch,
        params,
    )
    assert preemptions[mode] > 0
    assert tight == ample
