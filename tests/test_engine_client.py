"""EngineClient on a tiny random model: streams, aborts on close, snapshots taken on the engine
thread, and the typed commands it hands over."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runtime import engine_client
from runtime.config import EngineConfig
from runtime.engine import Engine, NewRequest, RequestError
from runtime.engine_client import AbortRequest, EngineClient
from scheduler.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    )


@pytest.fixture
async def client(engine):
    client = EngineClient(engine)
    client.start()
    yield client
    client.stop()


def greedy(n=8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def wait_until_idle(engine: Engine) -> None:
    for _ in range(300):
        if not engine.has_unfinished():
            return
        await asyncio.sleep(0.01)


async def test_streams_and_aborts_on_close(engine, client):
    outputs = [output async for output in client.submit([4, 5, 6], greedy(5))]
    assert sum(len(o.new_token_ids) for o in outputs) == 5 and outputs[-1].finished
    assert outputs[-1].first_scheduled_time >= outputs[-1].arrival_time
    stream = client.submit([4, 5, 6] * 10, greedy(500))
    await anext(stream)
    await stream.aclose()  # the client went away
    await wait_until_idle(engine)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_gpu_blocks == engine.block_manager.num_gpu_blocks
    with pytest.raises(RequestError):  # not checked on the loop: the engine thread refuses it
        [output async for output in client.submit([], greedy())]


async def test_snapshot_shows_what_runs_and_is_a_copy(engine, client):
    stream = client.submit([7, 8, 9] * 4, greedy(400), request_id="snap-0", tenant="acme")
    await anext(stream)
    snapshot = await client.snapshot()
    (running,) = snapshot.running
    assert (running.sequence_id, running.tenant, running.status) == ("snap-0", "acme", "running")
    assert running.num_prompt_tokens == 12 and running.num_gpu_blocks >= 1
    assert snapshot.num_free_gpu_blocks < snapshot.num_gpu_blocks
    assert 0 < snapshot.gpu_kv_usage <= 1 and snapshot.num_steps >= 1
    await stream.aclose()
    await wait_until_idle(engine)
    after = await client.snapshot()
    assert after.running == () and after.gpu_kv_usage == 0
    assert snapshot.running == (running,)  # the earlier snapshot did not change under us


async def test_snapshot_counts_every_output_token_even_of_requests_already_gone(engine, client):
    """The console's tokens/s is the change of this count between two reads: requests that
    start and finish between them count too (the sequences in both reads would miss them)."""
    before = (await client.snapshot()).num_output_tokens
    streamed = 0
    for n in (5, 3, 1):
        async for output in client.submit([4, 5, 6], greedy(n)):
            streamed += len(output.new_token_ids)
    after = await client.snapshot()
    assert after.running == () and streamed == 9 and after.num_output_tokens - before == 9


async def test_abort_all_ends_every_open_stream(engine, client):
    streams = [client.submit([3, 4] * 5, greedy(400), request_id=f"all-{i}") for i in range(3)]
    for stream in streams:
        await anext(stream)
    assert client.abort_all() == 3
    for stream in streams:
        last = [output async for output in stream][-1]
        assert last.finished and last.finish_reason == "abort"
    await wait_until_idle(engine)
    assert not engine.has_unfinished()


def test_commands_are_typed_values():
    add = NewRequest([1, 2], greedy(2), "r-1", priority=3, tenant="acme")
    assert add == NewRequest([1, 2], greedy(2), "r-1", priority=3, tenant="acme")
    assert AbortRequest("r-1") != AbortRequest("r-2")
    with pytest.raises(AttributeError):
        add.priority = 0  # frozen: the engine thread reads what the event loop sent


async def test_dynamic_batching_waits_for_its_batch_then_serves(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
        scheduling="dynamic", batch_window=0.2,
    )  # fmt: skip
    client = EngineClient(Engine(config))
    client.start()
    try:
        outputs = [output async for output in client.submit([5, 6, 7], greedy(3))]
    finally:
        client.stop()
    kinds = [event.kind for output in outputs for event in output.events]
    assert kinds.index("waiting_for_batch") < kinds.index("scheduled")
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 3


async def test_launch_builds_the_engine_on_the_thread_that_steps_it(tiny_model_dir, monkeypatch):
    built_on, stepped_on = [], set()

    class RecordingEngine(Engine):
        def __init__(self, config):
            built_on.append(threading.current_thread())
            super().__init__(config)

        def step(self):
            stepped_on.add(threading.current_thread())
            return super().step()

    monkeypatch.setattr(engine_client, "Engine", RecordingEngine)
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    client = await EngineClient.launch(config)
    try:
        assert client.is_running and built_on == [client._thread]
        assert client._thread is not threading.current_thread()
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outputs = [o async for o in client.submit([1, 2, 3], params)]
        assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 3
        assert stepped_on == {client._thread}
    finally:
        await asyncio.to_thread(client.stop)
    assert not client.is_running


async def test_launch_passes_on_a_failed_build():
    with pytest.raises(Exception, match="no-such-model"):
        await EngineClient.launch(EngineConfig(model="/no-such-model"))
