"""A host that joins as a replica of a stage (`stagemesh join --as replica`, issue 68 item 3): it serves a range the
pipeline already has, beside that range's process, and new sequences are bound to one of them (chains.py).

The exchange is the join's own (Membership: the token's nonce and proof, every answer MAC'd); only the place differs.
Placement: a replica of the slowest range after the first -- its predicted step time, the range's throughput the sum
of its instances' (1 / t_i), against the new stage place_joiner would give (`predict`, for a join that names no
role: the better of the two). Ready: its /info is checked (layers, key) and admissions may bind sequences to it; nothing pauses, no K/V moves,
no running sequence replays.
The stages learn a replica when it is placed, before it starts (a receiver refuses a key it was not told of, and a
sender refused once does not dial again): the hops phase names it by an instance id the gateway gives (r-<join id>),
stage i-1 dials its address (ZeroMQ retries until it listens), stage i+1 -- or the gateway's result socket -- lets
its key in; it is bound to no sequence until it is ready. Leave and loss: it leaves the table first (no new sequence is bound to it), the sequences bound to it replay from
their token histories on the living instances (Engine.instance_lost), the others stream on; a "hops" phase without it
closes the stage's socket to it. A replica that stops answering its /info is noticed within WATCH_S * LOST_AFTER.
A replicated range's primary is watched the same way; when it is lost a replica takes its place (promote: a route
phase with the replica in the dead one's place, nothing reloaded, only the dead one's sequences replay) and is a
joined stage of Membership from then on.
Limits: the first range takes no replicas, and while any replica exists the split stays (re-splits and joins as a
new stage are refused 409: they move one process per range)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass

from services.gateway.engine.chains import Instance, ms_per_micro_batch
from services.gateway.engine.core import Engine
from services.gateway.engine.membership import (
    LOST_AFTER,
    MIN_JOIN_GAIN,
    PHASE_S,
    WATCH_S,
    JoinError,
    Member,
    Membership,
    joiner_info,
    joiner_ms,
    per_layer_ms,
    place_joiner,
    receive_key,
    refusal,
    result_address,
    send_key,
    watch_every,
)
from services.gateway.engine.pipeline import reachable_address
from shared.wire.protocol import Resplit
from shared.wire.stage_info import StageInfo

log = logging.getLogger("stagemesh.gateway.replicas")

HOPS_S = 10.0  # a hops phase's round trip at most
READY_S = 180.0  # a placed replica that is not ready within this long is dropped (unless the join sets its own)


@dataclass(frozen=True)
class ReplicaPlacement:
    range: int  # the range's index in the pipeline
    layers: tuple[int, int]
    step_ms_now: float
    step_ms_after: float

    @property
    def predicted_gain(self) -> float:
        return self.step_ms_now / self.step_ms_after if self.step_ms_after > 0 else 1.0


def place_replica(split: list[tuple[int, int]], ms_per_layer: list[float], instances: list[int],
                  joiner_layer_ms: float, head_layers: float, max_layers: int) -> ReplicaPlacement | None:
    """A replica of the range (after the first, within `max_layers`) whose extra instance lowers the predicted step
    time most: a range's time is its layers' cost (the last range's lm_head as `head_layers` more layers) over its
    instances, each adding 1 / t of throughput (`instances[i]`: range i's now, each as fast as its primary); the step
    is the slowest range's. None when no range fits."""
    n = split[-1][1]

    def cost(rng: tuple[int, int], ms: float) -> float:
        return ms * (rng[1] - rng[0] + (head_layers if rng[1] == n else 0.0))

    times = [cost(r, ms) / k for r, ms, k in zip(split, ms_per_layer, instances)]
    now = max(times)
    best = None
    for i, (rng, ms, k) in enumerate(zip(split, ms_per_layer, instances)):
        if i == 0 or rng[1] - rng[0] > max_layers:
            continue
        after_i = 1.0 / (k / cost(rng, ms) + 1.0 / cost(rng, joiner_layer_ms))
        after = max(after_i if j == i else t for j, t in enumerate(times))
        if best is None or after < best.step_ms_after - 1e-9:
            best = ReplicaPlacement(i, rng, now, after)
    return best


@dataclass
class ReplicaJoin:
    id: str
    url: str
    address: str
    key: str | None
    placement: ReplicaPlacement
    deadline: float

    @property
    def instance(self) -> Instance:
        """What the stages know it as from its placement on (its id the gateway's: its incarnation is not known yet)."""
        return Instance(f"r-{self.id}", self.url, self.placement.layers, self.address, self.key, join_id=self.id)


class ReplicaJoins:
    """The replicas of one pipeline's stages: placed, joined, left or lost (`membership`: the join exchange and its
    log; `engine`: the pipeline's engine, whose scheduler holds the ChainTable)."""

    def __init__(self, membership: Membership, engine: Engine):
        self.membership = membership
        self.engine = engine
        self.joins: dict[str, ReplicaJoin] = {}  # placed, not yet ready
        self.joined: dict[str, Instance] = {}  # join id -> the instance it became
        self._failures: dict[str, int] = {}
        self._uncovered: set[str] = set()  # primaries' URLs whose promotion failed: their loss is the pipeline's
        self._results: dict[str, str] = {}  # join id -> the gateway's result address as the replica reaches it
        self._lock = asyncio.Lock()
        engine.pipeline.standby = self.covers

    @property
    def ready_s(self) -> float:
        """A placed replica not ready within this long is dropped: the join's own bound (--join-ready-timeout)."""
        return getattr(self.membership, "ready_s", READY_S)

    @property
    def table(self):
        return self.engine.scheduler.chains

    @property
    def pipeline(self):
        return self.engine.pipeline

    # ---- placement ----------------------------------------------------------------------------------------------

    def predict(self, report: dict) -> tuple[ReplicaPlacement | None, float]:
        """The replica's best placement and the gain a new stage would predict (place_joiner), for one report."""
        pipe, members = self.pipeline, self.membership.members()
        split = [m.layers for m in members]
        ms = [per_layer_ms(info, report) for info in pipe.stages]
        per_layer, free = report.get("bytes_per_layer"), report.get("free_bytes")
        max_layers = int(free // per_layer) if isinstance(per_layer, (int, float)) and per_layer > 0 \
            and isinstance(free, (int, float)) else 0
        counts = [1 + sum(1 for i in self.joined.values() if i.layers == r) for r in split]
        replica = place_replica(split, ms, counts, joiner_ms(report), self.membership.head_layers, max_layers)
        stage_gain = 0.0
        if not self.table.replicated and max_layers >= 1:
            with contextlib.suppress(JoinError):
                stage_gain = place_joiner(split, ms, joiner_ms(report), self.membership.head_layers,
                                          max_layers).predicted_gain
        return replica, stage_gain

    def prefers(self, report: dict) -> bool:
        """A join that names no role: True when a replica predicts more than a new stage would (and enough)."""
        placement, stage_gain = self.predict(report)
        return placement is not None and placement.predicted_gain > max(MIN_JOIN_GAIN, stage_gain)

    async def place(self, nonce: str, report: dict, key: str | None, force: bool, gateway_host: str) -> dict:
        """A proven joiner's place as a replica (force: asked for with --as replica, whatever the prediction)."""
        pipe = self.pipeline
        if not pipe.ready or self.engine.mesh.resplitting:
            raise JoinError(f"the mesh is not ready to change ({pipe.problem or 'a re-split is running'}); join "
                            "again once it is", 409)
        placement, stage_gain = self.predict(report)
        # (its weights mode is checked against the primary of the range it would replicate)
        why = refusal(pipe, report, key, pipe.stages[placement.range] if placement is not None else None)
        if why is not None:
            raise JoinError(f"join refused: {why}")
        if placement is None:
            raise JoinError("join refused: no range after the first fits the joiner's memory (a replica holds a "
                            "whole range; the first range takes none): give it more memory (--memory-budget)")
        if not force and placement.predicted_gain < max(MIN_JOIN_GAIN, stage_gain):
            raise JoinError(f"a replica of layers {placement.layers[0]}:{placement.layers[1]} predicts "
                            f"{placement.predicted_gain:.2f}x (a new stage {stage_gain:.2f}x): join with --as replica "
                            "to join anyway")
        members = self.membership.members()
        i = placement.range
        upstream = members[i - 1].key
        if i + 1 < len(members):
            onward = {"address": members[i + 1].address, "key": members[i + 1].key}
        else:
            onward = {"address": result_address(pipe.result_listen, gateway_host), "key": receive_key(pipe)}
        join = ReplicaJoin(secrets.token_hex(8), str(report.get("url")), str(report.get("address")), key, placement,
                           time.monotonic() + self.ready_s)
        async with self._lock:
            self._follow()
            if i + 1 == len(members) and pipe.client is not None and key:  # its results come to the gateway
                pipe.client.transport.also_accept((key.encode(),))
            self.joins[join.id] = join
            self._results[join.id] = onward["address"]
            try:
                await self._hops(self._known())
            except JoinError:
                self.joins.pop(join.id, None)
                raise
        self.membership.log.add(event="placed", join=join.id, url=join.url, layers=list(placement.layers),
                                replica_of=i, predicted_gain=round(placement.predicted_gain, 3))
        log.warning("join %s (%s) placed as a replica of range %d (layers %d:%d): predicted %.2fx", join.id, join.url,
                    i, *placement.layers, placement.predicted_gain)
        return {"id": join.id, "layers": list(placement.layers), "place": i, "num_layers": pipe.num_layers,
                "upstream_key": upstream, "upstream_before_key": None, "next": onward, "replica": True,
                "predicted_gain": round(placement.predicted_gain, 4), "ready_within_s": self.ready_s,
                "max_seq_len": pipe.max_seq_len}

    # ---- ready, leave, loss -----------------------------------------------------------------------------------------

    async def ready(self, join_id: str) -> dict:
        """The replica loaded its range and serves /ready: the stages learn it (hops); new sequences may use it."""
        join = self.joins.pop(join_id, None)
        if join is None:
            raise JoinError(f"join {join_id} is not waiting to be ready (dropped, done or never placed): join again",
                            410)
        async with self._lock:
            t0 = time.perf_counter()
            pipe = self.pipeline
            info = await joiner_info(pipe, join.id, join.url, join.placement.layers, join.key)
            self._follow()
            if [r[0].layers for r in self.table.ranges][join.placement.range] != join.placement.layers:
                raise JoinError("the mesh's split changed since the join was placed: join again", 409)
            replica = join.instance
            replica.incarnation = info.incarnation
            self.table.add(replica)
            self.joined[join.id] = replica
            took = time.perf_counter() - t0
            self.membership.log.add(event="joined", join=join.id, url=join.url, layers=list(replica.layers),
                                    replica_of=join.placement.range, took_s=round(took, 3), pause_s=0.0)
            log.warning("%s: a replica of range %d (layers %d:%d) serves at %s (instance %s), %.2f s", pipe.label,
                        join.placement.range, *replica.layers, join.url, replica.id, took)
            return {"id": join.id, "place": join.placement.range, "layers": list(replica.layers),
                    "stages": len(self.table.ranges), "replicas": len(self.table.ranges[join.placement.range]) - 1,
                    "took_s": round(took, 3), "pause_s": 0.0}

    async def leave(self, join_id: str, alive: bool = True) -> dict:
        """The replica `join_id` leaves (alive) or was lost: no new sequence is bound to it, those bound replay on
        the living instances, and the stages forget it."""
        replica = self.joined.pop(join_id, None)
        self._results.pop(join_id, None)
        if replica is None:
            raise JoinError(f"join {join_id} is not a replica of the mesh", 410)
        async with self._lock:
            self.table.remove(replica.id)
            replayed = self.engine.instance_lost(replica.id, f"replica {replica.url} {'left' if alive else 'lost'}")
            with contextlib.suppress(JoinError):  # (a pipeline that lost a stage too: its next check covers that)
                await self._hops(self._known())
            self.membership.log.add(event="left" if alive else "lost", join=join_id, url=replica.url,
                                    layers=list(replica.layers), replayed=replayed)
            return {"id": join_id, "stages": len(self.table.ranges), "replayed": replayed}

    # ---- a lost primary: its replica takes its place ---------------------------------------------------------------

    def _replica_for(self, url: str) -> tuple[int, Instance] | None:
        """The range whose primary is at `url` and the ready replica that would take its place (the one holding the
        fewest sequences), or None (not a primary of a replicated range)."""
        url = url.rstrip("/")
        for i, r in enumerate(self.table.ranges):
            if i > 0 and r[0].url == url and len(r) > 1:
                return i, min(r[1:], key=lambda inst: len(inst.bound))
        return None

    def covers(self, url: str) -> bool:
        """The stage at `url` stopped answering and a replica of its range is to take its place (Pipeline.standby:
        the pipeline's check leaves the loss to promote, which the watch starts within WATCH_S * LOST_AFTER)."""
        return url.rstrip("/") not in self._uncovered and self._replica_for(url) is not None

    async def promote(self, url: str, why: str) -> dict:
        """The primary of a replicated range, at `url`, is lost: a replica of the range serves its place from now on.
        The new micro-batches wait (MeshChange.paused) while a "route" phase goes along the pipeline with the replica
        in the dead one's place -- the stage before points its outbound at it and lets nothing else change, the
        replica (its layers already loaded, so its K/V stays) lets its upstream's key in, as does the gateway's
        result socket for a last range -- then only the sequences bound to the dead process replay
        (Engine.instance_lost) and the stages' hops follow the table. Every other sequence streams on. JoinError
        when the route does not come back: the pipeline's next check then declares the loss (every sequence
        replays once the pipeline is whole)."""
        found = self._replica_for(url)
        if found is None:
            raise JoinError(f"the stage at {url} is not a primary of a replicated range", 409)
        async with self._lock:
            i, replica = found
            pipe, mesh = self.pipeline, self.engine.mesh
            client = pipe.client
            dead = self.table.ranges[i][0]
            t0 = time.perf_counter()
            try:
                if client is None or mesh.resplitting:
                    raise JoinError("the pipeline has no client or is changing", 409)
                after: list[Member] = []
                for j, (u, info) in enumerate(zip(pipe.stage_urls, pipe.infos)):
                    if j == i:
                        after.append(Member(replica.url, replica.incarnation, replica.layers, replica.address,
                                            replica.key, replica.join_id))
                    elif isinstance(info, StageInfo):
                        after.append(Member(u, info.incarnation, tuple(info.layers),
                                            reachable_address(info.listen, u), (info.keys or {}).get("public")))
                    else:
                        raise JoinError(f"stage {u} does not answer either ({info}): one lost stage is covered at "
                                        "a time", 409)
                split = [m.layers for m in after]
                ends = {"address": result_address(pipe.result_listen, None), "key": receive_key(pipe),
                        "sends": send_key(pipe)}
                mesh.paused = pipe.resplitting = True
                try:
                    answer = await asyncio.wait_for(client.resplit(Resplit(
                        client.next_rid(), "route", split, split, members=[m.wire() for m in after], gateway=ends)),
                        PHASE_S["route"])
                except TimeoutError:
                    raise JoinError(f"the route did not come back within {PHASE_S['route']:g} s", 503) from None
                if answer.error is not None:
                    raise JoinError(f"the route was refused: {answer.error}", 503)
                transport = client.transport
                if i == len(after) - 1 and transport.keys is not None:  # the gateway's receiver: the new last stage
                    transport.accept_from(replica.key.encode() if replica.key else None,
                                          (after[-2].key.encode() if after[-2].key else None,), "the last stage")
                self.table.promote(dead.id, replica.id)
                if dead.join_id is not None:  # (a promoted or joined stage before: Membership forgets it)
                    self.membership.joined.pop(dead.join_id, None)
                self.membership.forget(dead.url)
                if replica.join_id is not None:  # a joined stage from now on: its leave and loss are Membership's
                    self.joined.pop(replica.join_id, None)
                    self._failures.pop(replica.join_id, None)
                    self.membership.joined[replica.join_id] = after[i]
                    after[i].result_address = self._results.get(replica.join_id) if i == len(after) - 1 else None
                pipe.promoted(i, replica.url, transport.keys)
                replayed = self.engine.instance_lost(dead.id, f"stage {i} at {url} lost ({why}); replica "
                                                              f"{replica.id} serves its place")
                pipe.resplitting = False
                with contextlib.suppress(JoinError):  # the stages forget the dead one (and route-less: no replicas)
                    await self._hops(self._known())
            except Exception as e:
                self._uncovered.add(url.rstrip("/"))
                self.membership.log.add(event="promotion failed", url=url, error=str(e)[:200])
                log.error("%s: the replica %s could not take the place of the lost stage %s: %s", pipe.label,
                          replica.url, url, e)
                raise
            finally:
                pipe.resplitting = False
                mesh.paused = False
            took = time.perf_counter() - t0
            self.membership.log.add(event="promoted", url=replica.url, lost=url, layers=list(replica.layers),
                                    place=i, replayed=replayed, took_s=round(took, 3))
            log.warning("%s: stage %d at %s lost; the replica %s (%s) serves its place: %d sequences replay, %.2f s",
                        pipe.label, i, url, replica.id, replica.url, replayed, took)
            return {"place": i, "url": replica.url, "replayed": replayed, "took_s": round(took, 3)}

    def _known(self) -> list[dict]:
        """What the stages are to know: every instance of the ranges after the first, and the replicas placed and
        not yet ready (none at all without replicas: a stage then sends by its one next hop)."""
        placed = [j.instance.wire() for j in self.joins.values()]
        if not placed and not self.table.replicated:
            return []
        return [*(i.wire() for r in self.table.ranges[1:] for i in r), *placed]

    def _follow(self) -> None:
        """The table's primaries: the pipeline's stages now, with their measured ms per micro-batch."""
        members = self.membership.members()
        self.table.follow([Instance(m.incarnation, m.url, m.layers, m.address, m.key, primary=True,
                                    ms_per_mb=ms_per_micro_batch(info))
                           for m, info in zip(members, self.pipeline.stages)])

    async def _hops(self, hops: list[dict]) -> Resplit:
        """One hops phase along the primary chain, its answer (JoinError when refused or not back in HOPS_S)."""
        client = self.pipeline.client
        if client is None:
            raise JoinError("the pipeline has no client (not ready)", 409)
        split = [r[0].layers for r in self.table.ranges] or [m.layers for m in self.membership.members()]
        try:
            answer = await asyncio.wait_for(client.resplit(Resplit(client.next_rid(), "hops", split, split,
                                                                   hops=hops)), HOPS_S)
        except TimeoutError:
            raise JoinError(f"the hops phase did not come back within {HOPS_S:g} s", 503) from None
        if answer.error is not None:
            raise JoinError(f"the hops phase was refused: {answer.error}", 503)
        return answer

    # ---- watching ---------------------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Until cancelled: drop replicas placed and not ready in time, keep each instance's measured speed, and
        cover a replica that stopped answering (LOST_AFTER polls WATCH_S apart; a refused connection at once)."""
        await watch_every(WATCH_S, self._watch_once, "replica watch")

    async def _watch_once(self) -> None:
        now = time.monotonic()
        dropped = [j for j in self.joins.values() if j.deadline < now]
        for join in dropped:
            self.joins.pop(join.id, None)
            self.membership.log.add(event="dropped", join=join.id, url=join.url,
                                    error=f"not ready within {self.ready_s:g} s")
        if dropped:
            async with self._lock:
                await self._hops(self._known())  # the stages forget it
        if not self.joined or self._lock.locked():
            return
        for info, inst in zip(self.pipeline.stages, [r[0] for r in self.table.ranges]):
            if info.incarnation == inst.id:
                inst.ms_per_mb = ms_per_micro_batch(info) or inst.ms_per_mb
        for i, r in enumerate(self.table.ranges):  # the primaries of replicated ranges: a lost one is promoted over
            if i == 0 or len(r) < 2 or r[0].url in self._uncovered:
                continue
            info = await self.pipeline.fetch_info(r[0].url)
            key = f"primary {r[0].url}"
            if isinstance(info, StageInfo):  # (a restart is the pipeline's check's: a new incarnation, a loss)
                self._failures.pop(key, None)
                continue
            refused = isinstance(info, str) and ("Connect" in info or "refused" in info)
            n = self._failures[key] = self._failures.get(key, 0) + (LOST_AFTER if refused else 1)
            if n >= LOST_AFTER:
                self._failures.pop(key, None)
                why = str(info)[:200]
                log.warning("stage %d (%s) lost: %s; a replica of its range takes its place", i, r[0].url, why)
                self.membership.log.add(event="noticed", url=r[0].url, error=why)
                with contextlib.suppress(JoinError):  # (logged there; the pipeline's check declares the loss)
                    await self.promote(r[0].url, why)
                return
        for join_id, replica in list(self.joined.items()):
            info = await self.pipeline.fetch_info(replica.url)
            if isinstance(info, StageInfo) and info.incarnation == replica.incarnation:
                self._failures.pop(join_id, None)
                replica.ms_per_mb = ms_per_micro_batch(info) or replica.ms_per_mb
                continue
            refused = isinstance(info, str) and ("Connect" in info or "refused" in info)
            n = self._failures[join_id] = self._failures.get(join_id, 0) + (LOST_AFTER if refused else 1)
            if n >= LOST_AFTER:
                self._failures.pop(join_id, None)
                log.warning("replica %s (%s) lost: %s; its sequences replay on the others", join_id, replica.url,
                            info)
                self.membership.log.add(event="noticed", join=join_id, url=replica.url, error=str(info)[:200])
                await self.leave(join_id, alive=False)

    def info(self) -> dict:
        """/v1/mesh's view: every instance of every range (none listed beyond the pipeline's stages without
        replicas)."""
        return {"instances": self.table.view(),
                "replicas": {j: {"url": i.url, "layers": list(i.layers), "id": i.id} for j, i in self.joined.items()}}


__all__ = ["ReplicaJoins", "place_replica"]
