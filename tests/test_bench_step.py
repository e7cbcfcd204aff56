"""`conveyor bench step` runs end to end on its near-zero model (a smoke test: no timing is
judged here; the figures belong to the benchmark's output)."""

from __future__ import annotations

import argparse

from benchmarks.step import run_step_bench, write_near_zero_model
from kernels import native


def test_bench_step_reports_its_figures(tmp_path):
    args = argparse.Namespace(num_seqs=4, num_steps=2, sampling="random", dtype="float32")
    result = run_step_bench(write_near_zero_model(tmp_path), args)
    assert result["num_seqs"] == 4 and result["sampling"] == "random"
    assert 0 < result["logits_and_sampling_ms"] <= result["execute_ms"] <= result["step_ms"]
    assert isinstance(result["meets_target"], bool)


def test_bench_step_reports_the_fused_and_the_logits_path_side_by_side(tmp_path):
    args = argparse.Namespace(num_seqs=4, num_steps=2, sampling="greedy", dtype="float32")
    result = run_step_bench(write_near_zero_model(tmp_path), args)
    if native.native_ops() is None:  # CONVEYOR_NATIVE_KERNELS=0: the logits path only
        assert result["path"] == "logits + sampler" and "unfused" not in result
        return
    assert result["path"] == "fused greedy projection"
    assert result["num_steps"] >= 2 and result["unfused"]["num_steps"] >= 2
    assert 0 < result["logits_and_sampling_ms"] <= result["execute_ms"] <= result["step_ms"]
    assert 0 < result["unfused"]["logits_and_sampling_ms"] <= result["unfused"]["step_ms"]


def test_bench_projection_reports_each_path():
    from benchmarks.step import run_projection_bench

    figures = run_projection_bench(num_rows=3, hidden_size=16, vocab_size=500, repeats=2)
    assert figures["packed_and_argmax_ms"] > 0 and figures["packed_alone_ms"] > 0
    assert (native.native_ops() is None) == ("fused_ms" not in figures)
