"""The geometry of a timeline drawing: where each segment, mark and tick lands in the SVG, in
user units of a fixed-width view box (the browser scales it to the page)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.audit.timeline import Lane, Mark, Segment, Timeline

WIDTH = 1000.0  # view box units across the whole timeline
LEFT = 90.0  # room for the lane's name
LANE_HEIGHT = 46.0
BAR_HEIGHT = 26.0
AXIS_HEIGHT = 30.0
MIN_BAR = 1.0  # a segment shorter than a unit is still drawn one unit wide


@dataclass
class Box:
    segment: Segment
    x: float
    y: float
    width: float
    height: float
    show_label: bool


@dataclass
class Tick:
    x: float
    text: str


@dataclass
class MarkLine:
    mark: Mark
    x: float
    y1: float
    y2: float


@dataclass
class Drawing:
    height: float
    boxes: list[Box]
    marks: list[MarkLine]
    ticks: list[Tick]
    lanes: list[tuple[Lane, float]]  # each lane and its y


class Scale:
    def __init__(self, total_s: float) -> None:
        self.total_s = total_s if total_s > 0 else 1.0

    def x(self, at_s: float) -> float:
        return LEFT + (WIDTH - LEFT) * min(max(at_s, 0.0), self.total_s) / self.total_s


def draw(timeline: Timeline) -> Drawing:
    scale = Scale(timeline.total_s)
    boxes, marks, lanes = [], [], []
    for index, lane in enumerate(timeline.lanes):
        y = AXIS_HEIGHT + index * LANE_HEIGHT
        lanes.append((lane, y))
        boxes += [box_of(segment, scale, y) for segment in lane.segments]
        marks += [MarkLine(m, scale.x(m.at_s), y, y + BAR_HEIGHT) for m in lane.marks]
    bottom = AXIS_HEIGHT + max(len(timeline.lanes), 1) * LANE_HEIGHT
    marks += [MarkLine(m, scale.x(m.at_s), AXIS_HEIGHT - 6, bottom) for m in timeline.marks]
    return Drawing(bottom + 10, boxes, marks, ticks(scale), lanes)


def box_of(segment: Segment, scale: Scale, y: float) -> Box:
    x = scale.x(segment.start_s)
    width = max(scale.x(segment.end_s) - x, MIN_BAR)
    return Box(segment, x, y, width, BAR_HEIGHT, show_label=width > 7 * len(segment.label) + 8)


def ticks(scale: Scale) -> list[Tick]:
    step = nice_step(scale.total_s / 8)
    count = int(scale.total_s / step + 1e-9)
    return [Tick(scale.x(i * step), tick_text(i * step, step)) for i in range(count + 1)]


def nice_step(rough: float) -> float:
    """1, 2 or 5 times a power of ten, at least `rough`."""
    power = 10 ** math.floor(math.log10(rough)) if rough > 0 else 1.0
    return next(m * power for m in (1, 2, 5, 10) if m * power >= rough)


def tick_text(at_s: float, step: float) -> str:
    if step < 0.1:
        return f"{at_s * 1000:.0f} ms"
    return f"{at_s:.1f} s" if step < 1 else f"{at_s:.0f} s"
