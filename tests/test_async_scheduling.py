"""Async scheduling (the host a step ahead of the device) and async output (a step's outputs
built during the next) give the synchronous loop's outputs: tokens, text, finish reasons,
logprobs, seeds, stops of every kind, aborts, preemption, and the steps that must land first
(penalties, grammars). Tiny random model, float32, CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from scheduler.request import GrammarSpec, SamplingParams

PROMPTS = [[5, 6, 7] * k for k in range(1, 9)]


def make_engine(tiny_model_dir, async_scheduling: str, **overrides) -> Engine:
    settings = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
    )
    return Engine(EngineConfig(**(settings | overrides)))


def blocks_in_use(engine: Engine) -> int:
    return engine.block_manager.num_gpu_blocks - engine.block_manager.num_free_gpu_blocks


def run(engine: Engine, prompts, params, abort_after: dict[int, int] = ()):
    """Every RequestOutput per request; abort_after: {request index: after this many steps}."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    seen = {r.request_id: [] for r in requests}
    num_steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            seen[output.request_id].append(output)
        num_steps += 1
        for index, step in dict(abort_after).items():
            if step == num_steps and (output := engine.abort(requests[index].request_id)):
                seen[output.request_id].append(output)
    assert blocks_in_use(engine) == 0 and not engine.pipeline
    for per in seen.values():
        assert [o.finished for o in per].count(True) == 1 and per[-1].finished
    return [seen[r.request_id] for r in requests]


def summary(outputs):
    return [
        (
            [t for o in per for t in o.new_token_ids],
            "".join(o.new_text for o in per),
            per[-1].finish_reason,
            [o.finished for o in per].count(True),
            [lp for o in per for lp in o.logprobs],
        )
        for per in outputs
    ]


def count_pending_launches(engine: Engine) -> list[int]:
    """Wraps the runner's launch; the list counts launches that read a step in flight."""
    counts = []
    launch = engine.runner.launch

    def counting(out, previous=None):
        launched = launch(out, previous)
        if launched.host is not None and launched.host.tensors.pending_dst is not None:
            counts.append(len(launched.host.tensors.pending_dst))
        return launched

    engine.runner.launch = counting
    return counts


@pytest.fixture(scope="module")
def engines(tiny_model_dir, batch_invariant_kernels) -> dict[str, Engine]:
    return {mode: make_engine(tiny_model_dir, mode) for mode in ("off", "on")}


def test_outputs_equal_the_synchronous_loop(engines):
    assert engines["on"].async_scheduling and not engines["off"].async_scheduling
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    first = run(engines["off"], PROMPTS[1:2], [seeded])[0]
    tokens = [t for o in first for t in o.new_token_ids]
    text = "".join(o.new_text for o in first)
    assert len(text) >= 6, "the sampled text is too short to pick a stop string from"
    params = [
        plain,
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[text[3:6]]),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop_token_ids=[tokens[4]]),
        SamplingParams(max_tokens=9, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, frequency_penalty=1.5),
        plain,
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    ]
    pending = count_pending_launches(engines["on"])
    results = {
        mode: run(engine, [PROMPTS[1]] * 3 + PROMPTS[3:], params, abort_after={6: 3})
        for mode, engine in engines.items()
    }
    assert summary(results["on"]) == summary(results["off"])
    assert [per[-1].finish_reason for per in results["on"]][:3] == ["length", "stop", "stop"]
    assert results["on"][6][-1].finish_reason == "abort"
    assert len(pending) >= 4 and max(pending) >= 3, "the host never ran a step ahead"


def test_a_length_limit_schedules_no_extra_token(engines):
    """max_tokens is known ahead: the token after the last is never computed; a stop token is
    only seen after the next step was launched, so that one step is computed and dropped."""
    engine = engines["on"]
    times_scheduled = {}
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        for request, _ in out.scheduled:
            times_scheduled[request.request_id] = times_scheduled.get(request.request_id, 0) + 1
        return out

    engine.scheduler.schedule = counting
    try:
        by_length = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
        outputs = run(engine, PROMPTS[:1], [by_length])[0]
        assert sum(len(o.new_token_ids) for o in outputs) == 8
        assert times_scheduled[outputs[0].request_id] == 8  # one prefill, seven decodes
        tokens = [t for o in outputs for t in o.new_token_ids]
        last = next(i for i in range(2, 8) if tokens[i] not in tokens[:i])
        by_token = replace(by_length, stop_token_ids=[tokens[last]])
        stopped = run(engine, PROMPTS[:1], [by_token])[0]
        assert [t for o in stopped for t in o.new_token_ids] == tokens[: last + 1]
        assert times_scheduled[stopped[0].request_id] == last + 2  # one more, dropped
    finally:
        engine.scheduler.schedule = schedule


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_a_step_in_flight(tiny_model_dir, engines, mode):
    """A cache too small for the batch: requests are preempted while their next token is on the
    device, and resume with it."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        if i % 2
        else SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(6)
    ]
    prompts = [[3 + i, 4, 5, 6] * (3 + i) for i in range(6)]
    ample = run(engines["off"], prompts, params)
    tight = make_engine(
        tiny_model_dir,
        "on",
        num_kv_blocks=10,
        max_num_seqs=6,
        preemption_mode=mode,
        swap_space=0.01,
        enable_prefix_caching=False,
    )
    assert tight.runner.num_cpu_blocks >= 10, "the swap space holds too few blocks"
    assert summary(run(tight, prompts, params)) == summary(ample)
    assert tight.scheduler.num_preemptions[mode] > 0


def test_grammar_and_penalty_steps_land_before_the_next(engines):
    """A constrained or penalised request's next mask or penalty needs its last token on the
    host: its step lands before the next is scheduled, beside free rows that run ahead."""
    grammar = GrammarSpec(kind="json_object")
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, grammar=grammar),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, seed=2, presence_penalty=1.0),
    ]
    results = {mode: run(engine, PROMPTS[:3], params) for mode, engine in engines.items()}
    assert summary(results["on"]) == summary(results["off"])


def test_async_output_gives_the_same_outputs(tiny_model_dir, engines):
    """Outputs built one step late (while the next step runs) are the outputs built at once:
    tokens, text, stop strings (the extra token scheduled is dropped), seeds, max_tokens, an
    abort between steps (no output after its final one), and every block freed."""
    late = make_engine(tiny_model_dir, "off", async_output="on")
    assert late.async_output and not engines["off"].async_output
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    text = "".join(o.new_text for o in run(engines["off"], PROMPTS[1:2], [seeded])[0])
    assert len(text) >= 6, "the sampled text is too short to pick a stop string from"
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [
        plain,
        replace(seeded, stop=[text[3:6]]),
        SamplingParams(max_tokens=9, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        plain,
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    ]
    results = {
        mode: run(engine, PROMPTS[:6], params, abort_after={4: 3})
        for mode, engine in (("off", engines["off"]), ("late", late))
    }
    assert summary(results["late"]) == summary(results["off"])
    assert results["late"][1][-1].finish_reason == "stop"
    assert results["late"][4][-1].finish_reason == "abort"
