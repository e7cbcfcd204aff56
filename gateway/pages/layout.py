"""The geometry of a timeline drawing: where each segment, mark and tick lands in the SVG, in
user units of a fixed-width view box (the browser scales it to the page). Rows are the
request's own lanes (one per choice), then its neighbours: the requests that preempted it,
placed on the same axis by their arrival times."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.audit.timeline import Lane, Mark, Segment, Timeline

WIDTH = 1000.0  # view box units across the whole timeline
LEFT = 110.0  # room for the row's name
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
class Neighbour:
    """A request that preempted this one, `offset_s` after (or before) this one arrived."""

    timeline: Timeline
    offset_s: float
    link: str | None = None


@dataclass
class Row:
    title: str
    subtitle: str
    y: float
    lane: Lane
    boxes: list[Box] = field(default_factory=list)
    marks: list[MarkLine] = field(default_factory=list)
    request_id: str | None = None  # set on a neighbour's row
    link: str | None = None
    rate_line: list[tuple[float, float, float]] = field(default_factory=list)  # (x, y, tok/s)


@dataclass
class Drawing:
    height: float
    rows: list[Row]
    marks: list[MarkLine]  # the request's own, across its lanes
    ticks: list[Tick]


class Scale:
    """Seconds after this request arrived -> view box x, over [start_s, end_s]."""

    def __init__(self, start_s: float, end_s: float) -> None:
        self.start_s = start_s
        self.span_s = end_s - start_s if end_s > start_s else 1.0

    def x(self, at_s: float) -> float:
        fraction = min(max((at_s - self.start_s) / self.span_s, 0.0), 1.0)
        return LEFT + (WIDTH - LEFT) * fraction


def draw(timeline: Timeline, neighbours: list[Neighbour] = ()) -> Drawing:
    start = min([0.0] + [n.offset_s for n in neighbours])
    end = max([timeline.total_s] + [n.offset_s + n.timeline.total_s for n in neighbours])
    scale = Scale(start, end)
    rows = [own_row(lane, scale, index) for index, lane in enumerate(timeline.lanes)]
    for neighbour in neighbours:
        for lane in neighbour.timeline.lanes[:1]:
            rows.append(neighbour_row(neighbour, lane, scale, len(rows)))
    bottom = AXIS_HEIGHT + max(len(timeline.lanes), 1) * LANE_HEIGHT
    marks = [MarkLine(m, scale.x(m.at_s), AXIS_HEIGHT - 6, bottom) for m in timeline.marks]
    height = AXIS_HEIGHT + max(len(rows), 1) * LANE_HEIGHT + 10
    return Drawing(height, rows, marks, ticks(scale))


def own_row(lane: Lane, scale: Scale, index: int) -> Row:
    rate = f"{lane.tokens_per_s:.1f} tok/s" if lane.tokens_per_s is not None else ""
    row = Row(f"choice {lane.choice}", rate, AXIS_HEIGHT + index * LANE_HEIGHT, lane)
    fill_row(row, lane, scale, 0.0)
    row.rate_line = rate_line(lane, scale, row.y)
    return row


def rate_line(lane: Lane, scale: Scale, y: float) -> list[tuple[float, float, float]]:
    """The decode rate along the lane, drawn inside its bar: the fastest interval at the top."""
    if len(lane.rate_points) < 2:
        return []
    fastest = max(rate for _, rate in lane.rate_points)
    return [
        (scale.x(at_s), y + BAR_HEIGHT - 2 - (BAR_HEIGHT - 4) * rate / fastest, rate)
        for at_s, rate in lane.rate_points
    ]


def neighbour_row(neighbour: Neighbour, lane: Lane, scale: Scale, index: int) -> Row:
    other = neighbour.timeline
    subtitle = f"priority {other.priority}" if other.priority is not None else ""
    row = Row(f"{other.request_id[:8]}…", subtitle, AXIS_HEIGHT + index * LANE_HEIGHT, lane)
    row.request_id, row.link = other.request_id, neighbour.link
    fill_row(row, lane, scale, neighbour.offset_s)
    return row


def fill_row(row: Row, lane: Lane, scale: Scale, offset_s: float) -> None:
    row.boxes = [box_of(s, scale, row.y, offset_s) for s in lane.segments]
    row.marks = [
        MarkLine(m, scale.x(m.at_s + offset_s), row.y, row.y + BAR_HEIGHT) for m in lane.marks
    ]


def box_of(segment: Segment, scale: Scale, y: float, offset_s: float) -> Box:
    x = scale.x(segment.start_s + offset_s)
    width = max(scale.x(segment.end_s + offset_s) - x, MIN_BAR)
    return Box(segment, x, y, width, BAR_HEIGHT, show_label=width > 7 * len(segment.label) + 8)


def ticks(scale: Scale) -> list[Tick]:
    step = nice_step(scale.span_s / 8)
    first = math.ceil(scale.start_s / step - 1e-9)
    last = math.floor((scale.start_s + scale.span_s) / step + 1e-9)
    return [Tick(scale.x(i * step), tick_text(i * step, step)) for i in range(first, last + 1)]


def nice_step(rough: float) -> float:
    """1, 2 or 5 times a power of ten, at least `rough`."""
    power = 10 ** math.floor(math.log10(rough)) if rough > 0 else 1.0
    return next(m * power for m in (1, 2, 5, 10) if m * power >= rough)


def tick_text(at_s: float, step: float) -> str:
    if step < 0.1:
        return f"{at_s * 1000:.0f} ms"
    return f"{at_s:.1f} s" if step < 1 else f"{at_s:.0f} s"
