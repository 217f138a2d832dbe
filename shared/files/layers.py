"""Layer ranges and how a model is split into stages: small pure functions."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.errors import LayerRangeError


class StagePosition(str, enum.Enum):
    """Where a stage sits in its pipeline; decides embed / lm_head duty explicitly, never by guessing."""

    FIRST = "first"  # embeds token ids, hands hidden state on
    MIDDLE = "middle"  # hidden in, hidden out
    LAST = "last"  # hidden in, norm + lm_head + sampling
    ONLY = "only"  # the whole model in one stage

    @property
    def has_embedding(self) -> bool:
        return self in (StagePosition.FIRST, StagePosition.ONLY)

    @property
    def has_lm_head(self) -> bool:
        return self in (StagePosition.LAST, StagePosition.ONLY)


@dataclass(frozen=True, order=True)
class LayerRange:
    """Half-open range [start, stop) of transformer layers."""

    start: int
    stop: int

    def __post_init__(self):
        if not (0 <= self.start < self.stop):
            raise LayerRangeError(f"layer range {self} is empty or negative; write it as START:STOP with START < STOP")

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    def position(self, num_layers: int) -> StagePosition:
        if self.stop > num_layers:
            raise LayerRangeError(f"layer range {self} goes past the model's {num_layers} layers")
        first, last = self.start == 0, self.stop == num_layers
        if first and last:
            return StagePosition.ONLY
        return StagePosition.FIRST if first else StagePosition.LAST if last else StagePosition.MIDDLE


def parse_layer_range(text: str, num_layers: int | None = None) -> LayerRange:
    """'a:b' -> LayerRange(a, b); an empty side means the model's edge."""
    try:
        a, b = text.split(":")
        start = int(a) if a.strip() else 0
        if b.strip():
            stop = int(b)
        elif num_layers is not None:
            stop = num_layers
        else:
            raise ValueError
    except ValueError:
        raise LayerRangeError(f"--layers {text!r} is not START:STOP (for example 0:15)") from None
    rng = LayerRange(start, stop)
    if num_layers is not None:
        rng.position(num_layers)  # validates the upper bound
    return rng


def balanced_split(num_layers: int, num_stages: int, head_cost: float = 0.0) -> list[LayerRange]:
    """Contiguous ranges of equal compute, counting the last stage's lm_head as `head_cost` layers
    (ModelConfig.head_cost_in_layers: about 4.4 for SmolLM2, measured). With head_cost=0 the ranges' sizes
    differ by at most one layer. The one planning function of a split into stages."""
    if not 1 <= num_stages <= num_layers:
        raise LayerRangeError(f"cannot split {num_layers} layers into {num_stages} stages; use 1..{num_layers}")
    total = num_layers + head_cost
    bounds = [0]
    for i in range(1, num_stages):
        b = round(i * total / num_stages)
        b = max(bounds[-1] + 1, min(b, num_layers - (num_stages - i)))  # every stage keeps at least one layer
        bounds.append(b)
    bounds.append(num_layers)
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


def split_at(num_layers: int, boundaries: list[int]) -> list[LayerRange]:
    """`--split 7,19` on 30 layers -> 0:7, 7:19, 19:30."""
    edges = [0, *boundaries, num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise LayerRangeError(
            f"split points {boundaries} must be strictly increasing and inside 1..{num_layers - 1}"
        )
    return [LayerRange(a, b) for a, b in zip(edges, edges[1:])]


def parse_split(text: str, num_layers: int) -> list[LayerRange]:
    """'7,19' -> 0:7, 7:19, 19:num_layers (the --split flag of generate, perplexity and trace runs)."""
    try:
        points = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LayerRangeError(f"split {text!r} must be comma-separated layer numbers, e.g. 7,19") from None
    return split_at(num_layers, points)


def check_cover(ranges: list[LayerRange], num_layers: int) -> None:
    """Raise unless the ranges are contiguous and cover every layer exactly once, naming the gap or overlap."""
    ordered = sorted(ranges)
    expected = 0
    for rng in ordered:
        if rng.start > expected:
            raise LayerRangeError(f"layers {expected}:{rng.start} are served by no stage (gap before {rng})")
        if rng.start < expected:
            raise LayerRangeError(f"layers {rng.start}:{expected} are served twice (overlap at {rng})")
        expected = rng.stop
    if expected != num_layers:
        raise LayerRangeError(f"layers {expected}:{num_layers} are served by no stage (the model has {num_layers})")


def check_resplit(old: list[LayerRange], new: list[LayerRange], num_layers: int) -> None:
    """Raise (LayerRangeError, naming what is wrong) unless `new` is a split the stages now serving `old` can move
    to live: as many stages, both splits contiguous in pipeline order and covering every layer, every stage keeping
    at least one layer (so none changes position: the first still embeds, the last still holds the lm_head), and
    every layer moving at most to a neighbouring stage (its K/V travels one hop)."""
    if len(new) != len(old):
        raise LayerRangeError(f"the split has {len(new)} stages and the mesh {len(old)}: a re-split moves layers "
                              f"between the stages there are (give {len(old) - 1} layer boundaries)")
    for name, ranges in (("the mesh's split", old), ("the new split", new)):
        edges = [r.start for r in ranges] + [num_layers]
        if ranges[0].start != 0 or any(r.stop != e for r, e in zip(ranges, edges[1:])):
            raise LayerRangeError(f"{name} {', '.join(map(str, ranges))} is not contiguous from 0 to {num_layers}: "
                                  "each stage must start where the one before it stops")
    owner_old = [i for i, r in enumerate(old) for _ in r]
    owner_new = [i for i, r in enumerate(new) for _ in r]
    for layer, (a, b) in enumerate(zip(owner_old, owner_new)):
        if abs(a - b) > 1:
            raise LayerRangeError(f"layer {layer} would move from stage {a} to stage {b}: a re-split moves layers only "
                                  "between neighbouring stages (their K/V moves one hop); split the move into steps")


def boundaries(ranges: list[LayerRange]) -> str:
    """0:15, 15:30 -> "15" (the --split form of a split)."""
    return ",".join(str(r.stop) for r in ranges[:-1])
