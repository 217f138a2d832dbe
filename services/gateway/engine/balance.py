"""--auto-rebalance's policy: when to re-split a pipeline live, from its stages' /info polls alone (pure: no socket,
no task; the engine asks it at every step and runs the re-split it names, Engine.resplit).

Over each window (--rebalance-window) every stage's busy seconds per micro-batch is the same work's time there (every
micro-batch passes every stage; the last stage's head timed apart, a stage under a CPU limit priced at its CPU time
over the limit: StageTime.measured), so its time per layer is that over its layers: shared.runtime.plan.proposal turns
those into the split that balances them and the gain predicted for it, as `stagemesh rebalance` does. Hysteresis,
so that the split does not flap: a split is proposed only when two windows in a row each predict at least
--rebalance-gain and move every boundary the same way (each then moves as far as the more cautious of the two says); after a re-split, done or refused, it measures afresh, so two whole windows of the
split now serving must agree again before the next. A layer moves at most to a neighbouring stage per re-split: a
proposal further away is approached one step at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.errors import LayerRangeError, StagemeshError
from shared.files.layers import LayerRange, check_resplit, split_at
from shared.runtime.plan import MIN_MICROBATCHES, ModelFacts, StageTime, proposal
from shared.wire.stage_info import StageInfo

log = logging.getLogger("stagemesh.gateway.balance")


@dataclass(frozen=True)
class Reading:
    """One reading of the stages' counters, what a window measures from: each stage's layers, incarnation and cumulative busy / micro-batch counters."""

    at: float
    layers: tuple[tuple[int, int], ...]
    incarnations: tuple[str, ...]
    busy: tuple[float, ...]
    head: tuple[float, ...]  # of busy, the last stage's head (final norm + lm_head + sampling)
    cpu: tuple[float, ...]  # CPU seconds of each stage's process ...
    cpu_limit: tuple[float, ...]  # ... and the cores its cgroup may use (0: no limit)
    microbatches: tuple[int, ...]

    @classmethod
    def of(cls, infos: list[StageInfo]) -> Reading:
        """`at`: the first stage's own clock at its poll (polls come every few seconds: the gateway's clock would
        stretch a window over polls it did not see)."""
        return cls(infos[0].clock_s, tuple(tuple(i.layers) for i in infos), tuple(i.incarnation for i in infos),
                   tuple(i.busy_seconds for i in infos), tuple(i.head_seconds for i in infos),
                   tuple(i.cpu_seconds for i in infos), tuple(i.cpu_limit for i in infos),
                   tuple(i.microbatches for i in infos))


def toward(old: list[LayerRange], target: list[LayerRange], num_layers: int) -> list[LayerRange] | None:
    """The split one live re-split can move `old` to on the way to `target`: each boundary as far toward its target
    as moving layers only between neighbours allows. None when that is `old` itself."""
    before = [r.stop for r in old[:-1]]
    points = []
    for i, b in enumerate(r.stop for r in target[:-1]):
        lo = before[i - 1] if i > 0 else 1
        hi = before[i + 1] if i + 1 < len(before) else num_layers - 1
        points.append(min(max(b, lo), hi))
    if points == before:
        return None
    try:
        ranges = split_at(num_layers, points)
        check_resplit(old, ranges, num_layers)
    except LayerRangeError:
        return None
    return ranges


class Balancer:
    def __init__(self, model: ModelFacts, window_s: float, min_gain: float):
        self.model = model
        self.window_s = window_s
        self.min_gain = min_gain
        self._start: Reading | None = None
        self._last: tuple[int, ...] | None = None  # the boundaries the last window proposed (a candidate)
        self.last_proposal: dict | None = None  # the last window's proposal (for /v1/mesh)

    def observe(self, infos: list[StageInfo], running: int) -> list[LayerRange] | None:
        """The split to move to now, or None. `infos`: the stages' last /info polls (all answering); `running`:
        requests running (the streams the gain is predicted for)."""
        sample = Reading.of(infos)
        now = sample.at
        start = self._start
        if start is None or start.layers != sample.layers or start.incarnations != sample.incarnations:
            self._start, self._last = sample, None  # a new window: the split or a stage changed
            return None
        if now - start.at < self.window_s:
            return None
        self._start = sample
        passed = [b - a for a, b in zip(start.microbatches, sample.microbatches)]
        if min(passed) < MIN_MICROBATCHES:
            self._last = None
            return None
        # the last stage's head timed apart: it does not move with the layers (a head priced in layers, as
        # ModelConfig.head_cost_in_layers does, makes a split under-move where the head costs more than that); a
        # stage under a CPU limit priced at its CPU time over the limit where that is longer (StageTime.measured)
        times = [StageTime.measured(LayerRange(*sample.layers[i]), passed[i], sample.busy[i] - start.busy[i],
                                    max(0.0, sample.head[i] - start.head[i]), max(0.0, sample.cpu[i] - start.cpu[i]),
                                    sample.cpu_limit[i])
                 for i in range(len(passed))]
        result = proposal(self.model, times, max(1, running))
        self.last_proposal = result
        gain = result["predicted_gain"]
        if result["split_proposed"] == result["split_now"] or gain < self.min_gain:
            self._last = None
            return None
        old = [t.layers for t in times]
        target = split_at(self.model.num_layers, [int(b) for b in result["split_proposed"].split(",")])
        step = toward(old, target, self.model.num_layers)
        points = tuple(r.stop for r in step[:-1]) if step else None
        last, self._last = self._last, points
        now_points = [r.stop for r in old[:-1]]
        if points is None or last is None or any((a > o) != (b > o) or (a < o) != (b < o)
                                                 for a, b, o in zip(points, last, now_points)):
            return None  # a candidate: the next window must move every boundary the same way
        self._last = None
        # of the two windows' proposals, each boundary moves the shorter way (a noisy window does not overshoot)
        step = split_at(self.model.num_layers, [min(a, b, key=lambda x: abs(x - o))
                                                for a, b, o in zip(points, last, now_points)])
        log.info("auto-rebalance: two windows propose split %s (now %s, predicted gain %.2fx at %d streams)",
                 result["split_proposed"], result["split_now"], gain, max(1, running))
        return step

    def resplit_ended(self) -> None:
        """A re-split was done or refused: measure afresh (two whole windows agree before the next)."""
        self._start, self._last = None, None


SPLIT_AUTO_WAITING = "choosing the split by measurement (--split auto): the stages' calibrations, then a re-split"


class StartSplit:
    """--split auto's one decision at start: every stage calibrated its own layers on its own host before it reported
    ready (StageInfo.calibration: ms a decode step at the batch sizes asked, free bytes); the split that balances
    those times within each host's free memory is shared.runtime.plan.proposal's, as `stagemesh rebalance` proposes
    from a mesh at work. The engine moves the mesh there by live re-splits (each a neighbour-sized step: `toward`)
    before the pipeline counts as ready. `state`: pending -> moving -> done | failed (the mesh serves the split it
    has, the error says why)."""

    def __init__(self, model: ModelFacts):
        self.model = model
        self.state = "pending"
        self.error: str | None = None
        self.proposal: dict | None = None  # proposal()'s answer, with each stage's calibration beside it

    @property
    def settled(self) -> bool:
        return self.state in ("done", "failed")

    def target(self, infos: list[StageInfo]) -> list[LayerRange]:
        """The split to serve, from the stages' calibrations; StagemeshError naming the stage that has none, or why
        no split fits."""
        if len(infos) < 2:  # one stage holds every layer: nothing to balance
            return [LayerRange(*info.layers) for info in infos]
        missing = [i for i, info in enumerate(infos) if not info.calibration or not info.calibration.get("rows")]
        if missing:
            raise StagemeshError(f"stage {missing[0]} reports no calibration: start every stage with --calibrate "
                                 "ROWS (`up --split auto` does) for a gateway with --split auto")
        rows = [max(info.calibration["rows"]) for info in infos]  # the largest batch: the busy pipeline's
        times = []
        for info, b in zip(infos, rows):
            c, k = info.calibration, info.calibration["rows"].index(b)
            times.append(StageTime(LayerRange(*info.layers), c["ms_per_step"][k],
                                   c["head_ms"][k] if c.get("head_ms") else None))
        # the batch every stage timed: with one micro-batch in flight per stage, b rows each is b * stages streams
        streams = min(rows) * len(infos)
        result = proposal(self.model, times, streams, [int(info.calibration["free_bytes"]) for info in infos])
        for stage, info in zip(result["stages"], infos):
            stage["calibration"] = info.calibration
        self.proposal = result
        return split_at(self.model.num_layers, [int(b) for b in result["split_proposed"].split(",")])

    def info(self) -> dict:
        """What /v1/mesh shows: the state, the split chosen and the prediction it came from, and that in one line
        (`summary`: what `stagemesh status` and the mesh view print)."""
        return {"state": self.state, "error": self.error, "proposal": self.proposal, "summary": self.summary()}

    def summary(self) -> str:
        p = self.proposal
        if self.state == "failed":
            return f"--split auto failed ({self.error}); serving the split the stages started with"
        if p is None:
            return f"--split auto: {self.state}"
        rows = min(max(s["calibration"]["rows"]) for s in p["stages"])
        head = {"done": "chosen by measurement", "moving": "moving to it", "pending": "measuring"}[self.state]
        per_layer = " / ".join(f"{s['ms_per_layer']:.3g}" for s in p["stages"])
        return (f"split {p['split_proposed'] or '-'} {head}: ms per layer {per_layer} at {rows} rows a step; slowest stage "
                f"{p['slowest_stage_ms_now']:.3g} -> {p['slowest_stage_ms_proposed']:.3g} ms, predicted "
                f"{p['predicted_gain']:.2f}x the split {p['split_now'] or '-'} the stages started with")
