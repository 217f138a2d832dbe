"""One stage's side of a change of the mesh's members (a host joined, left or vanished:
services/gateway/engine/membership.py drives it). The gateway sends three membership phases of a Resplit, each naming
every place of the pipeline after the change (`members`: its process by incarnation, its layers, address, key), all
phases of one change under one rid:

  load    (old route, while the mesh serves) a stage whose layers change loads its new range beside the one it serves
  accept  (old route, micro-batches held) the receiver lets in its upstream-to-be as well as its upstream now; a
          stage the members do not name (it leaves) first sends the K/V of its layers to the members that take them
          (KVParcels, to: the taker's place after the change; one for an upstream taker travels around the ring)
  route   (new route) the stage serves its new range -- the layers it keeps with their K/V, the layers it gains with
          the parcels that came for them --, sends to the next member, lets in only its upstream member and the one
          before that (so that a member that vanishes is routed around without a message reaching this stage first),
          then passes the message on, which therefore comes back to the gateway only over the whole new route
  give    (new route, micro-batches still held; a join) a stage that gave layers away sends their K/V (the runtime it
          served before the route still holds it) to the member that held nothing at the route -- the joiner --
          ahead of this message

Invariant: a stage never computes a sequence from part of its K/V. A taker keeps a held sequence only when every
layer it gains came for it, at its length (else releases it); a joiner takes one only once all of its layers came
(KVCache.adopt). A sequence a stage lacks answers unknown_sequence and the gateway replays. After a loss no parcels
come: the taker releases what it held and the gateway replays every running request from its token history.

A stage that leaves passes each phase on unchanged. Nothing here is a socket call of its own:
ZmqTransport.route_to and accept_from change the stage's two sockets, on the compute thread."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from shared.errors import BadBatch, KVCacheFull
from shared.files.layers import LayerRange
from shared.observe.log_throttle import throttled
from shared.runtime.resplit import kv_parcels
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import KVParcel, Resplit

log = logging.getLogger("stagemesh.stage.membership")


def _key(value: str | None) -> bytes | None:
    return value.encode() if value else None


def neighbour_keys(msg: Resplit, place: int) -> tuple[bytes | None, bytes | None]:
    """The keys place `place` of msg.members lets in after the change: its upstream's (the gateway's sending key for
    the first place) and the one before that (the gateway's for the second place; none for the first)."""
    members, gateway = msg.members, msg.gateway
    upstream = _key(members[place - 1]["key"]) if place > 0 else _key(gateway["sends"])
    before = _key(members[place - 2]["key"]) if place > 1 else _key(gateway["sends"]) if place == 1 else None
    return upstream, before


@dataclass
class Receiving:
    """The parcels of the layers `gains` a stage takes in one change (rid): each sequence's layers kept aside, by
    layer. `whole` (a joiner, holding nothing): a sequence is taken into a slot of its own once all came; else (a
    taker, before its route) the route writes them into the rows of the sequences it holds."""

    rid: int
    gains: LayerRange
    whole: bool
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # seq -> layer -> k, v
    kept: set[str] = field(default_factory=set)  # sequences a parcel said are cached prefixes


class StageMembership:
    """The membership state of one stage in one change (its rid): its place after it, its new range loaded ahead of
    the route, the parcels it takes (Receiving), and after a route the runtime served before it while the give
    phase sends what it gave (giving)."""

    def __init__(self, worker):
        self.worker = worker  # the StageWorker whose sockets, runtime and identity change (it imports this module)
        self.rid: int | None = None
        self.at: int | None = None  # this stage's place after the change (None: it leaves)
        self.loaded: StageRuntime | None = None
        self.receiving: Receiving | None = None
        self.giving: StageRuntime | None = None

    def place(self, msg: Resplit) -> int | None:
        """This stage's place among msg.members (None: it is not one of them -- it leaves)."""
        me = self.worker.identity.incarnation
        return next((i for i, m in enumerate(msg.members) if m["incarnation"] == me), None)

    def begin(self, msg: Resplit) -> None:
        """On the compute thread, at each membership phase: a new rid is a new change (what the last one held goes);
        a stage that gains layers receives their parcels from here on."""
        if msg.rid != self.rid:
            self.forget()
            self.rid = msg.rid
        self.at = self.place(msg)
        if self.at is not None and self.receiving is None:
            a, b = msg.members[self.at]["layers"]
            mine = self.worker.runtime.model.layers
            if a < mine.start or b > mine.stop:  # it gains layers (one side: a member takes a neighbour's range)
                gains = LayerRange(a, mine.start) if a < mine.start else LayerRange(mine.stop, b)
                self.receiving = Receiving(msg.rid, gains, whole=False)

    def load(self, msg: Resplit, runtime: StageRuntime) -> None:
        """On the loader thread: this stage's new range, loaded beside the serving one (kept until the route)."""
        self.loaded = None
        at = self.place(msg)
        if at is None:
            return
        layers = LayerRange(*msg.members[at]["layers"])
        if layers == runtime.model.layers:
            return
        t0 = time.perf_counter()
        self.loaded = runtime.reload(layers)
        log.info("membership change %d: loaded layers %s (now %s) in %.2f s", msg.rid, layers, runtime.model.layers,
                 time.perf_counter() - t0)

    def accept(self, msg: Resplit) -> None:
        """On the compute thread: let the upstream-to-be in as well (the route comes over it); a leaver first sends
        its K/V to the members that take its layers."""
        at = self.place(msg)
        transport = self.worker.io.transport
        if at is not None and transport.keys is not None:
            upstream, before = neighbour_keys(msg, at)
            peer_also = (transport.keys.accept, upstream, before)
            transport.accept_from(transport.keys.accept, peer_also, transport.keys.accept_name)
        if at is None:
            sent = self._send(msg, self.worker.runtime, set())
            msg.report.append({"left": 1, "sent_bytes": sent})
        self.worker.io.send(msg)

    def route(self, msg: Resplit) -> None:
        """On the compute thread: serve this stage's place in the new route, then pass the message on along it."""
        worker = self.worker
        at = self.place(msg)
        if at is None:  # leaving: the route skips this stage (it passes on what still reaches it)
            worker.io.send(msg)
            return
        t0 = time.perf_counter()
        layers = LayerRange(*msg.members[at]["layers"])
        was_last = worker.identity.position.has_lm_head
        released = 0
        before = worker.runtime
        receiving, self.receiving = self.receiving, None
        if layers != before.model.layers:
            loaded, self.loaded = self.loaded, None
            if loaded is not None and loaded.model.layers == layers:
                runtime = loaded
            else:  # not loaded ahead (a member vanished: the route comes first), so now
                runtime = before.reload(layers)
            old = before.model.layers
            kept = {layer - layers.start: layer - old.start for layer in layers if layer in old}
            if kept and before.kv.holders:  # the layers it keeps keep their K/V
                runtime.kv.take_over(before.kv, kept)
                released = self._fill(runtime, layers, old, receiving)
            else:
                released = len(before.kv.holders)
            if before.kv.holders and any(layer not in layers for layer in old):
                self.giving = before  # until the give phase: the K/V of what it gave
            worker._serve_with(runtime)
        if not worker.runtime.kv.holders:  # holding nothing (a joiner): the give phase's parcels fill it
            self.receiving = Receiving(msg.rid, layers, whole=True)
        worker.identity.position = worker.runtime.model.position
        worker.identity.index = at
        transport = worker.io.transport
        last = at + 1 == len(msg.members)
        onward = msg.gateway if last else msg.members[at + 1]
        # (a last stage that stays last keeps the result address it was given)
        transport.route_to(transport.next_hop if last and was_last else onward["address"], _key(onward["key"]))
        upstream, before_key = neighbour_keys(msg, at)
        transport.accept_from(upstream, (before_key,), "the gateway" if at == 0 else f"member {at - 1}")
        worker.__dict__.pop("_keys_info", None)  # the cached_property, of the old neighbours
        msg.report.append({"stage": at, "load_s": round(time.perf_counter() - t0, 4), "released": released})
        log.warning("membership change %d: %s serves place %d of %d, sends to %s%s", msg.rid, worker.identity.name,
                    at, len(msg.members), transport.next_hop,
                    f" ({released} sequences released: their K/V did not all come)" if released else "")
        worker.io.send(msg)

    def _fill(self, runtime: StageRuntime, layers: LayerRange, old: LayerRange, receiving: Receiving | None) -> int:
        """The gained layers' K/V written into each held sequence's row from the parcels that came for it; a sequence
        some of them did not come for (at its length) is released. How many were."""
        gained = [layer for layer in layers if layer not in old]
        if not gained:
            return 0
        kv, parts = runtime.kv, receiving.parts if receiving is not None else {}
        released = 0
        for seq_id in kv.holders:
            slot, n = kv.row_of(seq_id)
            got = parts.pop(seq_id, {})
            if not all(layer in got and got[layer][0].shape[1] == n for layer in gained):
                kv.release(seq_id)
                released += 1
                continue
            for layer in gained:
                k, v = got[layer]
                kv.k[layer - layers.start][slot, :, :n].copy_(k)
                kv.v[layer - layers.start][slot, :, :n].copy_(v)
        return released

    def give(self, msg: Resplit) -> None:
        """On the compute thread: the K/V of the layers this stage gave at the route, every sequence's, to each member
        that now serves some of them (the joiner), then the message on (after its parcels, on the same link)."""
        worker, at = self.worker, self.place(msg)
        before, self.giving = self.giving, None
        sent = 0
        if before is not None and at is not None:
            sent = self._send(msg, before, set(worker.runtime.model.layers))
        if at is not None:
            msg.report.append({"stage": at, "sent_bytes": sent})
        worker.io.send(msg)

    def _send(self, msg: Resplit, runtime: StageRuntime, keeps: set[int]) -> int:
        """Send the K/V `runtime` holds for its layers that other members serve after the change (but those in
        `keeps`, which this stage serves on) as parcels to each; the bytes sent."""
        mine, sent = runtime.model.layers, 0
        for to, member in enumerate(msg.members):
            a, b = member["layers"]
            given = range(max(a, mine.start), min(b, mine.stop))
            if to == self.at or not given or any(layer in keeps for layer in given):
                continue
            for parcel in kv_parcels(runtime.kv, mine, given, msg.rid, to, kept=True):
                sent += parcel.nbytes
                self.worker.io.send(parcel)
        log.info("membership change %d: %s sent %.1f MiB of K/V", msg.rid, self.worker.identity.name, sent / 2**20)
        return sent

    def take(self, parcel: KVParcel) -> bool | None:
        """On the compute thread: a parcel of this change -- False when it is for another member (the caller passes
        it on: one for an upstream member travels around the ring), True when it was this stage's (kept aside or
        taken; or dropped, logged: its sequence is then released or never held, and replayed). None: not a
        membership change's parcel (a re-split's)."""
        if self.rid is None or parcel.rid != self.rid:
            return None
        if parcel.to != self.at:
            return False
        r, worker = self.receiving, self.worker
        fits = r is not None and r.gains.start <= parcel.start and parcel.stop <= r.gains.stop and parcel.length > 0
        if not fits or (r.whole and parcel.seq_id in worker.runtime.kv):
            throttled(log, logging.WARNING, "membership parcel", "membership change %d: dropped K/V of %r for layers "
                      "%d:%d on %s (it gains %s)", parcel.rid, parcel.seq_id, parcel.start, parcel.stop,
                      worker.identity.name, r.gains if r is not None else "nothing")
            return True
        got = r.parts.setdefault(parcel.seq_id, {})
        for j, layer in enumerate(range(parcel.start, parcel.stop)):
            got[layer] = (parcel.k[j], parcel.v[j])
        if parcel.kept:
            r.kept.add(parcel.seq_id)
        if r.whole and len(got) == len(r.gains):
            del r.parts[parcel.seq_id]
            try:
                worker.runtime.kv.adopt(parcel.seq_id, [got[i][0] for i in r.gains], [got[i][1] for i in r.gains],
                                        parcel.seq_id in r.kept)
            except (BadBatch, KVCacheFull) as e:
                log.warning("membership change %d: did not take the K/V of %r: %s", parcel.rid, parcel.seq_id, e)
        return True

    def forget(self) -> None:
        """Not in a change any more (another kind of phase came): what the last one held goes; a late parcel of it is
        not taken."""
        self.rid, self.at, self.loaded, self.receiving, self.giving = None, None, None, None, None

    def abort(self) -> None:
        self.loaded = None
