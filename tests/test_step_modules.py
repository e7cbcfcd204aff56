"""One steady decode step runs code in few of the project's modules (issue 24: at most 12 for a
greedy step; 20 before the step had rooms), and a request without a grammar touches no grammar
module. Counted as every project source file with a Python call event during Engine.step()."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from scheduler.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "runtime", "scheduler", "kernels", "benchmarks")


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))


def modules_of_one_step(engine: Engine, temperature: float) -> set[str]:
    for prompt in ([5, 6, 7, 8], [9, 10, 11]):
        engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=temperature))
    for _ in range(4):  # prefill, then decodes: steady
        engine.step()
    seen: set[str] = set()

    def profile(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if (
            event == "call"
            and path.is_relative_to(ROOT)
            and path.parts[len(ROOT.parts)] in PACKAGES
        ):
            seen.add(str(path.relative_to(ROOT)))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    while engine.has_unfinished():
        engine.step()
    return seen


def test_a_steady_greedy_decode_step_runs_in_at_most_12_modules(engine):
    modules = modules_of_one_step(engine, temperature=0.0)
    assert "runtime/engine.py" in modules and "runtime/step/model_runner.py" in modules
    assert len(modules) <= 12, sorted(modules)


def test_a_request_without_a_grammar_touches_no_grammar_module(engine):
    for temperature in (0.0, 0.8):
        modules = modules_of_one_step(engine, temperature)
        assert not [m for m in modules if m.startswith("runtime/structured/")], sorted(modules)
