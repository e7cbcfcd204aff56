"""A step moves data across at most once each way: one host-to-device copy of its staged inputs,
one device-to-host copy of the sampled ids (and logprobs), and nothing else that would make the
host wait for a GPU (item, tolist, bool of a tensor, nonzero, a tensor built from a list...).

Run on the GPU's code path: the attention, norm, RoPE and KV-store kernels are the Triton ones
(under Triton's interpreter without a GPU, see conftest), so no CPU-only planning runs, and every
tensor operation our runtime and kernel code issues between the two copies is recorded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.step import inputs as step_inputs
from runtime.step import model_runner
from scheduler.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
OUR_CODE = tuple(str(ROOT / part) + os.sep for part in ("runtime", "kernels", "scheduler"))
# tensor operations that, on a GPU, copy to or from the host or wait for the device
SYNCING = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
    "nonzero", "tensor", "as_tensor", "unique", "repeat_interleave", "masked_select", "copy_",
}  # fmt: skip


def _moves_device(name: str, args, kwargs) -> bool:
    if name != "to":
        return False
    values = list(args[1:]) + list((kwargs or {}).values())
    return any(isinstance(v, str | torch.device) for v in values)


class SyncRecorder(TorchFunctionMode):
    """Records syncing operations called from our code while `active`."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.active and (name in SYNCING or _moves_device(name, args, kwargs)):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(OUR_CODE):
                self.calls.append(f"{name} in {Path(caller.co_filename).name}:{caller.co_name}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    from kernels.dispatch import _triton_kernels

    engine = Engine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    )
    kernels = _triton_kernels()
    assert kernels is not None, "triton is needed for the GPU code path"
    backend = engine.runner.backend
    backend.use_triton, backend.kernels, backend.native = True, kernels, None  # as on a GPU
    for module in engine.runner.model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
    return engine


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
    ]


def count_step_copies(recorder: SyncRecorder, monkeypatch) -> dict[str, int]:
    """Counts the step's copies each way; the recorder is active between the two, and a second
    copy either way inside one step fails."""
    copies = {"to_device": 0, "to_host": 0}

    def counted_to_device(host, device_buffer):
        assert not recorder.active, "a second host-to-device copy in one step"
        copies["to_device"] += 1
        staging_copy(host, device_buffer)
        recorder.active = True  # the device's part of the step starts here

    def counted_to_host(device_tensor):
        assert recorder.active, "a device-to-host copy without a step's inputs staged"
        recorder.active = False
        copies["to_host"] += 1
        return host_copy(device_tensor)

    staging_copy, host_copy = step_inputs.copy_to_device, model_runner.copy_to_host
    monkeypatch.setattr(step_inputs, "copy_to_device", counted_to_device)
    monkeypatch.setattr(model_runner, "copy_to_host", counted_to_host)
    return copies


def run_checked(engine, recorder, copies, allowed=frozenset(), before_step=None) -> int:
    """Steps the engine to the end, checking each step: one copy each way and no syncing call
    but those `allowed`. Returns the number of steps."""
    num_steps = 0
    with recorder:
        while engine.has_unfinished():
            if before_step is not None:
                before_step(num_steps)
            engine.step()
            num_steps += 1
            assert copies == {"to_device": num_steps, "to_host": num_steps}
            assert set(recorder.calls) <= allowed, f"step {num_steps} syncs: {recorder.calls}"
    return num_steps


def test_one_copy_each_way_and_no_other_sync_per_step(engine, monkeypatch):
    recorder = SyncRecorder()
    copies = count_step_copies(recorder, monkeypatch)

    prompts = [[5, 6, 7, 8] * k for k in range(1, 5)]
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, mixed_params())]
    num_steps = run_checked(engine, recorder, copies)
    assert all(r.num_output_tokens == 6 for r in requests)
    assert requests[2].output_token_ids and num_steps >= 6


def test_async_scheduling_keeps_one_copy_each_way(engine, monkeypatch):
    """A step launched while the previous one is in flight reads that step's tokens on the
    device (no copy, no sync), and still makes one copy each way."""
    recorder = SyncRecorder()
    copies = count_step_copies(recorder, monkeypatch)
    monkeypatch.setattr(engine, "async_scheduling", True)
    launched_with_pending = []
    launch = engine.runner.launch

    def recording_launch(out, previous=None):
        launched = launch(out, previous)
        if launched.host is not None:
            launched_with_pending.append(launched.host.tensors.pending_dst is not None)
        return launched

    monkeypatch.setattr(engine.runner, "launch", recording_launch)
    plain = [p for p in mixed_params() if not p.frequency_penalty]
    prompts = [[5, 6, 7, 8] * k for k in range(1, 4)]
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, plain)]
    steps_before = engine.num_steps
    with recorder:
        while engine.has_unfinished():
            engine.step()
            assert recorder.calls == [], f"a step syncs: {recorder.calls}"
    num_launched = engine.num_steps - steps_before
    assert copies == {"to_device": num_launched, "to_host": num_launched}
    assert launched_with_pending.count(True) >= 4
    assert all(r.num_output_tokens == 6 for r in requests)


def test_fused_greedy_steps_keep_one_copy_each_way(engine, monkeypatch):
    """Steps whose rows are all plain greedy skip the logits (the native greedy projection on
    CPU): still one staged copy in, one copy of the ids out, nothing else."""
    model = engine.runner.model
    fused, calls = model.greedy_projection, []
    assert fused is not None, "the native greedy projection is not available"

    def counted(hidden, weight):
        calls.append(hidden.shape[0])
        return fused(hidden, weight)

    monkeypatch.setattr(model, "greedy_projection", counted)
    recorder = SyncRecorder()
    copies = count_step_copies(recorder, monkeypatch)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request([5, 6, 7] * (i + 1), params) for i in range(3)]
    num_steps = run_checked(engine, recorder, copies)
    assert len(calls) == num_steps and all(r.num_output_tokens == 4 for r in requests)


def test_the_recorder_catches_a_sync(engine, monkeypatch):
    """The check above is real: the CPU path's attention planning reads lengths on the host
    (free on a CPU, a sync on a GPU), and the recorder sees it."""
    from kernels import reference

    recorder = SyncRecorder()
    monkeypatch.setattr(engine.runner.backend, "use_triton", False)
    monkeypatch.setattr(engine.runner.backend, "kernels", reference)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))
    with recorder:
        recorder.active = True
        engine.step()
    assert "tolist in attention.py:_prefill_parts" in recorder.calls


def test_constrained_rows_add_at_most_the_bitmask_copy(engine, monkeypatch):
    """A step with grammar-constrained rows (mixed with free ones) keeps one staged copy in and
    one copy out. On a GPU its bitmask is one more host-to-device copy, non-blocking from
    pinned memory (`to` in masks.py:result), filled on a worker thread while the forward runs,
    so it cannot join the inputs' copy, staged before the forward; on a CPU it is not copied."""
    from scheduler.request import GrammarSpec

    recorder = SyncRecorder()
    copies = count_step_copies(recorder, monkeypatch)
    json_object = GrammarSpec("json_object")
    params = [
        SamplingParams(max_tokens=5, temperature=0.0, grammar=json_object),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.8, seed=1, grammar=json_object),
    ]
    requests = [engine.add_request([5, 6, 7] * (i + 1), p) for i, p in enumerate(params)]
    run_checked(engine, recorder, copies, allowed={"to in masks.py:result"})
    assert requests[0].output_text.startswith("{")
    assert len(engine.structured.matchers) == 0


def test_padded_graph_inputs_add_no_sync(engine, monkeypatch):
    """The CUDA graphs' static inputs are filled on the device: mixed steps (a mixed graph's
    padded all-prefill forward) and decode-only steps (a decode graph's) keep one copy each way
    and no sync. The graphs are not captured here: their `run` does the same padded forward
    eagerly, as a replay would, with the Triton kernels interpreted."""
    from runtime.step.cuda_graphs import DecodeGraphs, MixedGraphs

    runner = engine.runner
    width = runner.input_batch.device_block_table.shape[1]
    graphs = {
        "mixed": MixedGraphs(runner.model, runner.kv_cache, 64, 8, width),
        "decode": DecodeGraphs(runner.model, runner.kv_cache, 8, width),
    }
    used = []
    for name, step_graphs in graphs.items():
        monkeypatch.setattr(step_graphs, "run", recording(step_graphs.run, used, name))
    monkeypatch.setattr(runner, "mixed_graphs", graphs["mixed"])
    monkeypatch.setattr(runner, "decode_graphs", graphs["decode"])
    recorder = SyncRecorder()
    copies = count_step_copies(recorder, monkeypatch)
    params = mixed_params()
    requests = [engine.add_request([5, 6, 7, 8] * (k + 1), params[k]) for k in range(2)]

    def join_at_step_two(num_steps: int) -> None:  # a prompt joins running decodes: mixed
        if num_steps == 2:
            requests.append(engine.add_request([9, 8, 7] * 5, params[2]))

    num_steps = run_checked(engine, recorder, copies, before_step=join_at_step_two)
    assert all(r.num_output_tokens == 6 for r in requests)
    assert used.count("mixed") == 2 and "decode" in used, used
    assert len(used) == num_steps  # every step replayed a graph


def recording(run, used: list[str], name: str):
    def recorded(*args):
        used.append(name)
        return run(*args)

    return recorded
