"""A CPU decode step's layers in one native call each (runtime/models/fused_decode.py) against the
same layers run module by module: the same numbers, bit for bit, and only where they fit."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models import cpu_kernels, fused_decode
from runtime.models.catalog import pull
from scheduler.request import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SMOLLM2, QWEN, GEMMA = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"
PROMPTS = [list(range(1000, 1020)), list(range(2000, 2007)), list(range(3000, 3033))]


def recording_engine(model: str, fused: bool, **settings) -> tuple[Engine, list]:
    """An engine whose model records every forward's hidden states (num_tokens, the tensor)."""
    engine = Engine(EngineConfig(model=model, num_kv_blocks=64, **settings))
    runner_model = engine.runner.model
    if not fused:
        runner_model.fused_layers = []
    seen, forward = [], runner_model.forward

    def recorded(input_ids, positions, ctx):
        hidden = forward(input_ids, positions, ctx)
        seen.append((ctx.attn.num_prefill_seqs, hidden.clone()))
        return hidden

    runner_model.forward = recorded
    return engine, seen


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    ("model", "dtype"),
    [(SMOLLM2, "auto"), (SMOLLM2, "float32"), (QWEN, "auto"), (GEMMA, "auto"), (GEMMA, "float32")],
)
def test_decode_steps_match_the_modules_bit_for_bit(model, dtype, fused_calls):
    pull(model)
    runs = {}
    for fused in (True, False):
        engine, seen = recording_engine(model, fused, dtype=dtype)
        requests = engine.generate(PROMPTS, greedy(12))
        runs[fused] = ([r.output_token_ids for r in requests], seen)
        if fused:  # every decode step ran its layers fused
            assert len(fused_calls) >= 11 * len(engine.runner.model.layers)
    assert runs[True][0] == runs[False][0]
    decode_steps = 0
    for (prefill, fused), (_, modules) in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(fused, modules)
        decode_steps += not prefill
    assert decode_steps >= 10


def test_a_full_batch_matches_the_modules_bit_for_bit(fused_calls):
    """Decode steps of more sequences than the few-rows kernel takes: the fused layers call the
    full batch's matmul (8-bit tiles on AVX-512 VNNI, else the one the modules take)."""
    many = [list(range(1000 + 50 * i, 1010 + 50 * i)) for i in range(cpu_kernels.DECODE_ROWS + 4)]
    runs = {}
    for fused in (True, False):
        engine, seen = recording_engine(QWEN, fused, max_num_seqs=len(many))
        requests = engine.generate(many, greedy(4))
        runs[fused] = ([r.output_token_ids for r in requests], seen)
    assert runs[True][0] == runs[False][0]
    widths = []
    for (prefill, fused), (_, modules) in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(fused, modules)
        widths += [] if prefill else [fused.shape[0]]
    assert widths and all(w == len(many) for w in widths)
    layers = len(engine.runner.model.layers)
    assert fused_calls == [len(many)] * layers * len(widths)


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """The number of tokens of every fused layer call."""
    calls, call = [], fused_decode.FusedLayer.__call__

    def counted(self, x, residual, ctx, matmul):
        calls.append(x.shape[0])
        return call(self, x, residual, ctx, matmul)

    monkeypatch.setattr(fused_decode.FusedLayer, "__call__", counted)
    return calls


def test_only_decode_steps_run_fused(fused_calls):
    engine = Engine(EngineConfig(model=SMOLLM2, num_kv_blocks=64))
    layers = len(engine.runner.model.layers)
    assert all(f is not None for f in engine.runner.model.fused_layers)
    engine.generate([PROMPTS[0]], greedy(1))  # a prompt step: no fused call
    assert fused_calls == []
    engine.generate(PROMPTS[:2], greedy(4))  # a prompt step, then 3 steps of 2 decodes
    assert fused_calls == [2] * 3 * layers


def test_layers_that_do_not_fit_keep_their_modules():
    dense = Engine(EngineConfig(model=SMOLLM2, quantization="none", num_kv_blocks=16))
    assert dense.runner.model.fused_layers == [None] * len(dense.runner.model.layers)
    pull(GEMMA)  # q/k norms, Gemma's norms and GELU MLP: fused as Gemma's, not as Llama's
    gemma = Engine(EngineConfig(model=GEMMA, num_kv_blocks=16))
    fused = gemma.runner.model.fused_layers
    assert len(fused) == len(gemma.runner.model.layers)
    assert all(isinstance(f, fused_decode.GemmaFusedLayer) for f in fused)
    dense_gemma = Engine(EngineConfig(model=GEMMA, quantization="none", num_kv_blocks=16))
    assert dense_gemma.runner.model.fused_layers == [None] * len(fused)
