"""The persistent input batch: rows live across steps and follow the requests; a step's staged
inputs equal the flat batch built the plain way from the requests' Python lists."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.step.inputs import prepare_host_step
from scheduler.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    )


def greedy(n=8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def plain_flat_batch(scheduled, block_size):
    """The flat batch from Python lists: decodes first, by length, then prefill chunks."""
    decodes = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens == r.num_tokens - 1]
    decodes.sort(key=lambda item: item[0].num_computed_tokens)
    prefills = [(r, n) for r, n in scheduled if all(r is not d for d, _ in decodes)]
    input_ids, positions, slots, seq_lens = [], [], [], []
    for request, num_new in decodes + prefills:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        input_ids += request.all_token_ids[start:end]
        positions += range(start, end)
        slots += [
            request.block_ids[p // block_size] * block_size + p % block_size
            for p in range(start, end)
        ]
        seq_lens.append(end)
    return input_ids, positions, slots, seq_lens, len(decodes)


def test_staged_inputs_equal_the_plain_flat_batch(engine):
    bs = engine.runner.block_size
    for k in range(1, 4):
        engine.add_request([3, 4, 5, 6, 7] * (4 * k), greedy(5))
    checked = 0
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        if out.scheduled:
            expected = plain_flat_batch(out.scheduled, bs)
            batch = engine.runner.input_batch
            batch.apply(out)
            host = prepare_host_step(batch, out.scheduled, bs)
            tensors = host.tensors
            got = (
                tensors.input_ids.tolist(),
                tensors.positions.tolist(),
                tensors.slot_mapping.tolist(),
                tensors.seq_lens.tolist(),
                host.num_decode,
            )
            assert got == expected
            checked += 1
            # put the step's updates back so that the real step stages them for the device
            batch.updates.block_cells += [tuple(c) for c in tensors.block_cells.T.tolist()]
            batch.updates.param_rows += tensors.param_rows.tolist()
            batch.updates.params += tensors.param_values.tolist()
            out = replace(out, new_rows=[], appends=[])  # applied above
        sampled = engine.runner.execute(out)
        tokens = {rid: token_ids for rid, (token_ids, _) in sampled.items()}
        engine.scheduler.mark_launched(out)
        for request, num_kept in engine.scheduler.update_from_output(out, tokens):
            engine._output_for(request, num_kept, *sampled[request.request_id])
    assert checked >= 5


def test_rows_persist_follow_blocks_and_are_reused(engine):
    batch = engine.runner.input_batch
    first = engine.add_request([9] * 14, greedy(6))
    engine.step()
    row = batch.rows[first.request_id]
    for _ in range(4):  # crosses a block boundary at 16 tokens
        engine.step()
        assert batch.rows[first.request_id] == row
        num_blocks = len(first.block_ids)
        device_row = batch.device_block_table[row, :num_blocks].tolist()
        assert device_row == first.block_ids
    assert len(first.block_ids) == 2
    while engine.has_unfinished():
        engine.step()
    second = engine.add_request([8] * 5, greedy(2))
    engine.step()
    assert first.request_id not in batch.rows
    assert batch.rows[second.request_id] == row  # the freed row is taken again
    while engine.has_unfinished():
        engine.step()


def test_launch_then_collect_later_gives_the_same_outputs(tiny_model_dir, engine):
    """Host work between launching a step and collecting it (where the overlap goes) changes
    nothing: the same greedy and seeded tokens as stepping straight through."""
    prompts = [[11, 12, 13] * k for k in range(1, 5)]
    params = [greedy(6), SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)] * 2
    straight = [r.output_token_ids for r in engine.generate(prompts, params)]
    other = Engine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    )
    requests = [other.add_request(p, sp) for p, sp in zip(prompts, params)]
    while other.has_unfinished():
        out = other.scheduler.schedule()
        launched = other.runner.launch(out)
        other.scheduler.mark_launched(out)
        torch.randn(64, 64) @ torch.randn(64, 64)  # the host busy with something else
        sampled = other.runner.collect(launched)
        other.scheduler.update_from_output(out, {rid: t for rid, (t, _) in sampled.items()})
    assert [r.output_token_ids for r in requests] == straight


def test_warm_up_leaves_no_trace(engine):
    """The start-up warm-up (run on CUDA to compile every kernel variant) runs on any device
    and leaves no rows and no generators behind: outputs stay the same."""
    prompt = [21, 22, 23, 24] * 3
    before = engine.generate([prompt], greedy(6))[0].output_token_ids
    num_rows = engine.runner.input_batch.num_rows  # a finished row leaves at the next step
    engine.runner.warm_up()
    assert engine.runner.input_batch.num_rows == num_rows
    assert engine.generate([prompt], greedy(6))[0].output_token_ids == before
