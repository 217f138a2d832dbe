"""The mesh view: one JSON picture of the whole pipeline, served by the gateway as a snapshot (`GET /v1/mesh`) and a
stream of snapshots (`GET /v1/mesh/stream`, server-sent events), drawn by the page at `/#mesh` and printed by
`stagemesh status`.

Nothing here talks to a stage: per-stage facts come from the `/info` polls the Pipeline already makes (cumulative
busy / micro-batch / hop counters with the stage's own monotonic clock, so rates between two polls are exact), and
the gateway's facts from its scheduler and metrics registry. One sampler task builds a snapshot per tick and
serializes it once, whatever the number of subscribers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlparse

from aiohttp import web

from services.gateway.api import sse
from services.gateway.engine.balance import SPLIT_AUTO_WAITING
from services.gateway.engine.mesh_change import ResplitError
from services.gateway.engine.replicas import Replica
from services.gateway.frontend.frontend import GATEWAY, Gateway, json_body, run_while_serving
from services.gateway.frontend.schemas import RequestError
from shared.errors import LayerRangeError
from shared.files.layers import parse_split
from shared.wire.stage_info import StageInfo

log = logging.getLogger("stagemesh.gateway.mesh")

TICK_S = 1.0
WINDOW_S = 10.0  # busy fraction, compute and hop times, TTFT: averaged over this window
# what a stage's entry carries of its /info as it is, under StageInfo's names
STAGE_FIELDS = ("kv_slots", "kv_slots_used", "kv_max_seq_len", "kv_slots_cached", "prefixes_evicted", "kv_cached_bytes",
                "kv_prefix_memory_bytes", "kv_shared_bytes", "microbatches", "busy_seconds",
                "head_seconds", "cpu_seconds", "cpu_limit")
HISTORY_POINTS = 120  # the charts' length, in ticks


def _rate(samples: deque, key: str, per: str | None = None, window_s: float = WINDOW_S,
          clock: str = "clock_s") -> float | None:
    """Δkey / Δper (Δclock when per is None) between the newest sample and the oldest one within window_s of it.
    None with fewer than two samples or a zero denominator."""
    if len(samples) < 2:
        return None
    def get(sample, name: str) -> float:  # the gateway's gauges are dicts, a stage's polls StageInfo
        return sample[name] if isinstance(sample, dict) else getattr(sample, name)

    newest = samples[-1]
    oldest = next((s for s in samples if get(newest, clock) - get(s, clock) <= window_s + 1e-6 and s is not newest),
                  None)
    if oldest is None:
        return None
    den = (get(newest, per) - get(oldest, per)) if per else (get(newest, clock) - get(oldest, clock))
    return (get(newest, key) - get(oldest, key)) / den if den > 0 else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


def _values(registry) -> dict[str, float]:
    """Every unlabelled sample of a registry by name (one collection pass)."""
    return {s.name: s.value for fam in registry.collect() for s in fam.samples if not s.labels}


@dataclass
class StageTrack:
    """What the view remembers of one stage between polls."""

    samples: deque = field(default_factory=lambda: deque(maxlen=64))  # its /info polls (StageInfo), oldest first
    last_info: StageInfo | str | None = None
    incarnation: str | None = None
    restarts: int = 0  # new incarnations seen after the first
    lost_polls: int = 0  # polls that found it unreachable


class MeshView:
    def __init__(self, gateway: Gateway, tick_s: float = TICK_S, window_s: float = WINDOW_S):
        self.gw = gateway
        self.tick_s = tick_s
        self.window_s = window_s
        self.tracks: dict[str, list[StageTrack]] = {}  # pipeline name -> its stages' tracks
        self._seen_infos: dict[str, object] = {}
        self.series: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self.gauges: deque[dict] = deque(maxlen=int(window_s / tick_s) + 2)  # registry counters per tick
        self.snapshot: dict = {}
        self.encoded = "{}"
        self.version = 0
        self._changed = asyncio.Event()

    # ---- sampling -----------------------------------------------------------------------------------------------

    def _take_polls(self, name: str, infos: list) -> None:
        if infos is self._seen_infos.get(name):
            return
        self._seen_infos[name] = infos
        tracks = self.tracks.setdefault(name, [])
        while len(tracks) < len(infos):
            tracks.append(StageTrack())
        for track, info in zip(tracks, infos):
            track.last_info = info
            if not isinstance(info, StageInfo):
                track.lost_polls += 1
                continue
            if info.incarnation != track.incarnation:
                if track.incarnation is not None:
                    track.restarts += 1
                track.incarnation = info.incarnation
                track.samples.clear()  # counters restart with the process
            track.samples.append(info)

    def sample(self) -> dict:
        """Take one tick: fold in new /info polls, read the schedulers and the registry, build the snapshot."""
        gw, replicas = self.gw, self.gw.replicas.all
        for r in replicas:
            self._take_polls(r.name, r.pipeline.infos)
        now = time.monotonic()
        values = _values(gw.metrics.registry)
        ttft = "stagemesh_gateway_time_to_first_token_seconds"
        hop = "stagemesh_gateway_result_hop_latency_seconds"
        self.gauges.append({"clock_s": now, "tokens": values.get("stagemesh_gateway_generated_tokens_total", 0.0),
                            "ttft_sum": values.get(f"{ttft}_sum", 0.0), "ttft_count": values.get(f"{ttft}_count", 0.0),
                            "hop_sum": values.get(f"{hop}_sum", 0.0), "hop_count": values.get(f"{hop}_count", 0.0)})
        tokens_per_s = _rate(self.gauges, "tokens", window_s=self.tick_s * 1.5)
        pipelines = [self._pipeline(r, values) for r in replicas]
        ready = any(p["ready"] for p in pipelines)
        gateway = {
            **{k: sum(p[k] for p in pipelines) for k in ("queue", "running", "inflight", "max_inflight", "replaying")},
            "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 2),
            "ttft_ms": _ms(_rate(self.gauges, "ttft_sum", "ttft_count", self.window_s)),
            "generated_tokens": int(values.get("stagemesh_gateway_generated_tokens_total", 0)),
            "failovers": int(values.get("stagemesh_gateway_pipeline_failovers_total", 0)),
            "replayed_sequences": int(values.get("stagemesh_gateway_replayed_sequences_total", 0)),
            "prefix_cache": _sum_prefix([p["prefix_cache"] for p in pipelines]),
            "speculation": replicas[0].scheduler.speculator.info(),  # one speculator serves every pipeline
        }
        gw.metrics.pipeline_ready.set(1 if ready else 0)
        result_hop = _ms(_rate(self.gauges, "hop_sum", "hop_count", self.window_s))
        for p in pipelines:
            for i, st in enumerate(p["stages"]):  # a stage's hop to the next is measured where it lands
                st["hop_next_ms"] = p["stages"][i + 1].get("hop_in_ms") if i + 1 < len(p["stages"]) else result_hop
        stages = pipelines[0]["stages"] if len(pipelines) == 1 else [s for p in pipelines for s in p["stages"]]
        self.series.append({"t": round(time.time(), 3), "queue": gateway["queue"], "running": gateway["running"],
                            "inflight": gateway["inflight"], "tokens_per_s": gateway["tokens_per_s"],
                            "ttft_ms": gateway["ttft_ms"]})
        self.snapshot = {
            "time": round(time.time(), 3), "ready": ready and not gw.draining,
            "problem": gw.replicas.problem, "draining": gw.draining, "window_s": self.window_s,
            "stages": stages, "gateway": gateway, "pipelines": pipelines,
            "series": {k: [p[k] for p in self.series] for k in ("t", "queue", "running", "inflight", "tokens_per_s",
                                                                 "ttft_ms")},
        }
        self.encoded = json.dumps(self.snapshot, separators=(",", ":"))
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        return self.snapshot

    def _pipeline(self, replica: Replica, values: dict[str, float]) -> dict:
        """One pipeline: its state, load, cache and stages (the `pipelines` list of the snapshot)."""
        sched, pipe = replica.scheduler, replica.pipeline
        many = len(self.gw.replicas.all) > 1
        stages = [self._stage(replica.name, i, url, sched.replaying, many) for i, url in enumerate(pipe.stage_urls)]
        layers = [st.get("layers") for st in stages]
        engine = replica.engine.mesh  # its mesh changes (services/gateway/engine/mesh_change.py)
        return {
            "split": None if None in layers else ",".join(str(r[1]) for r in layers[:-1]),
            "resplitting": engine.resplitting, "resplit_phase": engine.resplit_phase, "resplits": engine.resplits[-4:],
            "resplits_done": sum(1 for r in engine.resplits if r["outcome"] == "done"),
            "replacements": engine.replacements[-4:],  # stage processes handed a place (POST /v1/mesh/replace)
            "auto_rebalance": None if engine.balancer is None else {
                "window_s": engine.balancer.window_s, "min_gain": engine.balancer.min_gain,
                "last_proposal": {k: engine.balancer.last_proposal[k] for k in ("split_now", "split_proposed",
                                                                               "predicted_gain")}
                if engine.balancer.last_proposal else None},
            # --split auto's decision at start: state, and the proposal (each stage's calibration, ms per layer,
            # the split chosen, the predicted gain over the split the stages started with); None without it
            "split_auto": None if engine.start_split is None else engine.start_split.info(),
            # ready as /ready counts it: the stages consistent and, under --split auto, the split chosen
            "name": replica.name, "ready": pipe.ready and engine.split_settled,
            "state": "lost" if not pipe.ready else "ready" if engine.split_settled else "measuring",
            "problem": pipe.problem or (None if engine.split_settled else SPLIT_AUTO_WAITING), "load": replica.load, "queue": len(sched.waiting), "running": len(sched.running),
            "inflight": len(sched.inflight), "max_inflight": sched.max_inflight, "replaying": sched.replaying,
            "kv_used_ratio": round(replica.kv_used_ratio(), 4),
            "routed": replica.routed_total, "handed_off": replica.handed_off,
            "prefix_cache": sched.prefix.info() if sched.prefix is not None else None, "stages": stages,
            # replicas of a stage: per range, every stage process serving it (services/gateway/engine/chains.py);
            # None in a mesh without replicas
            "instances": sched.chains.view() if sched.chains.replicated else None,
        }

    def _stage(self, name: str, i: int, url: str, replaying: int, labelled: bool = False) -> dict:
        tracks = self.tracks.get(name, [])
        track = tracks[i] if i < len(tracks) else StageTrack()
        info = track.last_info
        st: dict = {"index": i, "url": url, "restarts": track.restarts, "lost_polls": track.lost_polls}
        if labelled:
            st["pipeline"] = name
        if not isinstance(info, StageInfo):
            st.update(state="lost" if info is not None else "unknown", error=info)
            return st
        busy = _rate(track.samples, "busy_seconds", window_s=self.window_s)
        st.update(
            state="replaying" if replaying else "ready", error=None, layers=list(info.layers),
            position=info.position, listen=info.listen, incarnation=info.incarnation, device=info.device,
            dtype=info.dtype, busy_fraction=None if busy is None else round(min(1.0, max(0.0, busy)), 4),
            compute_ms=_ms(_rate(track.samples, "busy_seconds", "microbatches", self.window_s)),
            hop_in_ms=_ms(_rate(track.samples, "hop_latency_seconds_sum", "hop_latency_seconds_count", self.window_s)),
            # StageInfo's own names (its metrics' names)
            **{name: getattr(info, name) for name in STAGE_FIELDS})
        return st

    # ---- serving ------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # the view must never take the gateway down
                log.exception("mesh view sample failed")
            await asyncio.sleep(self.tick_s)

    async def next_after(self, version: int, timeout: float) -> int:
        """Wait (at most timeout) until a snapshot newer than `version` exists; returns the current version."""
        if self.version <= version:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
        return self.version


def _sum_prefix(infos: list[dict | None]) -> dict | None:
    """The replicas' prefix cache facts added up (one replica: its own)."""
    infos = [i for i in infos if i is not None]
    if len(infos) <= 1:
        return infos[0] if infos else None
    total = {k: sum(i[k] for i in infos) for k in ("prefixes", "cached_tokens", "lookups", "hits", "reused_tokens",
                                                    "kept", "evicted", "misses", "audits", "audit_mismatches")}
    total["hit_rate"] = round(total["hits"] / total["lookups"], 4) if total["lookups"] else None
    return {"block_tokens": infos[0]["block_tokens"], **total}


MESH_VIEW = web.AppKey("mesh_view", MeshView)


async def mesh_snapshot(request: web.Request) -> web.Response:
    view = request.app[MESH_VIEW]
    if not view.version:
        view.sample()
    return web.Response(text=view.encoded, content_type="application/json")


async def mesh_stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: one `data: <snapshot JSON>` per tick until the client leaves or the gateway drains."""
    view = request.app[MESH_VIEW]
    out = await sse.SSEStream.open(request)
    if not view.version:
        view.sample()
    version = 0
    while not view.gw.draining:
        if view.version > version:
            version = view.version
            await out.send(view.encoded)
        await view.next_after(version, timeout=view.tick_s * 2)
    return out.resp


async def mesh_resplit(request: web.Request) -> web.Response:
    """POST /v1/mesh/resplit {"split": "18" | [18], "pipeline": 0}: move a serving pipeline to that split live
    (Engine.resplit), answering what was done; a split the mesh cannot move to, or one a stage refuses, is a 4xx/503
    error naming why, and the mesh serves on as it was."""
    gw = request.app[GATEWAY]
    body = await json_body(request)
    unknown = set(body) - {"split", "pipeline"}
    if unknown:
        raise RequestError(f"unknown field {sorted(unknown)[0]!r}: give split (layer boundaries, e.g. \"18\") and "
                           "optionally pipeline", param=sorted(unknown)[0])
    pipeline = body.get("pipeline", 0)
    replicas = gw.replicas.all
    if type(pipeline) is not int or not 0 <= pipeline < len(replicas):
        raise RequestError(f"pipeline must be an index within 0..{len(replicas) - 1}", param="pipeline")
    split = body.get("split")
    if isinstance(split, list) and len(split) < 256 and all(type(b) is int for b in split):
        split = ",".join(map(str, split))
    if not isinstance(split, str) or len(split) > 2048:
        raise RequestError("split must be the layer boundaries between stages: a string such as \"18\" or "
                           "\"10,20\", or a list of integers", param="split")
    replica = replicas[pipeline]
    try:
        ranges = parse_split(split, replica.pipeline.num_layers)
        return web.json_response(await replica.engine.mesh.resplit(ranges))
    except LayerRangeError as e:
        raise RequestError(f"split {split!r}: {e}", param="split", code="bad_split") from None
    except ResplitError as e:
        code = "bad_split" if e.status == 400 else "resplit_refused"
        raise RequestError(str(e), param="split" if e.status == 400 else None, status=e.status, code=code) from None


async def mesh_replace(request: web.Request) -> web.Response:
    """POST /v1/mesh/replace {"stage": 1, "url": "http://10.0.0.7:8102", "pipeline": 0}: the stage process whose HTTP
    is at `url` takes stage 1's place (Engine.replace_stage), answering what was done; one that does not fit the
    place, or a route that does not carry, is a 4xx/503 error naming why, and the pipeline stays as it was."""
    gw = request.app[GATEWAY]
    body = await json_body(request)
    unknown = set(body) - {"stage", "url", "pipeline"}
    if unknown:
        raise RequestError(f"unknown field {sorted(unknown)[0]!r}: give stage (its index), url (the new stage "
                           "process's HTTP address) and optionally pipeline", param=sorted(unknown)[0])
    pipeline, replicas = body.get("pipeline", 0), gw.replicas.all
    if type(pipeline) is not int or not 0 <= pipeline < len(replicas):
        raise RequestError(f"pipeline must be an index within 0..{len(replicas) - 1}", param="pipeline")
    stage, url = body.get("stage"), body.get("url")
    if type(stage) is not int:
        raise RequestError("stage must be the index of the place to take over, e.g. 1", param="stage")
    if not isinstance(url, str) or len(url) > 512 or urlparse(url).scheme not in ("http", "https") \
            or not urlparse(url).hostname:
        raise RequestError("url must be the new stage process's HTTP address, e.g. http://10.0.0.7:8102 (its "
                           "--http)", param="url")
    try:
        return web.json_response(await replicas[pipeline].engine.mesh.replace_stage(stage, url))
    except ResplitError as e:
        raise RequestError(str(e), param="url" if e.status == 400 else None, status=e.status,
                           code="bad_replacement" if e.status == 400 else "replacement_refused") from None


def add_mesh_view(app: web.Application, gateway: Gateway) -> None:
    """Routes and the sampler task of the mesh view (called by make_app)."""
    app[MESH_VIEW] = MeshView(gateway)
    run_while_serving(app, {"mesh-view": app[MESH_VIEW].run})
    app.router.add_get("/v1/mesh", mesh_snapshot)
    app.router.add_get("/v1/mesh/stream", mesh_stream)
    app.router.add_post("/v1/mesh/resplit", mesh_resplit)
    app.router.add_post("/v1/mesh/replace", mesh_replace)
