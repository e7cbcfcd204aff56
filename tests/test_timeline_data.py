"""`gateway.audit.timeline` and the page rendering on synthetic audit trails: lanes that tile a
request's life in order (the explanation's delays, prefill, decode), preemption causes as each
viewer may see them, and pages that escape every string and carry a strict CSP. The same pages
in a real browser against a running server: tests/test_timeline_pages.py."""

from __future__ import annotations

import random

import pytest
from test_explain import OTHER, RID, SLOW, ev, finished, preempted, queued, random_timeline
from test_explain import record as audit_record

from gateway.audit.explain import explain
from gateway.audit.timeline import build_timeline
from gateway.pages import render
from gateway.pages.layout import Neighbour, draw, nice_step


def kinds(lane) -> list[str]:
    return [segment.kind for segment in lane.segments]


def assert_tiles(lane) -> None:
    """Segments follow each other without gap or overlap, from arrival to the lane's end."""
    assert lane.segments[0].start_s == pytest.approx(0.0, abs=1e-9)
    for before, after in zip(lane.segments, lane.segments[1:]):
        assert after.start_s == pytest.approx(before.end_s, abs=1e-9)
    assert lane.segments[-1].end_s == pytest.approx(lane.end_s, abs=1e-9)
    assert all(segment.duration_s >= 0 for segment in lane.segments)


# ---- the data ----------------------------------------------------------------------------------
def test_a_slow_request_is_drawn_in_order_with_the_explanations_durations():
    timeline = build_timeline(audit_record(), SLOW)
    (lane,) = timeline.lanes
    assert kinds(lane) == [
        "gateway", "queue", "waiting_for_kv", "prefill", "decode", "preempted", "decode",
    ]  # fmt: skip
    assert_tiles(lane)
    spans = [(round(s.start_s, 3), round(s.end_s, 3)) for s in lane.segments]
    assert spans == [(0.0, 0.004), (0.004, 1.2), (1.2, 1.804), (1.804, 1.9), (1.9, 3.1),
                     (3.1, 3.5), (3.5, 5.0)]  # fmt: skip
    delays = explain(audit_record(), SLOW).delays
    drawn = [s for s in lane.segments if s.kind not in ("prefill", "decode")]
    assert [s.sentence for s in drawn] == [d.sentence for d in delays]
    assert timeline.total_s == pytest.approx(5.0)


def test_first_token_decode_rate_and_marks():
    timeline = build_timeline(audit_record(), SLOW)
    (lane,) = timeline.lanes
    assert {m.kind: round(m.at_s, 3) for m in timeline.marks} == {
        "admitted": 0.002,
        "first_token": 1.9,
    }
    assert [(m.kind, round(m.at_s, 3)) for m in lane.marks] == [
        ("swapped_in", 3.5),
        ("finished", 5.0),
    ]
    # 128 tokens: the first ends the prefill, 127 over 1.2 s + 1.5 s of decode
    assert lane.decode_s == pytest.approx(2.7)
    assert lane.tokens_per_s == pytest.approx(127 / 2.7)
    decode = [s for s in lane.segments if s.kind == "decode"]
    assert all("47.0 tokens/s" in s.sentence for s in decode)
    prefill = next(s for s in lane.segments if s.kind == "prefill")
    assert "its first step computed 150 prompt tokens" in prefill.sentence


def test_each_chunk_of_a_long_prompt_is_its_own_prefill_segment():
    """The scheduler records every later chunk of a prompt (prefill_chunk); the prefill is cut
    where each began, and each piece says which chunk it was and how many tokens it computed."""
    chunked = SLOW[:9] + [
        ev("prefill_chunk", 1.84, 0, num_tokens=512, num_computed_tokens=150),
        ev("prefill_chunk", 1.87, 0, num_tokens=90, num_computed_tokens=662),
    ] + SLOW[9:]  # fmt: skip
    (lane,) = build_timeline(audit_record(), chunked).lanes
    assert_tiles(lane)
    prefill = [s for s in lane.segments if s.kind == "prefill"]
    spans = [(round(s.start_s, 3), round(s.end_s, 3)) for s in prefill]
    assert spans == [(1.804, 1.84), (1.84, 1.87), (1.87, 1.9)]
    assert [s.facts["chunk"] for s in prefill] == [1, 2, 3]
    assert "chunk 1 of 3" in prefill[0].sentence and "150 prompt tokens" in prefill[0].sentence
    assert "chunk 2 of 3" in prefill[1].sentence and "512 prompt tokens" in prefill[1].sentence
    assert "90 prompt tokens" in prefill[2].sentence


def test_the_preemption_names_its_cause_to_an_operator_and_hides_it_from_a_tenant():
    operator = build_timeline(audit_record(), SLOW)
    segment = next(s for s in operator.lanes[0].segments if s.kind == "preempted")
    assert (segment.cause.priority, segment.cause.tenant) == (0, "acme")
    assert segment.cause.request_id == OTHER and not segment.cause.is_self
    assert [(name, round(a, 3), round(b, 3)) for name, a, b in segment.phases] == [
        ("swapped out to CPU", 3.1, 3.2),
        ("waiting for KV cache", 3.2, 3.5),
    ]
    gateway = operator.lanes[0].segments[0]
    assert [(name, round(a, 3), round(b, 3)) for name, a, b in gateway.phases] == [
        ("reading, tokenizing, checking limits", 0.0, 0.002),
        ("to the engine", 0.002, 0.004),
    ]
    tenant = build_timeline(audit_record(), SLOW, viewer_tenant="mine")
    hidden = next(s for s in tenant.lanes[0].segments if s.kind == "preempted")
    assert (hidden.cause.priority, hidden.cause.tenant, hidden.cause.request_id) == (0, None, None)
    everything = repr(tenant.to_dict())
    assert OTHER not in everything and "acme" not in everything and "globex" not in everything


def test_a_recompute_and_a_preemption_for_its_own_growth():
    events = [
        ev("received", 0.0),
        queued(0.001),
        ev("scheduled", 0.002, 0, num_tokens=64, num_cached_tokens=32),
        preempted(2.0, "recompute", by=f"{RID}-0", by_tenant="mine", num_blocks=3),
        ev("recompute_started", 2.5, 0, num_tokens=40, num_cached_tokens=0),
        ev("resumed", 2.5, 0, mode="recompute"),
        finished(3.0),
    ]
    (lane,) = build_timeline(audit_record(), events).lanes
    assert kinds(lane) == ["gateway", "queue", "prefill", "preempted", "prefill"]
    assert_tiles(lane)
    segment = lane.segments[3]
    assert segment.cause.is_self and segment.label == "preempted (to recompute)"
    assert ("recompute_started", 2.5) in [(m.kind, round(m.at_s, 3)) for m in lane.marks]
    assert "32 more came from the prefix cache" in lane.segments[2].sentence


def test_each_choice_gets_its_lane_and_a_refused_request_none():
    events = [ev("received", 0.0), ev("first_token", 1.0)]
    for choice, wait in ((0, 0.2), (1, 0.9)):
        events += [queued(0.001, choice), ev("scheduled", wait, choice), finished(2.0, choice)]
    timeline = build_timeline(audit_record(), events)
    assert [lane.choice for lane in timeline.lanes] == [0, 1]
    for lane in timeline.lanes:
        assert_tiles(lane)
    refused = build_timeline(
        audit_record(status="rejected", refusal_reason="rpm"),
        [ev("received", 0.0), ev("refused", 0.01, reason="rpm")],
    )
    assert refused.refused and refused.lanes == []
    assert "refused" in refused.sentences[0]


@pytest.mark.parametrize("seed", range(30))
def test_random_timelines_tile_and_their_delays_match_the_explanation(seed):
    rng = random.Random(seed)
    events, expected_delay = random_timeline(rng)
    rng.shuffle(events)
    (lane,) = build_timeline(audit_record(), events).lanes
    assert_tiles(lane)
    delay = sum(s.duration_s for s in lane.segments if s.kind not in ("prefill", "decode"))
    assert delay == pytest.approx(expected_delay, rel=1e-9, abs=1e-9)


# ---- drawing and rendering ---------------------------------------------------------------------
def test_the_axis_has_round_steps_and_neighbours_share_it():
    assert [nice_step(x) for x in (0.0007, 0.03, 0.12, 0.6, 4.0)] == [0.001, 0.05, 0.2, 1, 5]
    timeline = build_timeline(audit_record(), SLOW)
    other = build_timeline(audit_record(id=OTHER), SLOW)
    drawing = draw(timeline, [Neighbour(other, -1.0)])
    assert [row.request_id for row in drawing.rows] == [None, OTHER]
    own, neighbour = drawing.rows
    # the neighbour arrived 1 s earlier: its segments sit 1 s to the left of the same ones
    step = (own.boxes[1].x - own.boxes[0].x) / (own.boxes[1].segment.start_s - 0.0)
    assert own.boxes[0].x - neighbour.boxes[0].x == pytest.approx(step * 1.0)
    assert drawing.ticks[0].text.startswith("-1")


HOSTILE = '<script>alert("x")</script>'


def test_every_string_is_escaped_and_the_policy_is_strict():
    events = [e if e["kind"] != "preempted" else preempted(3.1, "swap", by_tenant=HOSTILE)
              for e in SLOW]  # fmt: skip
    timeline = build_timeline(audit_record(), events)  # an operator sees tenant names
    response = render.timeline_page(timeline, [], prefix="/admin", operator=True)
    html = response.text
    assert HOSTILE not in html and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html
    assert html.count("<script") == 1  # the page's own, from /pages/static
    policy = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "style-src 'self'" in policy
    assert "default-src 'none'" in policy and "unsafe" not in policy
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    missing = render.not_found_page(HOSTILE, prefix="/v1", operator=False)
    assert missing.status == 404 and HOSTILE not in missing.text


def test_a_refused_request_gets_a_page_without_a_chart():
    refused = build_timeline(
        audit_record(status="rejected", refusal_reason="rpm"),
        [ev("received", 0.0), ev("refused", 0.01, reason="rpm")],
    )
    html = render.timeline_page(refused, [], prefix="/v1", operator=False).text
    assert 'id="timeline"' not in html and "never reached the engine" in html
    assert "The request was refused after 10 ms" in html


def test_the_decode_rate_is_drawn_along_the_decode():
    """The gateway notes a choice's output count every DECODE_PROGRESS_EVERY tokens; the lane
    carries the rate between those points and the page draws it as a line with its values."""
    progress = [
        ev("decode_progress", 2.22, 0, num_output_tokens=33),  # 32 tokens in 0.32 s
        ev("decode_progress", 2.86, 0, num_output_tokens=65),  # 32 tokens in 0.64 s
    ]
    (lane,) = build_timeline(audit_record(), SLOW + progress).lanes
    assert [(round(at, 2), round(rate, 1)) for at, rate in lane.rate_points] == [
        (2.22, 100.0),
        (2.86, 50.0),
    ]
    timeline = build_timeline(audit_record(), SLOW + progress)
    page = render.timeline_page(timeline, [], prefix="/admin", operator=True).text
    assert 'class="rate"' in page and 'data-rates="100.00 50.00 "' in page
