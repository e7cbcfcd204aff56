"""Speculative decoding in the engine, on the tiny random model (float32, CPU): with k = 0 for
every row a step is exactly the step without speculation; sampled tokens keep the target's
distribution; drafts never enter the prefix cache, never preempt, and give their rejected
slots back; a preemption, a grammar, a stop string and max_tokens keep the outputs."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.spec.policy import FixedK
from runtime.spec.verify import RejectionSampler
from scheduler.request import GrammarSpec, SamplingParams


def make_engine(tiny_model_dir, k: int | None, **overrides) -> Engine:
    """k: None = speculation off, else every eligible row gets k drafts."""
    settings = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=8,
        speculative="off" if k is None else "ngram",
    )
    engine = Engine(EngineConfig(**(settings | overrides)))
    if k is not None:
        engine.speculator.policy = FixedK(k)
    return engine


def greedy(n: int = 24, **more) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **more)


def blocks_in_use(engine: Engine) -> int:
    return engine.block_manager.num_gpu_blocks - engine.block_manager.num_free_gpu_blocks


def outputs(engine: Engine, prompts, params) -> list[tuple]:
    requests = engine.generate(prompts, params)
    assert blocks_in_use(engine) == 0
    return [(r.output_token_ids, r.output_text, r.finish_reason) for r in requests]


PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [1, 2], [3, 4] * 10, [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir, None)


@pytest.fixture(scope="module")
def drafting(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir, 4)


def test_greedy_tokens_are_the_same_with_drafts(plain, drafting):
    params = [greedy(24), greedy(17), greedy(30), greedy(9)]
    assert outputs(drafting, PROMPTS, params) == outputs(plain, PROMPTS, params)
    stats = drafting.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0


def record_steps(engine: Engine) -> list:
    """Wraps the runner: each step's staged host tensors and the calls that compute on them."""
    runner, steps = engine.runner, []
    launch, forward = runner.launch, runner._forward
    calls: list = []

    def recording_forward(inputs):
        calls.append(("forward", inputs.input_ids.tolist(), inputs.positions.tolist()))
        return forward(inputs)

    def recording_launch(out, previous=None):
        calls.clear()
        launched = launch(out, previous)
        if launched.host is not None:
            tensors = dataclasses.asdict(launched.host.tensors)
            steps.append((_plain(tensors), list(calls), launched.verified))
        return launched

    runner.launch, runner._forward = recording_launch, recording_forward
    return steps


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def test_k_zero_everywhere_is_the_step_without_speculation(tiny_model_dir):
    params = [greedy(12), SamplingParams(max_tokens=10, temperature=0.8, seed=3), greedy(7)]
    off, zero = make_engine(tiny_model_dir, None), make_engine(tiny_model_dir, 0)
    steps_off, steps_zero = record_steps(off), record_steps(zero)
    assert outputs(zero, PROMPTS[:3], params) == outputs(off, PROMPTS[:3], params)
    assert steps_zero == steps_off and len(steps_off) > 10
    assert all(verified is None for _, _, verified in steps_zero)


def test_drafts_never_enter_the_prefix_cache_and_give_rejected_slots_back(drafting):
    prompt = [40 + i for i in range(15)] + [40]  # a match at once: draft 41, 42, ...
    request = drafting.add_request(prompt, greedy(20), request_id="cache")
    while drafting.has_unfinished():
        drafting.step()
        bm = drafting.block_manager
        if not request.is_finished:  # between steps: no block past its tokens
            assert len(request.block_ids) <= bm.num_blocks_for(request.num_tokens)
    hashes = {h for h in bm.pool.block_hash if h is not None}
    assert len(hashes) == len(bm.pool.cached_blocks)
    assert request.num_draft_tokens > 0
    finished = request.events[-1]  # the audit trail's counts
    assert finished.kind == "finished"
    assert finished.data["num_draft_tokens"] == request.num_draft_tokens
    assert finished.data["num_accepted_tokens"] == request.num_accepted_tokens


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_in_the_middle_keeps_greedy_tokens(tiny_model_dir, plain, mode):
    prompts = [[3 + i, 4, 5, 6] * (3 + i) for i in range(6)]
    params = [greedy(20) for _ in prompts]
    tight = make_engine(
        tiny_model_dir,
        3,
        num_kv_blocks=10,
        max_num_seqs=6,
        preemption_mode=mode,
        swap_space=0.01,
        enable_prefix_caching=False,
    )
    assert outputs(tight, prompts, params) == outputs(plain, prompts, params)
    assert tight.scheduler.num_preemptions[mode] > 0
    assert tight.speculator.stats.num_accepted_tokens > 0


def test_max_tokens_and_stop_strings_inside_an_accepted_run(plain, drafting):
    prompt = PROMPTS[0]
    full = outputs(plain, [prompt], [greedy(20)])[0]
    text = full[1]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # ends inside the run
    params = [greedy(7), greedy(20, stop=[stop]), greedy(20, stop_token_ids=[full[0][5]])]
    expected = outputs(plain, [prompt] * 3, params)
    assert outputs(drafting, [prompt] * 3, params) == expected
    assert expected[1][2] == "stop"


def test_json_schema_with_speculation(tiny_model_dir, plain, drafting):
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    constrained = SamplingParams(
        max_tokens=20, temperature=0.0, grammar=GrammarSpec("json_schema", schema)
    )
    params = [constrained, greedy(20), greedy(20)]
    assert outputs(drafting, PROMPTS[:3], params) == outputs(plain, PROMPTS[:3], params)


# ---- the distribution -----------------------------------------------------------------------
def random(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=2.0, top_k=3, seed=seed, ignore_eos=True)


def drafting_prompt(engine: Engine) -> list[int]:
    """[5, 6, 7, 8, s, s, u, 9, 10, s]: s is the model's attractor (its greedy tokens end in it)
    and u a likely runner-up after it in this very prompt. The first token is mostly s; then
    prompt lookup (2-grams) drafts u, which the target accepts now and then."""
    s = outputs(engine, [[5, 6, 7, 8]], [greedy(20)])[0][0][-1]
    u = 0
    for _ in range(4):
        prompt = [5, 6, 7, 8, s, s, u, 9, 10, s]
        runs = outputs(engine, [prompt] * 200, [random(2, seed) for seed in range(200)])
        seconds = Counter(r[0][1] for r in runs if r[0][0] == s and r[0][1] != s)
        if seconds.most_common(1)[0][0] == u:
            return prompt
        u = seconds.most_common(1)[0][0]
    pytest.fail("no likely draft found")


def sample_runs(engine: Engine, prompt, num_samples: int) -> Counter:
    params = [random(3, seed) for seed in range(num_samples)]
    return Counter(tuple(r[0]) for r in outputs(engine, [prompt] * num_samples, params))


def chi_square(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom; cells seen fewer than min_count
    times in all are pooled into one."""
    pooled_a, pooled_b = Counter(), Counter()
    for cell in set(a) | set(b):
        key = cell if a[cell] + b[cell] >= min_count else "rare"
        pooled_a[key] += a[cell]
        pooled_b[key] += b[cell]
    n_a, n_b = sum(a.values()), sum(b.values())
    stat = 0.0
    for cell in set(pooled_a) | set(pooled_b):
        total = pooled_a[cell] + pooled_b[cell]
        expected_a, expected_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
        stat += (pooled_a[cell] - expected_a) ** 2 / expected_a
        stat += (pooled_b[cell] - expected_b) ** 2 / expected_b
    return stat, len(set(pooled_a) | set(pooled_b)) - 1


def chi_square_p_value(stat: float, dof: int) -> float:
    """Upper tail of chi-square(dof), Wilson-Hilferty normal approximation."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def wide(tiny_model_dir) -> dict[str, Engine]:
    settings = dict(max_num_seqs=128, num_kv_blocks=512, ngram_min=2)
    return {
        "off": make_engine(tiny_model_dir, None, **settings),
        "on": make_engine(tiny_model_dir, 2, **settings),
    }


def test_sampled_tokens_keep_the_target_distribution(wide, monkeypatch):
    prompt = drafting_prompt(wide["off"])
    baseline = sample_runs(wide["off"], prompt, 2000)
    speculated = sample_runs(wide["on"], prompt, 2000)
    stats = wide["on"].speculator.stats
    assert stats.num_drafts > 1000 and 0.05 < stats.acceptance_rate < 0.95, stats
    assert chi_square_p_value(*chi_square(baseline, speculated)) > 1e-3
    # the test has teeth: accepting every draft that the target allows at all is caught
    monkeypatch.setattr(RejectionSampler, "_rejection_sample", accept_if_possible)
    wrong = sample_runs(wide["on"], prompt, 2000)
    assert chi_square_p_value(*chi_square(baseline, wrong)) < 1e-6


def accept_if_possible(self, p, row):
    drafts = list(row.draft_token_ids)
    accepted = 0
    for j, draft in enumerate(drafts):
        if float(p[j, draft]) <= 0:
            break
        accepted += 1
    generator = self._generator(row, p.device)
    last = int(torch.multinomial(p[accepted], 1, generator=generator))
    return accepted, [*drafts[:accepted], last]


def test_bench_offline_reports_acceptance_and_the_k_chosen(drafting):
    from benchmarks.offline import spec_decode_line

    drafting.speculator.reset_stats()
    outputs(drafting, PROMPTS[:2], [greedy(16), greedy(16)])
    summary = drafting.speculator.summary()
    assert summary["num_drafts"] > 0 and 0 < summary["acceptance_rate"] <= 1
    assert summary["mean_accepted_length"] > 1 and 4 in summary["num_rows_per_k"]
    assert "acceptance" in spec_decode_line("conveyor_continuous", summary)


def test_the_step_cost_is_learned_from_decode_steps_only(tiny_model_dir):
    engine = make_engine(tiny_model_dir, None, speculative="ngram", max_batch_tokens=64)
    samples = engine.speculator.policy.cost.samples
    engine.generate([list(range(5, 45))], greedy(6))  # a 40-token prefill, then decodes
    assert samples and all(num_tokens == num_rows for num_rows, num_tokens, _ in samples)
    assert len(samples) <= 6  # the prefill step (40 tokens) is not among them


@pytest.mark.parametrize(
    ("speculative", "given", "expected"),
    [("ngram", None, 8), ("draft", None, 7), ("off", None, 7), ("ngram", 3, 3), ("draft", 12, 12)],
)
def test_the_largest_k_defaults_by_proposer(speculative, given, expected):
    """Prompt lookup's drafts cost nothing to propose: it may verify up to 8 (json at one stream
    went from 1.93-1.97x to 2.1-2.3x); a draft model's cost a forward pass each: 7, so that a
    row's k + 1 verify rows are one 8-row block of the 8-bit GEMM."""
    fields = {"draft_model": "x"} if speculative == "draft" else {}
    config = EngineConfig(speculative=speculative, num_speculative_tokens=given, **fields)
    assert config.num_speculative_tokens == expected
