"""Mixed-step CUDA graphs without a GPU. A mixed graph captures the padded static-buffer forward
of runtime.step.cuda_graphs.MixedGraphs; uncaptured, `run` performs that same forward eagerly. Here it
runs on CPU with the Triton kernels interpreted (the GPU code path) against the normal eager
forward of the same step: the same hidden states and greedy tokens, no write into the KV cache
outside the step's slots, the right bucket, and eager fallback for what fits no bucket.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models.attention import ForwardContext
from runtime.step.cuda_graphs import DecodeGraphs, MixedGraphs, token_buckets
from runtime.step.inputs import StepInputs, device_step, prepare_host_step
from runtime.step.model_runner import ModelRunner
from scheduler.output import SchedulerOutput, new_row
from scheduler.request import Request, SamplingParams

MAX_SEQS = 6


def use_triton_kernels(runner: ModelRunner) -> None:
    """The GPU code path on CPU: Triton kernels (interpreted) for attention, norms, RoPE and
    the KV store; no CPU planning, no native CPU decode."""
    from kernels.dispatch import _triton_kernels

    kernels = _triton_kernels()
    assert kernels is not None, "triton is needed for the GPU code path"
    runner.backend.use_triton, runner.backend.kernels = True, kernels
    runner.backend.native = None
    for module in runner.model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


def attach_graphs(runner: ModelRunner, max_tokens: int, max_seqs: int) -> MixedGraphs:
    width = runner.input_batch.device_block_table.shape[1]
    return MixedGraphs(runner.model, runner.kv_cache, max_tokens, max_seqs, width)


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=MAX_SEQS,
        enforce_eager=True,  # on a GPU: no captured graphs of its own
    )
    runner = ModelRunner(config, Path(tiny_model_dir))
    use_triton_kernels(runner)
    torch.manual_seed(0)
    runner.kv_cache.gpu.normal_()  # random keys and values stand for every cached context
    return runner


@pytest.fixture
def graphs(runner) -> MixedGraphs:
    graphs = attach_graphs(runner, 2048, MAX_SEQS)
    s = graphs.static  # stale contents from earlier steps must not matter: poison them
    s.slot_mapping.copy_(torch.arange(s.slot_mapping.numel()))  # real slots of the cache
    s.block_tables.random_(0, runner.num_gpu_blocks)
    s.seq_lens.fill_(40)
    return graphs


class Blocks:
    """Hands out distinct KV blocks to the requests of one step."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.next = block_size, 0

    def take(self, num_tokens: int) -> list[int]:
        num = -(-num_tokens // self.block_size)
        self.next += num
        return list(range(self.next - num, self.next))


def make_step(runner, shape: list[tuple[int, int]]) -> list[tuple[Request, int]]:
    """shape: (cached tokens, tokens this step) per sequence; one token after a cache of n
    tokens is a decode (n prompt tokens and one output token), more is a prompt chunk."""
    blocks, scheduled = Blocks(runner.block_size), []
    for i, (cached, num_new) in enumerate(shape):
        decoding = num_new == 1 and cached > 0
        prompt = [1 + (7 * i + j) % 500 for j in range(cached + (0 if decoding else num_new))]
        request = Request(f"r{i}-{cached}-{num_new}", prompt)
        if decoding:
            request.output_token_ids = [3 + i]
        request.num_computed_tokens = cached
        request.block_ids = blocks.take(cached + num_new + 1)
        scheduled.append((request, num_new))
    return scheduled


def prepare(runner, scheduled) -> StepInputs:
    runner.input_batch.apply(SchedulerOutput(new_rows=[new_row(r) for r, _ in scheduled]))
    host = prepare_host_step(runner.input_batch, scheduled, runner.block_size)
    inputs = device_step(runner.input_batch, host, runner.staging.stage(host.tensors))
    runner.backend.prepare(inputs.attn)
    return inputs


def eager_forward(runner, inputs: StepInputs) -> torch.Tensor:
    ctx = ForwardContext(inputs.attn, runner.kv_cache.k_caches, runner.kv_cache.v_caches)
    return runner.model(inputs.input_ids, inputs.positions, ctx)


def slot_view(cache: torch.Tensor) -> torch.Tensor:
    """[2, layers, blocks, block_size, heads, dim] -> [2, layers, slots, heads * dim]"""
    return cache.flatten(2, 3).flatten(3)


def compare_paths(runner, graphs: MixedGraphs, shape) -> int:
    """Runs one step both ways from the same cache; returns the bucket it used."""
    scheduled = make_step(runner, shape)
    cache = runner.kv_cache.gpu
    before = cache.clone()
    try:
        inputs = prepare(runner, scheduled)
        num_tokens = inputs.input_ids.shape[0]
        assert graphs.can_run(inputs.attn, num_tokens)
        eager = eager_forward(runner, inputs)
        after_eager = cache.clone()
        cache.copy_(before)
        padded = graphs.run(inputs.input_ids, inputs.positions, inputs.attn)

        assert padded.shape == eager.shape
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
        logits = runner.model.compute_logits
        index = inputs.staged.sample_index
        assert torch.equal(logits(padded[index]).argmax(-1), logits(eager[index]).argmax(-1))
        # the step's slots hold its keys and values, every other slot is untouched
        real = torch.zeros(slot_view(cache).shape[2], dtype=torch.bool, device=cache.device)
        real[inputs.attn.slot_mapping] = True
        assert torch.equal(slot_view(cache)[:, :, ~real], slot_view(before)[:, :, ~real])
        torch.testing.assert_close(
            slot_view(cache)[:, :, real], slot_view(after_eager)[:, :, real], rtol=1e-4, atol=1e-4
        )
        return graphs.bucket_for(num_tokens)
    finally:
        cache.copy_(before)
        release(runner, scheduled)


def release(runner, scheduled) -> None:
    for request, _ in scheduled:
        runner.input_batch.remove(request.request_id)


def test_token_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]


@pytest.mark.parametrize(
    ("shape", "bucket"),
    [
        # decodes (short and long contexts) and a prompt chunk after 20 cached tokens: 15 tokens
        ([(5, 1), (40, 1), (100, 1), (20, 12)], 16),
        # several first chunks of prompts, no decode
        ([(0, 5), (0, 9), (0, 3)], 32),
        # exactly a bucket: two decodes and two chunks, 32 tokens
        ([(17, 1), (60, 1), (0, 20), (33, 10)], 32),
        # one token over: 33 tokens take the next bucket
        ([(17, 1), (60, 1), (0, 21), (33, 10)], 64),
    ],
    ids=["decodes+cached-chunk", "prefills", "at-bucket", "bucket+1"],
)
def test_padded_forward_equals_eager(runner, graphs, shape, bucket):
    assert compare_paths(runner, graphs, shape) == bucket


def test_steps_that_fit_no_mixed_graph_are_left_to_the_eager_path(runner):
    small = attach_graphs(runner, 32, max_seqs=3)
    assert small.buckets == [16, 32] and small.max_seqs == 3
    cases = {
        "more sequences than max_seqs": [(5, 1), (6, 1), (7, 1), (0, 4)],
        "more tokens than the largest bucket": [(5, 1), (0, 32)],
        "decode only (the decode graphs' work)": [(5, 1), (9, 1)],
    }
    cases["fits: the control"] = [(5, 1), (0, 4)]
    for why, shape in cases.items():
        scheduled = make_step(runner, shape)
        inputs = prepare(runner, scheduled)
        fits = small.can_run(inputs.attn, inputs.input_ids.shape[0])
        release(runner, scheduled)
        assert fits == why.startswith("fits"), why


def test_decodes_beside_a_long_context_are_left_to_the_eager_path(runner, monkeypatch):
    """The eager decode kernel splits a long context across the GPU; inside a mixed graph the
    prefill kernel would read it in one program per kv head."""
    from runtime.step import cuda_graphs

    small = attach_graphs(runner, 32, max_seqs=3)
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHED_CONTEXT", 64)
    cases = {
        "a decode at 100 tokens beside a chunk": ([(100, 1), (0, 4)], False),
        "a chunk after 100 cached tokens, no decode": ([(100, 4)], True),
        "short decodes beside a chunk": ([(5, 1), (20, 1), (0, 4)], True),
    }
    for why, (shape, expected) in cases.items():
        scheduled = make_step(runner, shape)
        inputs = prepare(runner, scheduled)
        fits = small.can_run(inputs.attn, inputs.input_ids.shape[0])
        release(runner, scheduled)
        assert fits == expected, why


def test_engine_outputs_equal_with_padded_graph_paths(tiny_model_dir):
    """Whole runs with chunked prefill: the padded mixed and decode paths (as graphs would
    replay them) give the eager run's greedy tokens, and both are taken."""
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=3,
        max_batch_tokens=16,
        enable_prefix_caching=False,  # the second run computes everything again
        enforce_eager=True,  # on a GPU: the first run is the eager one
    )
    engine = Engine(config)
    runner = engine.runner
    use_triton_kernels(runner)
    prompts = [[5, 6, 7, 8] * k for k in (1, 6, 2, 3)]  # chunks of 16 tokens at most
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager = [r.output_token_ids for r in engine.generate(prompts, params)]

    width = runner.input_batch.device_block_table.shape[1]
    runner.mixed_graphs = attach_graphs(runner, config.max_batch_tokens, config.max_num_seqs)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, 3, width)
    used = {"mixed": 0, "decode": 0}
    for name, graphs in (("mixed", runner.mixed_graphs), ("decode", runner.decode_graphs)):
        graphs.run = counted(graphs.run, used, name)
    padded = [r.output_token_ids for r in engine.generate(prompts, params)]
    assert padded == eager
    assert used["mixed"] >= 2 and used["decode"] >= 2, used


def counted(run, used: dict[str, int], name: str):
    def counting(*args):
        used[name] += 1
        return run(*args)

    return counting
