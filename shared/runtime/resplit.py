"""One stage's side of a live re-split: the layers it gains are loaded from its own copy of the file, the K/V of
live sequences for the layers that change stage moves between the two neighbours, and the stage serves its new
range from the commit on. The gateway drives it (services/gateway/engine/core.py Engine.resplit): it stops issuing
micro-batches, waits for those in flight, and sends one Resplit message per phase through the pipeline; each stage
does its part and passes the message on, so when it comes back every stage has done that phase.

  prepare  check the plan (shared.files.layers.check_resplit), find this stage in it, load the new range (a second
           runtime beside the serving one; its KV cache empty)
  move     send a KVParcel per sequence (and chunk of layers) for the layers this stage gives each neighbour, ahead
           of the Resplit: a downstream neighbour's parcels arrive on the link to it, an upstream one's travel on
           around the ring (the later stages and the gateway pass them on) -- both before the commit reaches it
  commit   the new runtime takes over every sequence's rows (KVCache.take_over: the layers it keeps) with the
           parcels' layers written in; a sequence that missed a parcel is released (its next step answers
           unknown_sequence and the gateway replays it, which no request sees but as a delay)
  abort    the prepared runtime is dropped (a stage refused the plan; the mesh serves on with the old split)
  commit again, unprepared (recommit): after a commit the gateway could not confirm (a stage died in it), it sends
           the commit again until every stage has answered it: a stage already on its new range does nothing, one
           still on its old range (restarted with it) loads the new one with an empty cache

Nothing here is a socket: the worker (services/stage/worker.py) sends what these methods return. Every method runs on
the stage's compute thread, between micro-batches."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shared.errors import BadBatch, StagemeshError
from shared.files.layers import LayerRange, check_resplit
from shared.models.kv_cache import KVCache
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import MAX_TENSOR_BYTES, KVParcel, Resplit

log = logging.getLogger("stagemesh.resplit")

PARCEL_BYTES = 32 << 20  # K/V of one parcel at most (several layers of one sequence), well under the message bound


class ResplitRefused(StagemeshError):
    """This stage cannot take part in the re-split asked for (the message says why); the mesh keeps its split."""


@dataclass
class Pending:
    """A re-split this stage has prepared and not yet committed or dropped."""

    rid: int
    index: int  # this stage's place in the pipeline
    old: list[LayerRange]
    new: list[LayerRange]
    runtime: StageRuntime | None  # the new range's runtime (None: this stage's layers do not change)
    received: dict[str, tuple[set[int], int]] = field(default_factory=dict)  # seq -> (layers taken, least length)
    report: dict = field(default_factory=dict)  # numbers for the gateway's log


def kv_parcels(kv: KVCache, mine: LayerRange, given: range, rid: int, to: int,
               kept: bool = False) -> Iterator[KVParcel]:
    """The K/V `kv` (a cache of layers `mine`) holds for the layers `given`, every sequence's, for stage `to`, in
    parcels of at most PARCEL_BYTES (one layer at least) in layer order. `kept`: cached prefixes go too, marked kept
    (a membership change's; a re-split's new cache takes every row over itself)."""
    for seq_id in kv.holders if given else ():
        slot, n = kv.row_of(seq_id)
        per_layer = max(1, 2 * kv.k[0][slot, :, :n].nbytes)
        step = max(1, PARCEL_BYTES // per_layer)
        for a in range(given.start, given.stop, step):
            b = min(a + step, given.stop)
            local = range(a - mine.start, b - mine.start)
            k = torch.stack([kv.k[i][slot, :, :n] for i in local])  # [L, KVH, n, hd]
            v = torch.stack([kv.v[i][slot, :, :n] for i in local])
            yield KVParcel(rid, to, seq_id, a, b, k, v, kept and kv.is_kept(seq_id))


def _ranges(pairs: list[tuple[int, int]]) -> list[LayerRange]:
    return [LayerRange(a, b) for a, b in pairs]


class StageResplit:
    """The re-split state of one stage (at most one pending at a time)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.pending: Pending | None = None

    # ---- prepare ----------------------------------------------------------------------------------------------

    def prepare(self, msg: Resplit, runtime: StageRuntime) -> dict:
        """Check the plan against the model and this stage, and load the new range. ResplitRefused (or the load's
        own error: a range that does not fit the memory budget) when it cannot."""
        self.pending = None
        old, new = _ranges(msg.old), _ranges(msg.new)
        check_resplit(old, new, self.num_layers)
        mine = runtime.model.layers
        if mine not in old:
            raise ResplitRefused(f"this stage serves layers {mine}, which the re-split's current split "
                                 f"{', '.join(map(str, old))} does not name: the gateway's view is stale; try again")
        index = old.index(mine)
        kv = runtime.kv
        longest = max((kv.row_of(seq_id)[1] for seq_id in kv.holders), default=0)
        per_layer = 2 * longest * kv.k[0].shape[1] * kv.k[0].shape[3] * kv.k[0].dtype.itemsize
        if per_layer > MAX_TENSOR_BYTES:  # one sequence's one layer is the smallest parcel
            raise ResplitRefused(f"one layer's K/V of the longest sequence held ({per_layer} bytes, {longest} "
                                 f"positions) is past the message bound of {MAX_TENSOR_BYTES} bytes; try again when "
                                 "it has ended")
        t0 = time.perf_counter()
        fresh = None if new[index] == mine else runtime.reload(new[index])
        self.pending = Pending(msg.rid, index, old, new, fresh)
        self.pending.report = {"stage": index, "load_s": round(time.perf_counter() - t0, 4), "sent_bytes": 0,
                               "received_bytes": 0, "parcels": 0, "released": 0}
        if fresh is not None:
            log.info("re-split %d: loaded layers %s (now %s) in %.2f s", msg.rid, new[index], mine,
                     time.perf_counter() - t0)
        return self.pending.report

    def _current(self, msg: Resplit) -> Pending:
        p = self.pending
        if p is None or p.rid != msg.rid:
            raise ResplitRefused(f"re-split {msg.rid} was not prepared on this stage (a {msg.phase} without its "
                                 "prepare: the stage restarted, or another re-split came between)")
        return p

    # ---- move -------------------------------------------------------------------------------------------------

    def parcels(self, msg: Resplit, runtime: StageRuntime) -> Iterator[KVParcel]:
        """The K/V of every sequence this stage holds for the layers it gives each neighbour, in parcels of at most
        PARCEL_BYTES (one layer at least)."""
        p = self._current(msg)
        mine = p.old[p.index]
        for to in (p.index - 1, p.index + 1):
            if not 0 <= to < len(p.new):
                continue
            given = range(max(mine.start, p.new[to].start), min(mine.stop, p.new[to].stop))
            for parcel in kv_parcels(runtime.kv, mine, given, p.rid, to):
                p.report["sent_bytes"] += parcel.nbytes
                yield parcel

    def take(self, parcel: KVParcel, runtime: StageRuntime) -> bool:
        """A parcel came in: False when it is for another stage (the caller passes it on); True when it was this
        stage's -- written into the prepared cache -- or is dropped (no re-split of its id pending here; logged).
        BadBatch when it is addressed here and does not fit the plan (wrong layers, shape or dtype): dropped, and
        its sequence is released at the commit like one that missed its parcel."""
        p = self.pending
        if p is None or parcel.rid != p.rid:
            log.warning("dropped K/V of %r for re-split %d, which is not pending here", parcel.seq_id, parcel.rid)
            return True
        if parcel.to != p.index:
            return False
        target, gained, old = p.runtime, p.new[p.index], p.old[p.index]
        if target is None or not all(gained.start <= layer < gained.stop and not old.start <= layer < old.stop
                                     for layer in range(parcel.start, parcel.stop)):
            raise BadBatch(f"K/V of layers {parcel.start}:{parcel.stop} sent to stage {p.index}, which gains "
                           f"{'nothing' if target is None else 'other layers'} in re-split {p.rid}")
        kv = target.kv
        if parcel.seq_id not in runtime.kv:
            log.info("re-split %d: K/V of %r arrived for a sequence this stage does not hold; dropped", p.rid,
                     parcel.seq_id)
            return True
        want = (kv.k[0].shape[1], kv.k[0].shape[3])
        if (parcel.k.shape[1], parcel.k.shape[3]) != want or parcel.k.dtype != kv.k[0].dtype \
                or parcel.length > kv.max_seq_len:
            raise BadBatch(f"K/V of {parcel.seq_id!r} is {parcel.k.dtype} {list(parcel.k.shape)}; this stage's "
                           f"cache holds {kv.k[0].dtype} [layers, {want[0]}, <= {kv.max_seq_len}, {want[1]}]")
        slot, _ = runtime.kv.row_of(parcel.seq_id)  # the new cache keeps every sequence's row (take_over)
        n = parcel.length
        for j, layer in enumerate(range(parcel.start, parcel.stop)):
            kv.k[layer - gained.start][slot, :, :n].copy_(parcel.k[j])
            kv.v[layer - gained.start][slot, :, :n].copy_(parcel.v[j])
        layers, least = p.received.get(parcel.seq_id, (set(), n))
        p.received[parcel.seq_id] = (layers | set(range(parcel.start, parcel.stop)), min(least, n))
        p.report["received_bytes"] += parcel.nbytes
        p.report["parcels"] += 1
        return True

    # ---- commit / abort ---------------------------------------------------------------------------------------

    def commit(self, msg: Resplit, runtime: StageRuntime, index: int | None = None) -> tuple[StageRuntime, dict]:
        """The runtime to serve with from now on (the prepared one, holding every sequence; or `runtime` itself
        when this stage's layers do not change) and the stage's report. `index`: this stage's place in the pipeline
        when it was started with one (needed only for a commit it has not prepared: recommit)."""
        if self.pending is None or self.pending.rid != msg.rid:
            return self.recommit(msg, runtime, index)
        p = self._current(msg)
        self.pending = None
        if p.runtime is None:
            return runtime, p.report
        new, old = p.new[p.index], p.old[p.index]
        kv = p.runtime.kv
        kept = {layer - new.start: layer - old.start for layer in new if layer in old}
        kv.take_over(runtime.kv, kept)  # the gained layers' rows hold what the parcels wrote (take)
        gained = {layer for layer in new if layer not in old}
        for seq_id in kv.holders if gained else ():
            layers, least = p.received.get(seq_id, (set(), 0))
            if not gained <= layers or least < kv.row_of(seq_id)[1]:
                kv.release(seq_id)  # its next step answers unknown_sequence: the gateway replays it
                p.report["released"] += 1
        if p.report["released"]:
            log.warning("re-split %d: released %d sequences whose K/V for layers %s did not all arrive (they are "
                        "replayed)", p.rid, p.report["released"], new)
        return p.runtime, p.report

    def recommit(self, msg: Resplit, runtime: StageRuntime, index: int | None) -> tuple[StageRuntime, dict]:
        """A commit this stage did not prepare: the gateway sends it again after a commit it could not confirm (a
        stage died during it), so that every stage ends in the split it routes by (msg.new). A stage that already
        serves its new range (it committed before, or was restarted with it) has nothing to do; one that still
        serves its old range (restarted with it, or its prepare lost) loads the new one with an empty cache -- the
        gateway replays every running sequence after an unconfirmed commit, so no K/V is owed. ResplitRefused when
        this stage's range is in neither split."""
        old, new, mine = _ranges(msg.old), _ranges(msg.new), runtime.model.layers
        self.pending = None
        at = index if index is not None and index < len(new) and mine in (old[index], new[index]) else None
        if at is None:
            at = new.index(mine) if mine in new else old.index(mine) if mine in old else None
        if at is None:
            raise ResplitRefused(f"re-split {msg.rid} was not prepared on this stage and it serves layers {mine}, "
                                 f"in neither {', '.join(map(str, old))} nor {', '.join(map(str, new))}")
        report = {"stage": at, "load_s": 0.0, "sent_bytes": 0, "received_bytes": 0, "parcels": 0, "released": 0}
        if new[at] == mine:
            return runtime, report
        t0 = time.perf_counter()
        fresh = runtime.reload(new[at])
        report["load_s"] = round(time.perf_counter() - t0, 4)
        report["released"] = len(runtime.kv.holders)
        log.warning("re-split %d: committed without a prepare (sent again after an unconfirmed commit): loaded "
                    "layers %s (was %s) with an empty cache; %d sequences dropped (the gateway replays them)",
                    msg.rid, new[at], mine, report["released"])
        return fresh, report

    def abort(self) -> None:
        self.pending = None
