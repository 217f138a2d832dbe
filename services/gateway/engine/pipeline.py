"""A pipeline as the gateway sees it: its stages' HTTP endpoints, a consistency check, and the ZMQ client.
Kept an object (not a global) so several pipelines can later sit behind one gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from urllib.parse import urlparse

import aiohttp

from shared.config import SCHEDULER_DEFAULTS
from shared.errors import LayerRangeError
from shared.files.layers import LayerRange, check_cover
from shared.observe.log_throttle import throttled
from shared.wire.mesh_keys import SocketKeys
from shared.wire.pipeline_client import PipelineClient
from shared.wire.stage_info import MAX_INFO_BYTES, InfoError, StageInfo, refused_redirect, too_large

log = logging.getLogger("stagemesh.gateway.pipeline")


class Malformed(str):
    """Why a stage's /info cannot be used although the stage answered (check_pipeline says so, not "unreachable")."""


def check_pipeline(infos: list[StageInfo | str], fingerprint: str, num_layers: int) -> str | None:
    """None when the stages form one consistent pipeline in the given order; otherwise why not.
    An entry that is a string is a stage we could not reach (the string says why)."""
    for i, info in enumerate(infos):
        if isinstance(info, str):
            return f"stage {i} {'is not usable' if isinstance(info, Malformed) else 'is unreachable'}: {info}"
        if info.fingerprint != fingerprint:
            return (f"stage {i} serves model fingerprint {info.fingerprint} ({info.model}), "
                    f"the gateway's model is {fingerprint}")
    try:
        ranges = [LayerRange(*info.layers) for info in infos]
        check_cover(ranges, num_layers)
    except LayerRangeError as e:
        return str(e)
    for i in range(len(ranges) - 1):
        if ranges[i].stop != ranges[i + 1].start:
            return f"stage {i} ({ranges[i]}) is not followed by the layers it hands on to; stage {i + 1} has {ranges[i + 1]}"
    for i, (info, rng) in enumerate(zip(infos, ranges)):
        expected = rng.position(num_layers).value
        if info.position != expected:
            return f"stage {i} ({rng}) reports position {info.position}, expected {expected}"
    kv_dtypes = [info.kv_dtype for info in infos]
    if len(set(kv_dtypes)) > 1:  # a re-split, a join or a leave moves K/V between stages as it is
        return (f"the stages keep K/V in different dtypes ({', '.join(kv_dtypes)} for stages 0..{len(infos) - 1}); "
                "start every stage with the same --kv-dtype")
    # the pipeline serves the least of its stages' contexts (each as its memory holds, Pipeline.max_seq_len); where
    # the context picks the rope factors (LongRoPE's long or short set) every stage must pick the same ones
    ropes = [r if (r := info.context.get("rope")) is None or isinstance(r, str) else f"a malformed {type(r).__name__}"
             for info in infos]
    if len(set(ropes)) > 1:
        lengths = ", ".join(str(info.kv_max_seq_len) for info in infos)
        return (f"the stages' contexts ({lengths} for stages 0..{len(infos) - 1}) choose different rope factors "
                f"({', '.join(map(str, ropes))}: LongRoPE's set depends on the context); start every stage with the "
                "same --max-seq-len")
    return None


def _short(key: str | None) -> str:
    return f"{key[:8]}..." if key else "none"


def check_keys(infos: list[StageInfo], keys: SocketKeys | None) -> str | None:
    """None when every hop's two ends hold the same key set: each sender dials the key its next hop serves, and
    each receiver accepts the key its upstream sends with. Otherwise the first hop that does not, named. `infos`:
    consistent stages' /info (their "keys"); `keys`: the gateway's own (None: plaintext, nothing to check)."""
    if keys is None:
        return None
    gateway = {"public": keys.receive.public.decode(), "accepts": keys.accept.decode(),
               "next": keys.next_server.decode() if keys.next_server else None, "send": keys.send.public.decode()}
    ends: list[tuple[str, dict | None]] = [("the gateway", gateway)]
    ends += [(f"stage {i}", info.keys) for i, info in enumerate(infos)]
    ends.append(("the gateway", gateway))
    for (a, ka), (b, kb) in zip(ends, ends[1:]):
        if ka is None or kb is None:
            plain = a if ka is None else b
            return f"hop {a} -> {b}: {plain} serves plaintext and the other end uses CURVE; start both with one key set"
        sends_with = ka.get("send", ka.get("public"))
        if ka.get("next") != kb.get("public"):
            return (f"hop {a} -> {b}: {b} holds another key set (its public key {_short(kb.get('public'))} is not "
                    f"the key {a} dials, {_short(ka.get('next'))}); restart it with the mesh's keys")
        if kb.get("accepts") != sends_with:
            return (f"hop {a} -> {b}: {b} accepts {_short(kb.get('accepts'))}, not {a}'s key {_short(sends_with)}; "
                    "restart it with the mesh's keys")
    return None


def stalled_hop(infos: list[StageInfo], mb_id: int, age_s: float) -> str:
    """Where micro-batch `mb_id`, sent `age_s` ago and never answered, stopped: the first stage whose /info does not
    list it as taken in (the hop before it lost it), or that took it in and never passed it on (stuck computing),
    else the hop back to the gateway. `infos`: consistent stages' /info; recent_mb_in / _out list the ids each
    stage's loop last took in and passed on."""
    lost = f"micro-batch {mb_id} sent {age_s:.0f} s ago never came back"
    before = "the gateway"
    for i, info in enumerate(infos):
        if mb_id not in info.recent_mb_in:
            return (f"hop {before} -> stage {i}: {lost}, and stage {i} never took it in (something else serves "
                    f"stage {i}'s address, or the network between them drops it)")
        if mb_id not in info.recent_mb_out:
            return f"stage {i}: {lost}; stage {i} took it in and never passed it on (its compute is stuck?)"
        before = f"stage {i}"
    return (f"hop {before} -> the gateway: {lost}, and {before} passed it on (its results go elsewhere than this "
            "gateway's --result-listen, or the network drops them)")


def reachable_address(listen: str, url: str) -> str:
    """A stage's ZMQ address from its /info's `listen`, with a wildcard host replaced by the host of `url`, where we
    reach its HTTP."""
    host = urlparse(url).hostname
    scheme, _, rest = listen.partition("://")
    bind_host, _, port = rest.rpartition(":")
    if bind_host in ("*", "0.0.0.0", "[::]", "::"):
        return f"{scheme}://{host}:{port}"
    return listen


class Pipeline:
    """One pipeline (a replica's chain of stages) as the gateway's engine serves it: the stages' /info polls, its
    health and readiness, its cache identity, and the PipelineClient (shared.wire) that carries its micro-batches --
    the sockets only; LocalPipeline (shared.runtime) is another thing, several stages' runtimes in one process.

    `stall_s`: a micro-batch in flight longer than this marks the pipeline not ready, naming where it stopped
    (stalled_hop), for as long again or until a stage restarts; its sequences are replayed after that."""

    def __init__(self, stage_urls: list[str], result_listen: str, fingerprint: str, num_layers: int,
                 first_stage: str | None = None, poll_s: float = SCHEDULER_DEFAULTS.stage_poll_s, keys: SocketKeys | None = None,
                 stall_s: float = SCHEDULER_DEFAULTS.stall_timeout_s):
        self.keys = keys  # the gateway's CURVE keys (None: plaintext, only with --insecure-plaintext)
        self.stage_urls = [u.rstrip("/") for u in stage_urls]
        self.result_listen = result_listen
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.first_stage = first_stage
        self.poll_s = poll_s
        self.infos: list[StageInfo | str] = []  # each stage's last /info, or why there is none (unreachable, Malformed)
        self.problem: str | None = "not checked yet"
        self.client: PipelineClient | None = None
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self.epoch = 0  # the pipeline's restart epoch, bumped only by mark_lost(): KV state in the pipeline is gone
        self.cache_identity = ""  # _cache_identity() of the last poll's infos
        self.lost_reason = ""  # why, the last time
        self._incarnations: list[str] | None = None
        self._dial_failures: list[int] | None = None  # each sender's failed outbound handshakes at the last check
        self.stall_s = stall_s
        self.name = ""  # its replica name when the gateway serves several (services/gateway/engine/replicas.py): logs say it
        self.resplitting = False  # a live re-split is moving layers: the stages' ranges pass through inconsistent ones
        self.spare: set[str] = set()  # sequences the first release_all leaves live: the gateway re-adopts them in place
        # (why, monotonic time it holds until, the stages' incarnations then) after a micro-batch was lost
        self._stall: tuple[str, float, list[str]] | None = None
        # a stage URL that stopped answering -> True while a replica of its range is to take its place
        # (ReplicaJoins.covers / promote): check() then waits for that instead of declaring the state lost
        self.standby: Callable[[str], bool] | None = None

    @property
    def label(self) -> str:
        """How logs name it: "pipeline", or "pipeline p1" among several."""
        return f"pipeline {self.name}" if self.name else "pipeline"

    @property
    def ready(self) -> bool:
        return self.problem is None and self.client is not None

    @property
    def stages(self) -> list[StageInfo]:
        """The stages' last /info, of those that answered with one."""
        return [i for i in self.infos if isinstance(i, StageInfo)]

    @property
    def kv_slots(self) -> int:
        return min((i.kv_slots for i in self.stages), default=1)

    @property
    def kv_rows(self) -> int:
        """KV rows on every stage, for running sequences and cached prefixes together (slots + prefix_slots)."""
        return min((i.kv_slots + i.kv_prefix_slots for i in self.stages), default=1)

    @property
    def prefix_positions(self) -> int | None:
        """The positions cached prefixes may hold on every stage: the least of each stage's --prefix-cache-memory
        over its bytes per position (None when a stage states no bound)."""
        bounds = [i.prefix_positions for i in self.stages]
        return None if None in bounds else min(bounds, default=None)

    @property
    def live_positions(self) -> int | None:
        """The positions running sequences may hold of their own on every stage: the least of each stage's bound
        (StageInfo.live_positions; None when no stage states one)."""
        bounds = [b for i in self.stages if (b := i.live_positions) is not None]
        return min(bounds, default=None)

    def _cache_identity(self) -> str:
        """What a cached prefix's K/V depends on besides its tokens: the model, and each stage's layers, dtype,
        weights mode and incarnation (a restarted stage keeps nothing). The prefix index roots its hashes here."""
        stages = [(i.layers, i.dtype, i.weights_mode, i.batch_invariant, i.incarnation) for i in self.stages]
        return repr((self.fingerprint, stages))

    @property
    def max_seq_len(self) -> int:
        return min((i.kv_max_seq_len for i in self.stages), default=0)

    def mark_lost(self, reason: str) -> None:
        """The one place that declares the pipeline's KV state lost (a stage died, restarted, or forgot a
        sequence): the scheduler sees the new epoch and replays every running sequence."""
        self.epoch += 1
        self.lost_reason = reason
        log.warning("%s state lost (%s): epoch %d", self.label, reason, self.epoch)

    def forgot_sequences(self, reason: str) -> None:
        """A stage answered that it does not know a sequence: it restarted between health polls (a spare took its
        place at once, say), or a holder of the last stage's key forged the answer. The pipeline's state counts as lost
        once, here: the next check takes the stages' incarnations as they are, so the restart this answer revealed is
        not counted again as "a stage restarted" (one kill, one replay against a request's max_replays). A later
        restart is still seen: its stage forgets what it is sent next."""
        self._incarnations = None
        self.mark_lost(reason)

    def mark_stalled(self, mb_id: int, age_s: float) -> None:
        """A micro-batch has been in flight longer than stall_s: the pipeline is not ready, naming where it stopped,
        for stall_s more or until a stage restarts (a fix); its KV state counts as lost (the scheduler replays)."""
        infos = self.stages
        why = stalled_hop(infos, mb_id, age_s) if len(infos) == len(self.infos) else f"micro-batch {mb_id} was lost"
        self._stall = (why, time.monotonic() + self.stall_s, [i.incarnation for i in infos])
        log.warning("%s %s", self.label, why)
        if self.problem is None:
            self.mark_lost(why)
        self.problem = why

    def _stalled(self) -> str | None:
        """The stall still held (mark_stalled), or None once it expired or a stage restarted since."""
        if self._stall is None:
            return None
        why, until, incarnations = self._stall
        if time.monotonic() < until and [getattr(i, "incarnation", None) for i in self.infos] == incarnations:
            return why
        self._stall = None
        return None

    async def start(self) -> None:
        # /info bodies as sent (a stage never compresses them), so MAX_INFO_BYTES bounds what decompression makes too
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3), auto_decompress=False)
        await self.check()
        self._task = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.client:
            await self.client.close()
        if self._session:
            await self._session.close()

    async def _info(self, url: str) -> StageInfo | str:
        """The stage's /info, or why not: unreachable, not 200, or not a StageInfo (Malformed) -- a redirect (never
        followed: the URL is the stage's own address) or a body over MAX_INFO_BYTES (read no further) included."""
        try:
            async with self._session.get(f"{url}/info", allow_redirects=False) as r:
                if 300 <= r.status < 400:
                    return Malformed(refused_redirect(url, r.status, r.headers.get("Location")))
                if r.status != 200:
                    return f"{url}/info answered {r.status} (still loading?)"
                if (r.content_length or 0) > MAX_INFO_BYTES:
                    return Malformed(too_large(url))
                body = bytearray()
                async for chunk in r.content.iter_chunked(64 << 10):
                    body += chunk
                    if len(body) > MAX_INFO_BYTES:  # the rest is never read: leaving the block drops the connection
                        return Malformed(too_large(url))
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            return f"{url}: {type(e).__name__} {e}".strip()
        try:
            info = json.loads(body)
        except ValueError as e:  # UnicodeDecodeError included
            return Malformed(f"{url}/info is malformed: not JSON ({type(e).__name__})")
        try:
            return StageInfo.from_json(info)
        except InfoError as e:
            return Malformed(f"{url}/info is malformed: {e}")

    def _failed_dials(self) -> str | None:
        """A hop whose sender's handshakes failed since the last check (socket monitor counts: the gateway's own
        PUSH, each stage's "out" in its /info), named; None when none did. Only dialling counts: a receiver's
        failures come from whoever can reach its port, which says nothing about the mesh."""
        senders = ["the gateway", *(f"stage {i}" for i in range(len(self.infos)))]
        receivers = [*(f"stage {i}" for i in range(len(self.infos))), "the gateway"]
        counts = [self.client.transport.stats.handshakes_failed["out"] if self.client else 0]
        counts += [i.handshakes_failed.get("out", 0) if isinstance(i, StageInfo) else 0 for i in self.infos]
        before, self._dial_failures = self._dial_failures, counts
        if before is None or len(before) != len(counts):
            return None
        for sender, receiver, was, now in zip(senders, receivers, before, counts):
            if now > was:
                return (f"hop {sender} -> {receiver}: {now - was} CURVE handshakes failed since the last check "
                        f"({self.poll_s:g} s): {receiver} holds another key set, or something else serves its address")
        return None

    async def fetch_infos(self) -> list[StageInfo | str]:
        """Every stage's /info now, or why there is none (not kept: check() is what updates the pipeline's view)."""
        return list(await asyncio.gather(*(self._info(u) for u in self.stage_urls)))

    async def restarted_since(self, incarnations: list[str]) -> str | None:
        """Which stage restarted or stopped answering since its incarnation was `incarnations` (named), or None."""
        for i, info in enumerate(await self.fetch_infos()):
            if not isinstance(info, StageInfo):
                return f"stage {i} stopped answering ({info})"
            if i < len(incarnations) and info.incarnation != incarnations[i]:
                return f"stage {i} restarted"
        return None

    async def check(self) -> None:
        if self.resplitting:  # Engine.resplit checks again once the stages serve the new split
            return
        urls = list(self.stage_urls)
        infos = await self.fetch_infos()
        if self.resplitting or urls != self.stage_urls:  # a re-split or promotion began while they were asked
            return
        if self.standby is not None and any(not isinstance(i, StageInfo) and self.standby(u)
                                            for u, i in zip(urls, infos)):
            return  # a replica takes the silent stage's place (its sequences alone replay): no loss to declare
        self.infos = infos
        self.cache_identity = self._cache_identity()  # once per poll, not per scheduler step
        problem = check_pipeline(self.infos, self.fingerprint, self.num_layers)
        if problem is None:
            problem = check_keys(self.infos, self.keys) or self._failed_dials() or self._stalled()
        if problem != self.problem:
            (log.info if problem is None else log.warning)("%s %s", self.label,
                                                           "consistent" if problem is None else problem)
            if problem is not None and self.problem is None:
                self.mark_lost(problem)
            self.problem = problem
        if problem is None:
            incarnations = [i.incarnation for i in self.stages]
            if self._incarnations is not None and incarnations != self._incarnations:
                self.mark_lost(f"a stage restarted (incarnations {self._incarnations} -> {incarnations})")
            self._incarnations = incarnations
        if problem is None and self.client is None:
            self.client = PipelineClient(self.first_stage or self._first_stage_address(), self.result_listen,
                                         keys=self.keys)
            await self.client.start()
            # we own no sequence yet: take back what an earlier gateway left, but what we re-adopt (once)
            spare, self.spare = self.spare, set()
            await self.client.release_all(sorted(spare))

    def _first_stage_address(self) -> str:
        return reachable_address(self.stages[0].listen, self.stage_urls[0])

    def replaced(self, place: int, url: str, first_stage: str | None, infos: list[StageInfo]) -> None:
        """The stage process at `url` serves `place` from now on (Engine.replace_stage rerouted the pipeline to it;
        `first_stage`: its address, for place 0). It holds no K/V: the pipeline's state counts as lost once, here
        (`infos`, the stages now: their incarnations keep the next check from counting the new one as another loss;
        that check reads the stages' /info itself)."""
        self.stage_urls[place] = url
        if first_stage is not None:
            self.first_stage = first_stage
        self._incarnations = [i.incarnation for i in infos]
        self.mark_lost(f"stage {place} replaced by the process at {url}")

    def members_changed(self, stage_urls: list[str], first_stage: str, keys: SocketKeys | None,
                        lost: bool = True) -> None:
        """The pipeline's stages are now the processes at `stage_urls` (a host joined, left or was lost:
        services/gateway/engine/membership.py routed the pipeline through them; `first_stage`: the first one's
        address; `keys`: the gateway's own keys now, the first stage's server key and the last stage's client key
        among them). `lost`: a stage whose layers changed holds none of their K/V (a loss; a join or a leave whose
        K/V hand-over did not come back), so the pipeline's state counts as lost once, here; not after one that
        moved it (a sequence a stage lacks then answers unknown_sequence, which is a loss then)."""
        self.stage_urls = [u.rstrip("/") for u in stage_urls]
        self.first_stage = first_stage
        self.keys = keys
        self._incarnations = None  # the next check takes the new stages' incarnations as they are
        self._dial_failures = None
        if lost:
            self.mark_lost(f"the mesh's members changed: {len(stage_urls)} stages")

    def promoted(self, place: int, url: str, keys: SocketKeys | None) -> None:
        """A replica of stage `place`, the process at `url`, serves that place from now on (ReplicaJoins.promote
        routed the pipeline through it; `keys`: the gateway's own keys now). It holds the K/V of its own sequences
        and the other stages theirs: nothing counts as lost here (the gateway replayed only the dead process's)."""
        self.stage_urls[place] = url.rstrip("/")
        self.keys = keys
        self._incarnations = None  # the next check takes the stages' incarnations as they are
        self._dial_failures = None

    async def fetch_info(self, url: str) -> StageInfo | str:
        """One stage's /info at `url` (any stage process, in this pipeline or not), or why there is none."""
        return await self._info(url.rstrip("/"))

    async def _poll(self) -> None:
        """Check every poll_s for as long as the gateway runs: a failed check is logged, never the poller's end
        (after which stage failures would go unnoticed)."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.check()
            except Exception as e:
                throttled(log, logging.ERROR, "check", "pipeline check failed: %s: %s", type(e).__name__, e, exc_info=e)
