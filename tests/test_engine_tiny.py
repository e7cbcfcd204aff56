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
    from runtime.models.attention import length_groups

    lens = sorted([10, 12, 15, 100, 101, 102, 500, 510] * 5)
    groups = length_groups(lens)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert len(groups) > 1 and length_groups([300] * 128) == [(0, 128)]
    padded = sum(max(lens[a:b]) * (b - a) for a, b in groups)
    assert padded < 0.7 * max(lens) * len(lens)  # one group would pad every row to 510
