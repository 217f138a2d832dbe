"""One stage's side of a change of the mesh's members (a host joined, left or vanished:
services/gateway/engine/membership.py drives it). The gateway sends three membership phases of a Resplit, each naming
every place of the pipeline after the change (`members`: its process by incarnation, its layers, address, key):

  load    (old route, while the mesh serves) a stage whose layers change loads its new range beside the one it serves
  accept  (old route, micro-batches held) the receiver lets in its upstream-to-be as well as its upstream now
  route   (new route) the stage serves its new range -- with an empty cache: the gateway replays the running requests
          from their token histories --, sends to the next member, lets in only its upstream member and the one
          before that (so that a member that vanishes is routed around without a message reaching this stage first),
          then passes the message on, which therefore comes back to the gateway only over the whole new route

A stage the members do not name (one that leaves) passes each phase on unchanged. Nothing here is a socket call of
its own: ZmqTransport.route_to and accept_from change the stage's two sockets, on the compute thread."""

from __future__ import annotations

import logging
import time

from shared.files.layers import LayerRange
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import Resplit

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


class StageMembership:
    """The membership state of one stage: at most one range loaded ahead of a route (rid, runtime)."""

    def __init__(self, worker):
        self.worker = worker  # the StageWorker whose sockets, runtime and identity change (it imports this module)
        self.loaded: tuple[int, StageRuntime] | None = None

    def place(self, msg: Resplit) -> int | None:
        """This stage's place among msg.members (None: it is not one of them -- it leaves)."""
        me = self.worker.identity.incarnation
        return next((i for i, m in enumerate(msg.members) if m["incarnation"] == me), None)

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
        self.loaded = (msg.rid, runtime.reload(layers))
        log.info("membership change %d: loaded layers %s (now %s) in %.2f s", msg.rid, layers, runtime.model.layers,
                 time.perf_counter() - t0)

    def accept(self, msg: Resplit) -> None:
        """On the compute thread: let the upstream-to-be in as well (the route comes over it)."""
        at = self.place(msg)
        transport = self.worker.io.transport
        if at is not None and transport.keys is not None:
            upstream, before = neighbour_keys(msg, at)
            peer_also = (transport.keys.accept, upstream, before)
            transport.accept_from(transport.keys.accept, peer_also, transport.keys.accept_name)
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
        if layers != worker.runtime.model.layers:
            loaded, self.loaded = self.loaded, None
            if loaded is not None and loaded[0] == msg.rid and loaded[1].model.layers == layers:
                runtime = loaded[1]
            else:  # not loaded ahead (a member vanished: the route comes first), so now
                runtime = worker.runtime.reload(layers)
            released = len(worker.runtime.kv.holders)
            worker._serve_with(runtime)
        worker.identity.position = worker.runtime.model.position
        worker.identity.index = at
        transport = worker.io.transport
        last = at + 1 == len(msg.members)
        onward = msg.gateway if last else msg.members[at + 1]
        # (a last stage that stays last keeps the result address it was given)
        transport.route_to(transport.next_hop if last and was_last else onward["address"], _key(onward["key"]))
        upstream, before = neighbour_keys(msg, at)
        transport.accept_from(upstream, (before,), "the gateway" if at == 0 else f"member {at - 1}")
        worker.__dict__.pop("_keys_info", None)  # the cached_property, of the old neighbours
        msg.report.append({"stage": at, "load_s": round(time.perf_counter() - t0, 4), "released": released})
        log.warning("membership change %d: %s serves place %d of %d, sends to %s", msg.rid, worker.identity.name, at,
                    len(msg.members), transport.next_hop)
        worker.io.send(msg)

    def abort(self) -> None:
        self.loaded = None
