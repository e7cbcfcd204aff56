"""benchmarks/spec_sweep.py's table and SVG plot from sweep points (the sweep itself is a
benchmark: it times a real model and asserts nothing about speed)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from benchmarks.spec_sweep import MODES, named_choices, summary, svg_plot, table


def point(workload: str, concurrency: int, off: float, policy: float, fixed: float) -> dict:
    return {
        "workload": workload, "concurrency": concurrency,
        "off": {"tok_s": off, "acceptance": None, "k_rows": {}},
        "policy": {"tok_s": policy, "acceptance": 0.5, "k_rows": {0: 3, 2: 5}},
        "fixed k": {"tok_s": fixed, "acceptance": 0.25, "k_rows": {5: 8}},
    }  # fmt: skip


POINTS = [point("copy", 1, 40, 60, 62), point("copy", 16, 280, 281, 160),
          point("chat", 1, 70, 68, 56), point("chat", 16, 360, 365, 200)]  # fmt: skip


def test_table_gives_speedups_acceptance_and_ks():
    text = table(POINTS)
    assert "60.0 (1.50x, 0.50)" in text and "160.0 (0.57x, 0.25)" in text
    assert "0: 3, 2: 5" in text and len(text.splitlines()) >= 1 + len(POINTS)


def test_plot_is_svg_with_a_line_per_workload_and_mode():
    root = ET.fromstring(svg_plot(POINTS, "ngram"))
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 * (len(MODES) - 1)
    # the policy's copy line: speedups 1.5 then ~1.0, so its second point is lower in the image
    first = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert len(first) == 2 and first[0][0] < first[1][0] and first[0][1] < first[1][1]
    labels = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"copy, policy", "chat, fixed k", "1", "16", "1.00x"} <= labels


def measured(tok_s: float) -> dict:
    return {"tok_s": tok_s, "acceptance": 0.5, "k_rows": {1: 4}}


def test_rounds_keep_each_modes_fastest_and_the_median_of_paired_speedups():
    """A round whose off ran in a slow minute reads a high speedup: the fastest of each mode
    (60 / 50) and the median of the rounds' own ratios (0.95, 1.0, 1.6) tell different stories,
    and both are reported."""
    rounds = [{"off": measured(50), "policy": measured(47.5)},
              {"off": measured(40), "policy": measured(40)},
              {"off": measured(25), "policy": measured(40)}]  # fmt: skip
    modes = summary(rounds)
    assert modes["off"]["tok_s"] == 50 and "median_speedup" not in modes["off"]
    assert modes["policy"]["tok_s"] == 47.5
    assert modes["policy"]["median_speedup"] == pytest.approx(1.0)
    point = {"workload": "chat", "concurrency": 1} | modes
    text = table([point])
    assert "47.5 (0.95x, 0.50, median 1.00x)" in text and "fixed k" not in text


def test_a_sweep_without_fixed_k_plots_the_policy_alone():
    points = [{"workload": w, "concurrency": c, "off": measured(40), "policy": measured(44)}
              for w in ("chat", "tips") for c in (1, 4)]  # fmt: skip
    root = ET.fromstring(svg_plot(points, "draft"))
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2


def test_workloads_and_modes_are_checked_by_name():
    assert named_choices("chat, water", ("copy", "chat", "water")) == ("chat", "water")
    with pytest.raises(SystemExit, match="unknown poetry"):
        named_choices("chat,poetry", ("copy", "chat"))
    with pytest.raises(SystemExit, match="empty"):
        named_choices(" , ", ("copy",))
