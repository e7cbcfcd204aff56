"""Engine and offline generation on a tiny random model: fast and exhaustive."""

from __future__ import annotations

import json

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine, RequestError
from runtime.offline import run_offline
from scheduler.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    )


def greedy(n=8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def blocks_in_use(engine: Engine) -> int:
    return engine.block_manager.num_gpu_blocks - engine.block_manager.num_free_gpu_blocks


def test_requests_finish_and_free_every_block(engine):
    requests = engine.generate([[5, 6, 7] * k for k in range(1, 6)], greedy(8))
    assert all(r.finish_reason == "length" and r.num_output_tokens == 8 for r in requests)
    assert blocks_in_use(engine) == 0


def test_static_batching_gives_the_same_greedy_tokens(tiny_model_dir, engine):
    prompts = [[9, 8, 7, 6] * k for k in range(1, 7)]
    continuous = [r.output_token_ids for r in engine.generate(prompts, greedy(6))]
    static = Engine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            num_kv_blocks=64,
            max_num_seqs=3,
            scheduling="static",
        )
    )
    assert [r.output_token_ids for r in static.generate(prompts, greedy(6))] == continuous


def test_reset_scheduler_changes_policy_and_empties_the_prefix_cache(engine):
    prompt = [4, 5, 6, 7] * 8  # two full blocks of 16
    engine.generate([prompt], greedy(2))
    engine.generate([prompt], greedy(2))
    assert engine.block_manager.num_prefix_hits > 0
    engine.reset_scheduler(policy="static")
    assert engine.scheduler.config.policy == "static"
    assert engine.block_manager.num_prefix_hits == 0
    engine.generate([prompt], greedy(2))
    assert engine.block_manager.num_prefix_hits == 0  # nothing cached from before the reset
    engine.add_request(prompt, greedy(2), request_id="busy")
    with pytest.raises(RuntimeError, match="idle"):
        engine.reset_scheduler()
    engine.abort("busy")
    engine.reset_scheduler(policy=engine.config.scheduling)
    assert engine.scheduler.config.policy == engine.config.scheduling


def test_stop_token_and_max_model_len_checks(engine):
    first = engine.generate([[11, 12, 13]], greedy(4))[0].output_token_ids
    stopped = engine.generate(
        [[11, 12, 13]], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first[1]])
    )[0]
    expected = first[: first.index(first[1]) + 1]
    assert stopped.output_token_ids == expected and stopped.finish_reason == "stop"
    with pytest.raises(RequestError) as e:
        engine.validate(list(range(3000)), greedy())
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="temperature"):
        engine.validate([1, 2], SamplingParams(temperature=-1))


def test_abort_in_any_state_frees_blocks(engine):
    for _ in range(3):
        engine.add_request([3] * 40, greedy(50))
    engine.step()
    engine.step()
    for request_id in list(engine.scheduler.requests):
        output = engine.abort(request_id)
        assert output.finished and output.finish_reason == "abort"
    assert blocks_in_use(engine) == 0 and not engine.has_unfinished()


def test_offline_lines_keep_order_and_report_bad_ones(engine):
    lines = [
        json.dumps({"id": "a", "prompt": "hello there", "max_tokens": 3, "temperature": 0}),
        "{not json",
        json.dumps({"id": "c", "prompt": "x " * 5000, "max_tokens": 2}),
        json.dumps(
            {
                "id": "d",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "top_p": 7,
            }
        ),
        json.dumps(
            {
                "id": "e",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "priority": 1,
            }
        ),
    ]
    results = run_offline(engine, lines, with_events=True, progress=False)
    assert [r["id"] for r in results] == ["a", "line-2", "c", "d", "e"]
    assert results[0]["completion_tokens"] == 3 and len(results[0]["token_ids"]) == 3
    assert "JSON" in results[1]["error"] or "Expecting" in results[1]["error"]
    assert "context length" in results[2]["error"]
    assert "top_p" in results[3]["error"]
    kinds = [e["kind"] for e in results[4]["events"]]
    assert kinds[0] == "queued" and "scheduled" in kinds and kinds[-1] == "finished"


def test_length_groups_bound_padding_and_cover_every_sequence():
    from runtime.attention import length_groups

    lens = sorted([10, 12, 15, 100, 101, 102, 500, 510] * 5)
    groups = length_groups(lens)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert len(groups) > 1 and length_groups([300] * 128) == [(0, 128)]
    padded = sum(max(lens[a:b]) * (b - a) for a, b in groups)
    assert padded < 0.7 * max(lens) * len(lens)  # one group would pad every row to 510


def _outputs_by_request(engine: Engine, prompts, params, abort_after: dict[int, int] = ()):
    """Every RequestOutput per request, stepping by hand; abort_after: {request index: step}."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    seen = {r.request_id: [] for r in requests}
    num_steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            seen[output.request_id].append(output)
        num_steps += 1
        for index, step in dict(abort_after).items():
            if step == num_steps:
                output = engine.abort(requests[index].request_id)
                if output is not None:
                    seen[output.request_id].append(output)
    return [seen[r.request_id] for r in requests]


def _summary(outputs):
    return [
        (
            [t for o in per for t in o.new_token_ids],
            "".join(o.new_text for o in per),
            per[-1].finish_reason,
            [o.finished for o in per].count(True),
            [o.logprobs for o in per],
        )
        for per in outputs
    ]


def test_async_output_gives_the_same_outputs(tiny_model_dir, batch_invariant_kernels):
    """Outputs built one step late (while the next step runs) are the outputs built at once:
    tokens, text, stop strings (the extra token scheduled is dropped), seeds, max_tokens, an
    abort between steps (no output after its final one), and every block freed."""
    prompts = [[5, 6, 7] * k for k in range(1, 7)]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = {
        mode: Engine(
            EngineConfig(
                model=str(tiny_model_dir),
                dtype="float32",
                num_kv_blocks=64,
                max_num_seqs=4,
                async_output=mode,
            )
        )
        for mode in ("off", "on")
    }
    assert not engines["off"].async_output and engines["on"].async_output
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    first = _outputs_by_request(engines["off"], prompts[1:2], [seeded])[0]
    stop_text = "".join(o.new_text for o in first)[3:6]
    assert len(stop_text) == 3, "the sampled text is too short to pick a stop string from"
    params = [
        plain,
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=9, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        plain,
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    ]
    results = {
        mode: _outputs_by_request(engine, prompts, params, abort_after={4: 3})
        for mode, engine in engines.items()
    }
    assert _summary(results["on"]) == _summary(results["off"])
    assert results["on"][1][-1].finish_reason == "stop"
    assert results["on"][4][-1].finish_reason == "abort"
    for per in results["on"]:
        assert [o.finished for o in per].count(True) == 1 and per[-1].finished
    for engine in engines.values():
        assert blocks_in_use(engine) == 0 and engine.unbuilt is None
