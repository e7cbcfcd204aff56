"""`gateway.audit.explain` on synthetic timelines: every delay tied to its cause and facts, the delays
named adding up to the request's total delay, and tenants never seeing each other."""

from __future__ import annotations

import random

import pytest

from gateway.audit.explain import explain, redact_events, seconds, sequence_name

RID = "a" * 32
OTHER = "b" * 32
T0 = 1000.0


def ev(kind: str, at: float, choice: int | None = None, **data) -> dict:
    """An event as the audit log stores it, `at` seconds after the request was received."""
    if choice is not None:
        data["choice"] = choice
    return {"kind": kind, "time": T0 + at, "data": data}


def record(**fields) -> dict:
    base = {
        "id": RID,
        "status": "finished",
        "finish_reason": "length",
        "effective_priority": 2,
        "prompt_tokens": 150,
        "completion_tokens": 128,
    }
    return {**base, **fields}


def queued(at, choice=0, **facts):
    facts = {"num_ahead": 0, "num_running": 0, "ahead_tenants": [], "ahead_priorities": []} | facts
    return ev("queued", at, choice, position=facts["num_ahead"], **facts)


def scheduled(at, choice=0, queue_time=0.0):
    return ev("scheduled", at, choice, num_tokens=150, queue_time=queue_time, num_cached_tokens=0)


def preempted(at, mode, by=OTHER + "-0", by_tenant="acme", choice=0, num_blocks=48):
    return ev(
        "preempted", at, choice, mode=mode, by=by, by_tenant=by_tenant, by_priority=0,
        num_blocks=num_blocks,
    )  # fmt: skip


def finished(at, choice=0, reason="length"):
    return ev("finished", at, choice, reason=reason, num_output_tokens=128)


def within_5_percent(named: float, expected: float) -> bool:
    return abs(named - expected) <= 0.05 * expected + 1e-9


# ---- the story of one slow request -------------------------------------------------------------
SLOW = [
    ev("received", 0.0),
    ev("admitted", 0.002),
    queued(
        0.004,
        num_ahead=12,
        num_running=8,
        ahead_tenants=["acme", "globex"],
        ahead_priorities=[0, 1],
    ),
    ev("waiting_for_kv", 1.2, 0, blocks_needed=5, blocks_free=2),
    scheduled(1.804, queue_time=1.8),
    ev("first_token", 1.9),
    preempted(3.1, "swap"),
    ev("waiting_for_kv", 3.2, 0, blocks_needed=48, blocks_free=10),
    ev("swapped_in", 3.5, 0, num_blocks=48),
    ev("resumed", 3.5, 0, mode="swap"),
    finished(5.0),
    ev("completed", 5.001, status="finished"),
]


def test_queue_waits_and_a_swap_preemption_are_each_named_with_their_facts():
    explanation = explain(record(), SLOW)
    text = "\n".join(explanation.sentences)
    assert "finished (length) in 5.00 s" in text
    assert "first token at +1.90 s" in text
    assert (
        "Waited 1.20 s in the queue behind 12 requests of higher priority (priorities 0, 1) "
        "from tenants acme, globex (8 running)" in text
    )
    assert "Waited 0.60 s for KV cache: needed 5 blocks with 2 free" in text
    assert (
        f"Preempted at +3.10 s by request {OTHER} (priority 0, tenant acme); 48 KV blocks "
        "swapped to CPU and back; while out it waited for KV cache (needed 48 blocks with 10 "
        "free), resumed after 0.40 s" in text
    )
    causes = [(d.cause, round(d.duration_s, 3)) for d in explanation.delays]
    assert causes == [("gateway", 0.004), ("queue", 1.196), ("waiting_for_kv", 0.604),
                      ("preempted", 0.4)]  # fmt: skip
    assert explanation.total_time_s == pytest.approx(5.0)
    assert explanation.service_time_s == pytest.approx(5.0 - 2.204)
    assert text.endswith("+ 2.80 s running on the engine.")


def test_the_delays_named_add_up_to_the_records_delay():
    row = record(queue_time_s=1.8, preempted_time_s=0.4)
    explanation = explain(row, SLOW)
    first_scheduled_after_received, preempted_time = 1.804, row["preempted_time_s"]
    expected = first_scheduled_after_received + preempted_time
    named = sum(delay.duration_s for delay in explanation.delays)
    assert within_5_percent(named, expected)
    assert named == pytest.approx(explanation.total_delay_s)


def test_a_recompute_preemption_says_how_many_tokens_were_recomputed():
    events = [
        ev("received", 0.0),
        queued(0.001),
        scheduled(0.002),
        preempted(1.0, "recompute", num_blocks=12),
        ev("recompute_started", 1.75, 0, num_tokens=190, num_cached_tokens=64),
        ev("resumed", 1.75, 0, mode="recompute"),
        finished(3.0),
    ]
    text = "\n".join(explain(record(), events).sentences)
    assert (
        f"Preempted at +1.00 s by request {OTHER} (priority 0, tenant acme); its 12 KV blocks "
        "were freed and 190 tokens recomputed (64 found in the prefix cache), resumed after "
        "0.75 s" in text
    )


def test_waiting_for_a_running_slot_and_for_the_next_step():
    events = [
        ev("received", 0.0),
        queued(0.0005, num_running=2),
        ev("waiting_for_slot", 0.01, 0, num_running=2),
        scheduled(0.51),
        finished(1.0),
    ]
    explanation = explain(record(), events)
    text = "\n".join(explanation.sentences)
    assert "Waited 10 ms for the engine's next step (2 running)" in text
    assert "Waited 0.50 s for a running slot: all 2 were busy" in text
    assert explanation.total_delay_s == pytest.approx(0.51)


def test_a_long_wait_with_nobody_ahead_is_not_called_the_next_step():
    events = [ev("received", 0.0), queued(0.001, num_running=8), scheduled(1.5), finished(2.0)]
    text = "\n".join(explain(record(), events).sentences)
    assert "next step" not in text
    assert "waited 1.50 s in the queue for a place in a step with no request ahead" in text.lower()


def test_unchecked_rate_limits_are_mentioned():
    events = [ev("received", 0.0), ev("admitted", 0.001, rate_limits_unchecked=True)]
    events += [queued(0.002), scheduled(0.003), finished(1.0)]
    assert "rate limits unchecked" in explain(record(), events).sentences[0]


def test_a_wait_kind_the_scheduler_may_add_later_still_gets_its_segment():
    events = [ev("received", 0.0), queued(0.001)]
    events += [ev("waiting_for_adapter", 0.1, 0, adapter="lora-7"), scheduled(0.6)]
    explanation = explain(record(), events + [finished(1.0)])
    assert "Waited 0.50 s for adapter (adapter lora-7)." in explanation.sentences
    assert explanation.delays[-1].cause == "waiting_for_adapter"
    assert "queue 0.60 s" in explanation.sentences[-1]


def test_the_line_events_name_the_blocker_and_the_budget():
    events = [ev("received", 0.0), queued(0.001)]
    events += [
        ev("waiting_behind", 0.1, 0, by=f"{OTHER}-0", by_tenant="acme", by_priority=1),
        ev("waiting_for_budget", 0.4, 0, max_batch_tokens=2048, num_scheduled=30),
        scheduled(0.6),
        finished(1.0),
    ]
    admin_view = "\n".join(explain(record(), events).sentences)
    assert f"Waited 0.30 s behind request {OTHER} (priority 1), which could not" in admin_view
    assert "Waited 0.20 s for room in a step: the 2048-token step budget was used by 30" in (
        admin_view
    )
    tenant_view = "\n".join(explain(record(), events, viewer_tenant="initech").sentences)
    assert "behind a request of another tenant (priority 1)" in tenant_view
    assert OTHER not in tenant_view


def test_a_wait_for_a_batch_says_whether_it_formed_or_ran():
    forming = ev("waiting_for_batch", 0.001, 0, num_running=0, batch_size=8, window_s=0.05)
    events = [ev("received", 0.0), queued(0.001), forming, scheduled(0.051), finished(1.0)]
    text = "\n".join(explain(record(), events).sentences)
    assert "Waited 50 ms for a batch to form: up to 0.05 s for 8 requests" in text
    behind = ev("waiting_for_batch", 0.001, 0, num_running=3, batch_size=8, window_s=0.05)
    events = [ev("received", 0.0), queued(0.001), behind, scheduled(0.801), finished(1.0)]
    text = "\n".join(explain(record(), events).sentences)
    assert "Waited 0.80 s for the running batch to finish" in text


def test_a_sub_millisecond_wait_for_the_next_step_gets_no_sentence_but_still_counts():
    events = [ev("received", 0.0), queued(0.0002), scheduled(0.0004), finished(0.5)]
    explanation = explain(record(), events)
    assert not any("next step" in sentence for sentence in explanation.sentences)
    assert explanation.total_delay_s == pytest.approx(0.0004)


def test_a_request_preempted_to_let_itself_grow():
    events = [
        ev("received", 0.0),
        queued(0.001),
        scheduled(0.002),
        preempted(2.0, "recompute", by=f"{RID}-0", by_tenant="mine", num_blocks=3),
        ev("recompute_started", 2.5, 0, num_tokens=40, num_cached_tokens=0),
        ev("resumed", 2.5, 0, mode="recompute"),
        finished(3.0),
    ]
    text = "\n".join(explain(record(), events).sentences)
    assert "Preempted at +2.00 s to make room for itself" in text


def test_aborted_while_swapped_out_counts_until_the_abort():
    events = [
        ev("received", 0.0),
        queued(0.001),
        scheduled(0.002),
        preempted(1.0, "swap", num_blocks=4),
        ev("aborted", 1.5, 0, status="swapped"),
        ev("completed", 1.51, status="aborted"),
    ]
    explanation = explain(record(status="aborted", finish_reason=None), events)
    text = "\n".join(explanation.sentences)
    assert "was aborted when the client went away at +1.50 s" in text
    assert "4 KV blocks swapped to CPU (not yet back)" in text
    assert "still preempted 0.50 s later when it ended" in text
    assert explanation.total_delay_s == pytest.approx(0.002 + 0.5)


def test_an_operator_cancel_is_reported_with_its_time():
    events = [
        ev("received", 0.0),
        queued(0.001),
        scheduled(0.002),
        ev("cancelled", 0.7),
        ev("aborted", 0.71, 0, status="running"),
    ]
    text = explain(record(status="cancelled", finish_reason="abort"), events).sentences[0]
    assert "was cancelled by an operator at +0.70 s" in text


def test_choices_are_explained_one_by_one_and_their_delays_add_up():
    events = [ev("received", 0.0)]
    for choice, wait in ((0, 0.2), (1, 0.9)):
        events += [
            queued(0.001, choice, num_ahead=1, ahead_tenants=["acme"], ahead_priorities=[2]),
            scheduled(0.001 + wait, choice),
            finished(2.0, choice),
        ]
    explanation = explain(record(), events)
    text = "\n".join(explanation.sentences)
    assert "Choice 0: waited 0.20 s in the queue behind 1 request of the same priority" in text
    assert "Choice 1: waited 0.90 s" in text
    assert explanation.total_delay_s == pytest.approx(0.001 * 2 + 0.2 + 0.9)
    assert "choice 0: 2.00 s = 0.20 s of delay" in text


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        ("rate_limit_requests", "requests-per-minute limit"),
        ("daily_quota", "daily token quota"),
        ("overloaded", "overloaded"),
        ("validation", "an invalid request"),
    ],
)
def test_a_refused_request_says_why(reason, words):
    events = [ev("received", 0.0), ev("refused", 0.003, reason=reason)]
    row = record(status="rejected", refusal_reason=reason, error="Rate limit reached.")
    explanation = explain(row, events)
    assert words in explanation.sentences[0]
    assert "never reached the engine" in explanation.sentences[0]
    assert explanation.sentences[1] == "The client was told: Rate limit reached."
    assert explanation.delays == [] and explanation.total_delay_s == 0.0


# ---- what a tenant may see ---------------------------------------------------------------------
def test_a_tenant_never_sees_another_tenants_name_or_request_id():
    explanation = explain(record(), SLOW, viewer_tenant="initech")
    text = "\n".join(explanation.sentences)
    assert "acme" not in text and "globex" not in text and OTHER not in text
    assert "from 2 other tenants" in text
    assert "by a request of another tenant (priority 0)" in text
    shown = redact_events(SLOW, "initech")
    assert "acme" not in repr(shown) and OTHER not in repr(shown)
    assert next(e for e in shown if e["kind"] == "queued")["data"]["num_other_tenants_ahead"] == 2


def test_a_tenant_sees_its_own_name_and_requests():
    events = [
        ev("received", 0.0),
        queued(0.001, num_ahead=3, ahead_tenants=["acme", "initech"], ahead_priorities=[1]),
        scheduled(1.0),
        preempted(2.0, "swap", by_tenant="initech"),
        ev("swapped_in", 2.5, 0, num_blocks=48),
        ev("resumed", 2.5, 0, mode="swap"),
        finished(3.0),
    ]
    text = "\n".join(explain(record(), events, viewer_tenant="initech").sentences)
    assert "from your tenant and 1 other tenant" in text
    assert f"by request {OTHER} (priority 0, tenant initech)" in text


# ---- properties --------------------------------------------------------------------------------
def random_timeline(rng: random.Random) -> tuple[list[dict], float]:
    """A random but well-formed timeline and its delay computed independently."""
    t = rng.uniform(0, 0.01)
    events = [ev("received", 0.0), queued(t)]
    for _ in range(rng.randint(0, 3)):
        t += rng.uniform(0, 0.5)
        kind = rng.choice(["waiting_for_kv", "waiting_for_slot"])
        events.append(ev(kind, t, 0, blocks_needed=3, blocks_free=1, num_running=2))
    t += rng.uniform(0, 0.5)
    events.append(scheduled(t))
    delay = t
    for _ in range(rng.randint(0, 3)):
        t += rng.uniform(0.01, 1.0)
        mode = rng.choice(["swap", "recompute"])
        events.append(preempted(t, mode))
        out = rng.uniform(0, 1.0)
        t += out
        delay += out
        events.append(ev("swapped_in" if mode == "swap" else "recompute_started", t, 0,
                         num_blocks=4, num_tokens=50, num_cached_tokens=0))  # fmt: skip
        events.append(ev("resumed", t, 0, mode=mode))
    events.append(finished(t + rng.uniform(0.01, 1.0)))
    return events, delay


@pytest.mark.parametrize("seed", range(50))
def test_random_timelines_are_fully_accounted_for(seed):
    rng = random.Random(seed)
    events, expected_delay = random_timeline(rng)
    rng.shuffle(events)  # storage order must not matter: times do
    explanation = explain(record(), events)
    named = sum(delay.duration_s for delay in explanation.delays)
    assert named == pytest.approx(expected_delay, rel=1e-9, abs=1e-9)
    assert explanation.total_delay_s + explanation.service_time_s == pytest.approx(
        explanation.total_time_s
    )
    assert all(delay.duration_s >= 0 for delay in explanation.delays)


def test_formatting_helpers():
    assert [seconds(x) for x in (0.0001, 0.012, 0.35, 4.2)] == [
        "<1 ms",
        "12 ms",
        "0.35 s",
        "4.20 s",
    ]
    assert sequence_name(f"{RID}-0") == RID
    assert sequence_name(f"{RID}-2") == f"{RID} (choice 2)"
    assert sequence_name("req-5") == "req-5"


def test_a_constrained_request_says_its_grammar_and_what_it_cost():
    events = [
        ev("received", 0.0),
        ev("grammar_prepared", 0.012, grammar="json_schema", compile_ms=11.5, cache_hit=False),
        queued(0.013), scheduled(0.014), finished(0.5, reason="stop"),
    ]  # fmt: skip
    sentences = explain(record(finish_reason="stop"), events).sentences
    assert (
        "constrained by a json_schema grammar, compiled in 11.5 ms before admission" in sentences[1]
    )
    cached = [ev("grammar_prepared", 0.0, grammar="tools", compile_ms=0.0, cache_hit=True)]
    assert (
        "tools grammar, from the grammar cache"
        in explain(record(), events[:1] + cached + events[2:]).sentences[1]
    )
