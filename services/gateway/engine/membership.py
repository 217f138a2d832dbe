"""Hosts that join and leave a running mesh (issue 68): the gateway owns the mesh's membership as it owns the split.

A host joins by proving the join token without sending it (JoinKeys: the gateway's one-use nonce, answered with
HMAC-SHA256(token, nonce | the joiner's CURVE public key | the digest of what it reports)); every answer that names
keys or addresses carries the gateway's MAC of it under the same token, so nobody between the two can swap a key.
The gateway then places it (place_joiner: the share of the slowest stage's layers whose move lowers the predicted
step time most), the joiner loads that range and says it is ready, and the pipeline goes from N to N+1 places by one
membership change at a step boundary (Membership.change: load ahead, hold micro-batches, let the upstream-to-be in,
route; services/stage/membership.py is the stages' side). Leaving (`stagemesh leave`, SIGTERM to a joined stage) and
loss (a joined stage that stops answering, seen within WATCH_S * LOST_AFTER) are the same change from N to N-1: a
neighbour takes the layers. A join and a leave move K/V with the layers (the giver keeps its kept layers' and hands
the joiner the given ones' in the give phase; a leaver sends its taker its own along the accept), so the running
requests go on where they were; after a loss they are replayed from their token histories (the lost layers' K/V is
gone)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from services.gateway.engine.mesh_change import MeshChange
from services.gateway.engine.pipeline import reachable_address
from shared.cpu import busy_cores
from shared.errors import StagemeshError
from shared.files.layers import LayerRange
from shared.wire.protocol import Resplit
from shared.wire.stage_info import StageInfo

log = logging.getLogger("stagemesh.gateway.membership")

NONCE_S = 30.0  # a challenge answers within this long, once
MAX_NONCES = 64  # challenges outstanding at most (the oldest is forgotten first)
JOIN_RATE = 2.0  # join requests (challenges, joins, leaves) per second, sustained ...
JOIN_BURST = 6  # ... and at once
MIN_JOIN_GAIN = 1.05  # a joiner is placed as a new stage only if that predicts at least this speed-up (or --as stage)
WATCH_S = 0.5  # how often the joined stages' /info is polled ...
LOST_AFTER = 2  # ... and how many failed polls in a row make one lost (a refused connection: one)
PHASE_S = {"load": 180.0, "accept": 10.0, "route": 30.0, "give": 30.0}  # each membership phase's round trip at most
DRAIN_S = 10.0  # micro-batches in flight are waited for this long at most before the route changes


class JoinError(StagemeshError):
    """A join, leave or membership change refused; `status` is the HTTP status (401: the proof does not match the
    token, nothing else is said; 400: the joiner does not fit the mesh, the message says why and how to fix it;
    409: the mesh cannot change now; 410: the join was dropped; 429: too many joins a second)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---- the exchange ------------------------------------------------------------------------------------------------

async def watch_every(period_s: float, once, what: str) -> None:
    """Until cancelled: `await once()` every period_s; a round that fails is logged and the next one runs."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await once()
        except Exception:
            log.exception("%s failed", what)


def digest(report: dict) -> str:
    """The SHA-256 of a joiner's report in canonical JSON (what its proof covers)."""
    return hashlib.sha256(json.dumps(report, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def mac(token: str, *parts: str) -> str:
    """HMAC-SHA256 under the join token of the parts, joined by '|' (none of them holds one: hex, Z85, JSON)."""
    return hmac.new(token.encode(), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def join_proof(token: str, nonce: str, key: str | None, report: dict) -> str:
    return mac(token, "join", nonce, key or "", digest(report))


def answer_mac(token: str, nonce: str, answer: dict) -> str:
    """The gateway's MAC of an answer (its keys and addresses) to the joiner that sent `nonce`."""
    body = {k: v for k, v in answer.items() if k != "mac"}
    return mac(token, "answer", nonce, json.dumps(body, sort_keys=True, separators=(",", ":")))


class RateLimit:
    """A token bucket: JOIN_RATE a second, JOIN_BURST at once."""

    def __init__(self, rate: float = JOIN_RATE, burst: int = JOIN_BURST):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> float | None:
        """None when allowed; else the seconds until the next would be (Retry-After)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return None
        return (1 - self.tokens) / self.rate


# ---- placement ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    place: int  # the joiner's place in the new pipeline
    giver: int  # the stage (index now) whose layers it takes
    layers: tuple[int, int]  # the joiner's range
    split: list[tuple[int, int]]  # the new split, place by place
    step_ms_now: float
    step_ms_after: float

    @property
    def predicted_gain(self) -> float:
        return self.step_ms_now / self.step_ms_after if self.step_ms_after > 0 else 1.0


def place_joiner(split: list[tuple[int, int]], ms_per_layer: list[float], joiner_ms: float, head_layers: float,
                 max_layers: int) -> Placement:
    """Where a joiner whose layers cost `joiner_ms` each goes: the head or the tail of one stage's range (the stages'
    ranges `split`, their layers' cost `ms_per_layer`), sized so that the slowest stage's predicted time -- layers
    times cost, the last stage's lm_head counted as `head_layers` more layers -- is least. It takes at most
    `max_layers` (what its memory holds) and leaves the giver one at least. JoinError (400) when no place exists."""
    n = split[-1][1]

    def time_of(rng: tuple[int, int], ms: float) -> float:
        return ms * (rng[1] - rng[0] + (head_layers if rng[1] == n else 0.0))

    now = max(time_of(r, ms) for r, ms in zip(split, ms_per_layer))
    best: Placement | None = None
    for g, ((a, b), ms) in enumerate(zip(split, ms_per_layer)):
        for k in range(1, min(b - a - 1, max_layers) + 1):
            for tail in (True, False):
                mine, kept = ((b - k, b), (a, b - k)) if tail else ((a, a + k), (a + k, b))
                new = [*split[:g], *((kept, mine) if tail else (mine, kept)), *split[g + 1:]]
                costs = [*ms_per_layer[:g], *((ms, joiner_ms) if tail else (joiner_ms, ms)), *ms_per_layer[g + 1:]]
                after = max(time_of(r, c) for r, c in zip(new, costs))
                if best is None or after < best.step_ms_after - 1e-9:
                    best = Placement(g + 1 if tail else g, g, mine, new, now, after)
    if best is None:
        raise JoinError(f"no stage has layers to give (split {split}, the joiner holds at most {max_layers} layers)")
    return best


# ---- the members -------------------------------------------------------------------------------------------------

@dataclass
class Member:
    """One place of the pipeline, as a membership change names it."""

    url: str
    incarnation: str
    layers: tuple[int, int]
    address: str  # its input address, as the stage before it reaches it
    key: str | None  # its CURVE public key (None: plaintext)
    join_id: str | None = None  # a joined stage's join (None: started with the mesh)
    result_address: str | None = None  # a joined stage's: the gateway's result address as it reaches it

    def wire(self) -> dict:
        return {"incarnation": self.incarnation, "layers": list(self.layers), "address": self.address, "key": self.key}


@dataclass
class Join:
    """A joiner placed and not yet ready (then a member)."""

    id: str
    nonce: str
    url: str
    address: str
    key: str | None
    placement: Placement
    result_address: str  # the gateway's result address as the joiner reaches it
    deadline: float
    state: str = "placed"  # placed -> loading -> joined | dropped | failed
    error: str | None = None


@dataclass
class MembershipLog:
    """What /v1/mesh shows of joins and leaves: the last few, oldest first."""

    events: list[dict] = field(default_factory=list)

    def add(self, **event) -> None:
        self.events.append({"time": round(time.time(), 3), **event})
        del self.events[:-16]


class Membership:
    """The join token's exchange and the membership changes of one pipeline (`mesh`: its engine's MeshChange)."""

    def __init__(self, token: str, mesh: MeshChange, head_layers: float, ready_s: float):
        if len(token) < 16:
            raise StagemeshError("--join-token must be 16 characters at least (use `up --join-token auto` for a "
                                 "random one)")
        self.token = token
        self.mesh = mesh
        self.head_layers = head_layers
        self.ready_s = ready_s  # a placed joiner not ready within this long is dropped (--join-ready-timeout)
        self.rate = RateLimit()
        self._nonces: dict[str, float] = {}  # nonce -> when it expires
        self.joins: dict[str, Join] = {}  # placed and not yet members
        self.joined: dict[str, Member] = {}  # join id -> the member it became
        self.log = MembershipLog()
        self._failures: dict[str, int] = {}  # join id (a started member: its url) -> failed polls in a row
        self._seen: dict[str, Member] = {}  # url -> the last answer of each member the mesh started with
        self._lock = asyncio.Lock()  # one membership change at a time

    @property
    def pipeline(self):
        return self.mesh.pipeline

    # ---- the exchange -----------------------------------------------------------------------------------------

    def limit(self) -> None:
        if (wait := self.rate.take()) is not None:
            err = JoinError(f"too many join requests: at most {JOIN_RATE:g} a second; try again in {wait:.1f} s", 429)
            err.retry_after = max(1, round(wait + 0.5))
            raise err

    def challenge(self) -> str:
        now = time.monotonic()
        self._nonces = {n: t for n, t in self._nonces.items() if t > now}
        while len(self._nonces) >= MAX_NONCES:
            self._nonces.pop(next(iter(self._nonces)))
        nonce = secrets.token_hex(16)
        self._nonces[nonce] = now + NONCE_S
        return nonce

    def check_proof(self, nonce, proof, *parts: str) -> str:
        """The nonce, used up, when `proof` is the token's MAC of it and `parts`; else JoinError 401 that says only
        that (a wrong token learns nothing about the mesh)."""
        fresh = isinstance(nonce, str) and self._nonces.pop(nonce, 0.0) > time.monotonic()
        if not (fresh and isinstance(proof, str) and hmac.compare_digest(proof, mac(self.token, *parts))):
            raise JoinError("join refused: no valid proof of the join token (a fresh nonce from /v1/join/hello, "
                            "answered with HMAC-SHA256 under the token; check --token)", 401)
        return nonce

    def answer(self, nonce: str, body: dict) -> dict:
        return {**body, "mac": answer_mac(self.token, nonce, body)}

    # ---- joining ----------------------------------------------------------------------------------------------

    def members(self) -> list[Member]:
        """The pipeline's places now (every stage answered its last poll), joined ones named by their join."""
        pipe = self.pipeline
        by_inc = {m.incarnation: m.join_id for m in self.joined.values()}
        out = []
        for url, info in zip(pipe.stage_urls, pipe.infos):
            if not isinstance(info, StageInfo):
                raise JoinError(f"stage {url} does not answer ({info}); the mesh changes its members once every "
                                "stage answers", 409)
            key = (info.keys or {}).get("public")
            out.append(Member(url, info.incarnation, tuple(info.layers), reachable_address(info.listen, url), key,
                              by_inc.get(info.incarnation)))
        return out

    def place(self, nonce: str, report: dict, key: str | None, force: bool, gateway_host: str) -> dict:
        """A proven joiner's place (the layers it is to load, its neighbours' keys and addresses), or JoinError
        naming why it does not fit."""
        pipe = self.pipeline
        if not pipe.ready or self.mesh.resplitting:
            raise JoinError(f"the mesh is not ready to change ({pipe.problem or 'a re-split is running'}); join "
                            "again once it is", 409)
        stages = pipe.stages
        why = refusal(pipe, report, key)
        if why is not None:
            raise JoinError(f"join refused: {why}")
        per_layer, free = report.get("bytes_per_layer"), report.get("free_bytes")
        if not isinstance(per_layer, (int, float)) or not isinstance(free, (int, float)) or per_layer <= 0:
            raise JoinError("join refused: the report gives no bytes_per_layer and free_bytes")
        max_layers = int(free // per_layer)
        if max_layers < 1:
            raise JoinError(f"join refused: it cannot hold a layer (one takes {per_layer / 2**20:.1f} MiB, it has "
                            f"{free / 2**20:.1f} MiB free): give it more memory (--memory-budget)")
        members = self.members()
        split = [m.layers for m in members]
        ms = [per_layer_ms(info, report) for info in stages]
        placement = place_joiner(split, ms, joiner_ms(report), self.head_layers, max_layers)
        if placement.predicted_gain < MIN_JOIN_GAIN and not force:
            raise JoinError(f"join refused: as a new stage it is predicted to give {placement.predicted_gain:.2f}x "
                            f"(layers {placement.layers[0]}:{placement.layers[1]}; slowest stage "
                            f"{placement.step_ms_now:.3g} -> {placement.step_ms_after:.3g} ms), under "
                            f"{MIN_JOIN_GAIN:g}x: join --as stage to add it anyway", 409)
        p = placement.place
        upstream = members[p - 1].key if p > 0 else send_key(pipe)
        before = members[p - 2].key if p > 1 else send_key(pipe) if p == 1 else None
        result = result_address(pipe.result_listen, gateway_host)
        if p < len(members):
            onward = {"address": members[p].address, "key": members[p].key}
        else:
            onward = {"address": result, "key": receive_key(pipe)}
        join = Join(secrets.token_hex(8), nonce, str(report.get("url")), str(report.get("address")), key, placement,
                    result, time.monotonic() + self.ready_s)
        self.joins[join.id] = join
        self.log.add(event="placed", join=join.id, url=join.url, layers=list(placement.layers), place=p,
                     predicted_gain=round(placement.predicted_gain, 3))
        log.warning("join %s (%s) placed at %d with layers %d:%d from stage %d: predicted %.2fx", join.id, join.url, p,
                    *placement.layers, placement.giver, placement.predicted_gain)
        return {"id": join.id, "layers": list(placement.layers), "place": p, "num_layers": pipe.num_layers,
                "upstream_key": upstream, "upstream_before_key": before, "next": onward,
                "predicted_gain": round(placement.predicted_gain, 4), "ready_within_s": self.ready_s,
                "max_seq_len": pipe.max_seq_len}

    async def ready(self, join_id: str) -> dict:
        """The joiner loaded its range and serves /ready: the pipeline goes from N to N+1 places."""
        join = self.joins.get(join_id)
        if join is None or join.state != "placed":
            raise JoinError(f"join {join_id} is not waiting to be ready (dropped, done or never placed): join again",
                            410)
        join.state = "loading"
        try:
            info = await joiner_info(self.pipeline, join.id, join.url, join.placement.layers, join.key)
            members = self.members()
            if [m.layers for m in members] != _before(join.placement):
                raise JoinError("the mesh's split changed since the join was placed: join again", 409)
            new = Member(join.url, info.incarnation, join.placement.layers, join.address, join.key, join.id,
                         join.result_address)
            after = [*members[:join.placement.place], new, *members[join.placement.place:]]
            for m, rng in zip(after, join.placement.split):
                m.layers = tuple(rng)
            done = await self.change(members, after, f"join {join.id}", give=True)
            self.joined[join.id] = new
            join.state = "joined"
            self.log.add(event="joined", join=join.id, url=join.url, layers=list(new.layers),
                         place=join.placement.place, took_s=done["took_s"], pause_s=done["pause_s"],
                         kv_moved=done["kv_moved"])
            return {"id": join.id, "place": join.placement.place, "layers": list(new.layers), **done}
        except Exception as e:
            join.state, join.error = "failed", str(e)
            self.log.add(event="join failed", join=join.id, url=join.url, error=str(e))
            raise
        finally:
            self.joins.pop(join_id, None)

    async def leave(self, join_id: str, alive: bool = True) -> dict:
        """The joined stage `join_id` leaves (alive: by plan; else it vanished): a neighbour takes its layers and
        the route skips it."""
        member = self.joined.get(join_id)
        if member is None:
            raise JoinError(f"join {join_id} is not a member of the mesh", 410)
        return await self._without(member, alive)

    async def _without(self, member: Member, alive: bool) -> dict:
        """The pipeline without `member` (a joined one, or once hosts joined one the mesh started with: its
        neighbours are joined hosts, whose keys a restarted process would not hold, so the mesh routes around it)."""
        join_id = member.join_id or member.url
        pipe = self.pipeline
        if alive:
            members = self.members()
        else:  # the last view of the pipeline (its /info is gone): the others' entries from their polls
            members = []
            for url, info in zip(pipe.stage_urls, pipe.infos):
                if url == member.url:
                    members.append(member)
                elif isinstance(info, StageInfo):
                    members.append(Member(url, info.incarnation, tuple(info.layers),
                                          reachable_address(info.listen, url), (info.keys or {}).get("public"),
                                          next((j for j, m in self.joined.items() if m.url == url), None)))
                else:
                    raise JoinError(f"stage {url} does not answer either ({info}); one lost member is covered at a "
                                    "time", 409)
        at = next((i for i, m in enumerate(members) if m.url == member.url), None)
        if at is None or len(members) < 2:
            raise JoinError(f"join {join_id} ({member.url}) is the only stage or not in the pipeline", 409)
        after = [Member(m.url, m.incarnation, m.layers, m.address, m.key, m.join_id, m.result_address)
                 for m in members]
        gone = after.pop(at)
        taker = after[at - 1] if at > 0 else after[0]  # the stage before takes its layers (the next, for place 0)
        taker.layers = (min(taker.layers[0], gone.layers[0]), max(taker.layers[1], gone.layers[1]))
        # the last place leaves: the result address it was given (or the joined taker's own) is the new last stage's
        result = (gone.result_address or taker.result_address) if at == len(members) - 1 else None
        done = await self.change(members, after, f"{'leave' if alive else 'loss'} of {join_id}", alive=alive,
                                 result=result)
        self.joined.pop(join_id, None)
        self._seen.pop(member.url, None)
        self.log.add(event="left" if alive else "lost", join=join_id, url=member.url, layers=list(member.layers),
                     to=taker.url, took_s=done["took_s"], pause_s=done["pause_s"], kv_moved=done["kv_moved"])
        return {"id": join_id, "layers_to": taker.url, **done}

    # ---- the change ---------------------------------------------------------------------------------------------

    async def change(self, before: list[Member], after: list[Member], trigger: str, alive: bool = True,
                     result: str | None = None, give: bool = False) -> dict:
        """Move the pipeline from the places `before` to `after` at a step boundary: load ahead while serving (when
        every member is alive), hold new micro-batches and drain those in flight, let each receiver's upstream-to-be
        in (a leaver sends its taker its K/V along the accept), then route (the new route carries the message back).
        `give` (a join): then the giver hands the joiner the K/V of the layers it took. The running requests go on
        with their K/V after a join or a leave (a sequence a stage lacks then answers unknown_sequence: a loss), and
        replay after a loss or a give that did not come back. JoinError 503 when a phase did not come back (before
        the route: the mesh serves on as it was)."""
        async with self._lock:
            mesh, pipe = self.mesh, self.pipeline
            if mesh.resplitting or pipe.client is None:
                raise JoinError("a re-split or another change of this pipeline is running; try again", 409)
            old = [m.layers for m in before]
            new = [m.layers for m in after]
            ends = {"address": result or result_address(pipe.result_listen, None), "key": receive_key(pipe),
                    "sends": send_key(pipe)}
            wire = [m.wire() for m in after]
            t0 = time.perf_counter()
            mesh.resplitting, mesh.resplit_phase = True, "load"
            client = pipe.client
            rid = client.next_rid()  # one for every phase of the change: a stage knows its loaded range and its
            # parcels by it (the client tells the phases' answers apart by rid and phase)
            pause, gave = 0.0, False
            try:
                if alive:
                    await self._phase(Resplit(rid, "load", old, new, members=wire, gateway=ends))
                mesh.paused = pipe.resplitting = True
                t_pause = time.perf_counter()
                try:
                    # what is in flight finishes first; after a loss it never comes back (its sequences replay, as
                    # every running one does then), so nothing is waited for
                    deadline = time.perf_counter() + (DRAIN_S if alive else 0.0)
                    while mesh.scheduler.inflight and time.perf_counter() < deadline:
                        await asyncio.sleep(0.002)
                    left = None  # a leaver that sent its K/V to its taker along the accept (its report says so)
                    if alive:
                        mesh.resplit_phase = "accept"
                        accepted = await self._phase(Resplit(rid, "accept", old, new, members=wire, gateway=ends))
                        left = next((r for r in accepted.report if r.get("left")), None)
                    transport = client.transport
                    if transport.keys is not None:  # the gateway's own receiver: the new last stage too
                        transport.accept_from(transport.keys.accept, (_b(after[-1].key),))
                    if after[0].incarnation != before[0].incarnation:  # a new first stage: the gateway sends there
                        transport.route_to(after[0].address, _b(after[0].key))
                    mesh.resplit_phase = "route"
                    # the point of no return, as a re-split's commit: a stage restarted from now on serves `new`
                    mesh.committed = [LayerRange(*r) for r in new]
                    try:
                        answer = await self._phase(Resplit(rid, "route", old, new, members=wire,
                                                           gateway=ends))
                    except JoinError as e:
                        pipe.mark_lost(f"{trigger}: the route did not come back ({e})")
                        raise
                    if transport.keys is not None:
                        transport.accept_from(_b(after[-1].key), (_b(after[-2].key) if len(after) > 1 else None,),
                                              "the last stage")
                    if give:
                        mesh.resplit_phase = "give"
                        try:
                            given = await self._phase(Resplit(rid, "give", old, new, members=wire, gateway=ends))
                            gave = True
                            answer.report += given.report
                        except JoinError as e:
                            log.warning("%s %s: the K/V hand-over did not come back (%s); the running requests "
                                        "replay", pipe.label, trigger, e)
                    if left is not None:
                        gave = True
                        answer.report.append(left)
                    pipe.members_changed([m.url for m in after], after[0].address, transport.keys, lost=not gave)
                finally:
                    pipe.resplitting = False
                    with contextlib.suppress(Exception):
                        await pipe.check()
                    mesh.paused = False
                    pause = time.perf_counter() - t_pause
                    mesh._changed()
            finally:
                mesh.resplitting, mesh.resplit_phase = False, None
            took = time.perf_counter() - t0
            log.warning("%s %s: %d -> %d stages, split %s in %.2f s (paused %.0f ms); running requests %s",
                        pipe.label, trigger, len(before), len(after), ",".join(str(r[1]) for r in new[:-1]) or "-",
                        took, pause * 1e3, "go on with their K/V" if gave else "replayed")
            return {"stages": len(after), "split": [list(r) for r in new], "took_s": round(took, 3),
                    "pause_s": round(pause, 4), "kv_moved": gave, "report": answer.report}

    async def _phase(self, msg: Resplit) -> Resplit:
        wait = PHASE_S[msg.phase]
        try:
            answer = await asyncio.wait_for(self.pipeline.client.resplit(msg), wait)
        except TimeoutError:
            raise JoinError(f"the {msg.phase} did not come back within {wait:g} s", 503) from None
        if answer.error is not None:
            if msg.phase == "load":  # every stage drops what it loaded
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.pipeline.client.resplit(
                        Resplit(self.pipeline.client.next_rid(), "abort", msg.old, msg.old)), 5.0)
            raise JoinError(f"the {msg.phase} was refused: {answer.error}", 503)
        return answer

    # ---- watching -------------------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Until cancelled: drop joiners that were not ready in time, and cover a joined stage that stopped
        answering (LOST_AFTER polls WATCH_S apart; a refused connection counts at once)."""
        await watch_every(WATCH_S, self._watch_once, "membership watch")

    async def _watch_once(self) -> None:
        now = time.monotonic()
        for join in [j for j in self.joins.values() if j.state == "placed" and j.deadline < now]:
            self.joins.pop(join.id, None)
            self.log.add(event="dropped", join=join.id, url=join.url, error=f"not ready within {self.ready_s:g} s")
            log.warning("join %s (%s) dropped: not ready within %g s; nothing was held for it", join.id, join.url,
                        self.ready_s)
        if self.mesh.resplitting or self._lock.locked():
            return
        watched = dict(self.joined)
        if self.joined:  # hosts joined: the members the mesh started with are covered the same way when lost
            joined_urls = {m.url for m in self.joined.values()}
            for url, info in zip(self.pipeline.stage_urls, self.pipeline.infos):
                if url in joined_urls:
                    continue
                if isinstance(info, StageInfo):
                    self._seen[url] = Member(url, info.incarnation, tuple(info.layers),
                                             reachable_address(info.listen, url), (info.keys or {}).get("public"))
                if url in self._seen:
                    watched[url] = self._seen[url]
        standby = self.pipeline.standby  # (a primary a replica of its range covers: ReplicaJoins promotes it)
        for join_id, member in watched.items():
            if standby is not None and standby(member.url):
                continue
            info = await self.pipeline.fetch_info(member.url)
            if isinstance(info, StageInfo) and info.incarnation == member.incarnation:
                self._failures.pop(join_id, None)
                continue
            refused = isinstance(info, str) and ("Connect" in info or "refused" in info)
            n = self._failures[join_id] = self._failures.get(join_id, 0) + (LOST_AFTER if refused else 1)
            if n >= LOST_AFTER:
                self._failures.pop(join_id, None)
                log.warning("joined stage %s (%s) lost: %s; its layers go to a neighbour", join_id, member.url, info)
                self.log.add(event="noticed", join=join_id, url=member.url, error=str(info)[:200])
                try:
                    await self._without(member, alive=False)
                except Exception as e:
                    self.log.add(event="loss not covered", join=join_id, url=member.url, error=str(e))
                    log.error("covering the loss of %s failed: %s", member.url, e)
                return

    def forget(self, url: str) -> None:
        """Stop watching the member at `url` (a primary lost and replaced by its replica: ReplicaJoins.promote)."""
        self._seen.pop(url, None)

    def info(self) -> dict:
        """What /v1/mesh shows."""
        return {"joined": {j: {"url": m.url, "layers": list(m.layers)} for j, m in self.joined.items()},
                "waiting": {j.id: {"url": j.url, "layers": list(j.placement.layers), "state": j.state}
                            for j in self.joins.values()},
                "events": self.log.events}


def _before(p: Placement) -> list[tuple[int, int]]:
    """The split a placement was made from."""
    split = [tuple(r) for r in p.split]
    joiner = split.pop(p.place)  # the giver sits at its own index again, whichever end it gave
    a, b = split[p.giver]
    split[p.giver] = (min(a, joiner[0]), max(b, joiner[1]))
    return split


def _b(key: str | None) -> bytes | None:
    return key.encode() if key else None


def refusal(pipe, report: dict, key: str | None, primary: StageInfo | None = None) -> str | None:
    """Why a joiner's report does not fit the mesh (its model file, numerics, context, slots, CURVE), or None; with
    `primary` (the process of the range it is to replicate) also its weights mode, which must be the primary's: two
    instances of one range must compute the same numbers (a sequence bound to either gets the same tokens)."""
    like = pipe.stages[0]
    problems = [
        (report.get("fingerprint") != pipe.fingerprint,
         f"its model file is another one (fingerprint {report.get('fingerprint')}, {report.get('model')}); the "
         f"mesh serves {pipe.fingerprint} ({like.model}): give --model the mesh's file"),
        (report.get("dtype") != like.dtype or bool(report.get("batch_invariant")) != like.batch_invariant,
         f"it computes in {report.get('dtype')}{' batch-invariant' if report.get('batch_invariant') else ''}, the "
         f"mesh in {like.dtype}{' batch-invariant' if like.batch_invariant else ''}: join with --dtype {like.dtype}"
         f"{' --batch-invariant' if like.batch_invariant else ''}"),
        (report.get("kv_dtype", like.kv_dtype) != like.kv_dtype,
         f"it keeps K/V in {report.get('kv_dtype')}, the mesh in {like.kv_dtype} (a re-split moves K/V between "
         f"stages as it is): join with --kv-dtype {like.kv_dtype}"),
        (not isinstance(report.get("max_seq_len"), int) or report["max_seq_len"] < pipe.max_seq_len,
         f"it holds a context of {report.get('max_seq_len')} positions, the mesh serves {pipe.max_seq_len}: give it "
         f"more memory (--memory-budget) or start the mesh with --max-seq-len {report.get('max_seq_len')}"),
        (not isinstance(report.get("kv_slots"), int) or report["kv_slots"] < pipe.kv_slots,
         f"it has {report.get('kv_slots')} KV slots, the mesh runs {pipe.kv_slots} sequences: join with --kv-slots "
         f"{pipe.kv_slots}"),
        ((key is None) != (pipe.keys is None),
         "it " + ("has no CURVE key and the mesh uses CURVE" if key is None else
                  "sends a CURVE key and the mesh is plaintext (--insecure-plaintext)")),
    ]
    if primary is not None:
        problems.insert(2, (report.get("weights_mode") != primary.weights_mode,
                            f"its weights run as {report.get('weights_mode')}, those of the range it would "
                            f"replicate (layers {primary.layers[0]}:{primary.layers[1]}) as {primary.weights_mode}: "
                            f"join with --weights {primary.weights_mode}"))
    return next((why for bad, why in problems if bad), None)


async def joiner_info(pipe, join_id: str, url: str, layers: tuple[int, int], key: str | None) -> StageInfo:
    """A ready joiner's /info, or JoinError when it does not answer or serves other layers or another key than
    join `join_id` was given."""
    info = await pipe.fetch_info(url)
    if not isinstance(info, StageInfo):
        raise JoinError(f"the joiner's {url}/info does not answer: {info}")
    if tuple(info.layers) != layers or (info.keys or {}).get("public") != key:
        raise JoinError(f"the stage at {url} serves layers {info.layers[0]}:{info.layers[1]} with key "
                        f"{(info.keys or {}).get('public')}, not what join {join_id} was given")
    return info


def per_layer_ms(info: StageInfo, report: dict) -> float:
    """A stage's cost per layer: its calibration at one row a step when it has one (--calibrate), else the joiner's
    measured cost (its report's ms_per_layer) scaled by the cores each can use (threads under its cgroup's CPU
    limit, shared.cpu.busy_cores): hosts alike but for their CPU shares until measured. A stage held to half a
    core costs twice a joiner with a whole one."""
    c = info.calibration
    if c and c.get("rows") and 1 in c["rows"]:
        return c["ms_per_step"][c["rows"].index(1)] / max(1, info.layers[1] - info.layers[0])
    return joiner_ms(report) * joiner_cores(report) / busy_cores(info.threads, info.cpu_limit)


def joiner_ms(report: dict) -> float:
    """The joiner's measured cost per layer (its probe at one row a step)."""
    ms = report.get("ms_per_layer")
    return float(ms) if isinstance(ms, (int, float)) and ms > 0 else 1.0


def joiner_cores(report: dict) -> float:
    """The cores the joiner's probe ran on (a joiner of an older version reports none: one)."""
    cores = report.get("cores")
    return float(cores) if isinstance(cores, (int, float)) and 0 < cores <= 4096 else 1.0


def send_key(pipe) -> str | None:
    return pipe.keys.send.public.decode() if pipe.keys is not None else None


def receive_key(pipe) -> str | None:
    return pipe.keys.receive.public.decode() if pipe.keys is not None else None


def result_address(listen: str, host: str | None) -> str:
    """The gateway's result address as a stage reaches it: a wildcard host replaced by `host` (the one the joiner
    reached the gateway's HTTP at)."""
    scheme, _, rest = listen.partition("://")
    bind_host, _, port = rest.rpartition(":")
    if bind_host in ("*", "0.0.0.0", "[::]", "::") and host:
        return f"{scheme}://{host}:{port}"
    return listen
