"""`stagemesh status [URL] [--watch] [--json]`: the gateway's mesh view (`GET /v1/mesh`) as a terminal table.
Exit code 0 when the mesh is ready, 1 when it is not (the message names the stage), 2 when the gateway cannot be
reached, 3 when it refuses the API key -- so scripts and probes can use it."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

from services.gateway.config import API_KEY_ENV, OPERATOR_KEY_ENV, OPERATOR_PATHS
from shared.config import GATEWAY_PORT
from shared.errors import StagemeshError

DEFAULT_URL = f"http://127.0.0.1:{GATEWAY_PORT}"
NOT_READY = 1
KEY_REFUSED = 3


class KeyRefused(StagemeshError):
    """The gateway answered, and refused our API key (401/403): not the same as unreachable."""


def register(sub) -> None:
    p = sub.add_parser("status", help="the mesh at a glance (exit 1 when it is not ready)",
                       description="Stages left to right with layer range, address, state, busy fraction, compute "
                                   "time per micro-batch, hop latency and KV slots, and the gateway's queue, running "
                                   "sequences, micro-batches in flight, tokens/s and TTFT, from one gateway. Exit "
                                   "code 0 when ready, 1 when not (naming the stage), 2 when the gateway is "
                                   "unreachable, 3 when it refuses the API key (STAGEMESH_API_KEY).")
    p.add_argument("url", nargs="?", default=os.environ.get("STAGEMESH_URL", DEFAULT_URL),
                   help=f"the gateway (default $STAGEMESH_URL or {DEFAULT_URL})")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON (one line per refresh)")
    p.set_defaults(func=cmd_status)


def gateway_request(url: str, path: str, body: dict | None = None) -> urllib.request.Request:
    """A request to the gateway at `url` (a JSON POST when `body` is given), with STAGEMESH_API_KEY as its bearer
    token when set -- STAGEMESH_OPERATOR_KEY on the routes that change the mesh: what every command that talks to a
    gateway sends."""
    req = urllib.request.Request(url.rstrip("/") + path, method="GET" if body is None else "POST",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={} if body is None else {"Content-Type": "application/json"})
    env = OPERATOR_KEY_ENV if path in OPERATOR_PATHS else API_KEY_ENV
    if key := os.environ.get(env):
        req.add_header("Authorization", f"Bearer {key}")
    return req


def fetch(url: str, timeout: float = 10.0) -> dict:
    req = gateway_request(url, "/v1/mesh")
    key = os.environ.get("STAGEMESH_API_KEY")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            why = "sent no API key: set STAGEMESH_API_KEY to the gateway's key" if not key else \
                "refused STAGEMESH_API_KEY: it is not the gateway's key"
            raise KeyRefused(f"{url}/v1/mesh answered {e.code}: the gateway is up and {why}") from None
        raise StagemeshError(f"{url}/v1/mesh answered {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    except (OSError, ValueError) as e:
        raise StagemeshError(f"cannot reach the gateway at {url}: {e}") from None


def not_ready_reason(snap: dict) -> str | None:
    """None when the mesh is ready; otherwise a sentence that names the stage (or the pipeline-wide problem)."""
    pipelines = snap.get("pipelines") or []
    if snap.get("ready") and all(p.get("ready") for p in pipelines):
        return None
    bad = [s for s in snap.get("stages", []) if s.get("state") not in ("ready", "replaying")]
    if bad:
        return "; ".join(f"{_pipeline_of(s)}stage {s['index']} ({s['url']}) is {s['state']}: "
                         f"{s.get('error') or 'no answer'}" for s in bad)
    lost = [p for p in pipelines if not p.get("ready")]
    if lost and len(pipelines) > 1:
        return "; ".join(f"pipeline {p['name']} is not ready: {p.get('problem')}" for p in lost)
    if snap.get("draining"):
        return "the gateway is draining"
    return snap.get("problem") or "the pipeline is not ready"


def _pipeline_of(stage: dict) -> str:
    return f"pipeline {stage['pipeline']} " if stage.get("pipeline") else ""


def _pipelines_table(pipelines: list[dict]):
    """One row per pipeline (only with several): state, load, KV use, cache hit rate, requests routed."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="pipelines (requests routed by prefix cache, session and load)", title_justify="left")
    for col in ("pipeline", "state", "stages", "queue", "running", "KV used", "cache hits", "routed", "handed off"):
        t.add_column(col, justify="left" if col in ("pipeline", "state", "stages") else "right")
    for p in pipelines:
        pc = p.get("prefix_cache") or {}
        rate = "–" if pc.get("hit_rate") is None else f"{100 * pc['hit_rate']:.0f}%"
        t.add_row(p["name"], Text(p["state"], style="green" if p["ready"] else "red"), str(len(p["stages"])),
                  str(p["queue"]), str(p["running"]), f"{100 * p['kv_used_ratio']:.0f}%", rate, str(p["routed"]),
                  str(p["handed_off"]))
    return t


def replica_lines(p: dict, prefix: str = "") -> list[str]:
    """A pipeline's replicated ranges drawn as a graph: a range with several stage processes, each with its
    sequences and measured ms per micro-batch ([] in a mesh without replicas)."""
    out = []
    for i, instances in enumerate(p.get("instances") or []):
        if len(instances) < 2:
            continue
        a, b = instances[0]["layers"]
        out.append(f"{prefix}stage {i} ({a}:{b}) has {len(instances)} processes:")
        for n, inst in enumerate(instances):
            ms = "–" if inst["ms_per_micro_batch"] is None else f"{inst['ms_per_micro_batch']:.1f} ms/mb"
            branch = "└─" if n == len(instances) - 1 else "├─"
            out.append(f"  {branch} {inst['id']} {inst['url']} ({'primary' if inst['primary'] else 'replica'}: "
                       f"{inst['sequences']} sequences, {ms})")
    return out


def _fmt(x, unit: str = "", digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}{unit}"


WIDE = 120  # columns from which the stages table has the addresses and the cached prefixes in cells of their own


def _kv_cached(s: dict) -> str:
    """A stage's cached prefixes in words: '2 cached, 12 of 4096 MiB, 300 MiB shared' ('' when none)."""
    if not s.get("kv_slots_cached"):
        return ""
    text = f"{s['kv_slots_cached']} cached"
    if s.get("kv_cached_bytes") is not None and s.get("kv_prefix_memory_bytes"):  # their K/V, of the bound
        text += f", {s['kv_cached_bytes'] / 2**20:.0f} of {s['kv_prefix_memory_bytes'] / 2**20:.0f} MiB"
    if s.get("kv_shared_bytes"):  # K/V slots read from those prefixes' pages rather than copies
        text += f", {s['kv_shared_bytes'] / 2**20:.0f} MiB shared"
    return text


def render(snap: dict, width: int = WIDE):
    """A rich renderable for a console `width` columns wide: the stages table and the gateway's lines. Below WIDE
    columns the table keeps the figures (80 columns fit) and each stage's addresses and cached prefixes go on lines
    of their own under it."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    colors = {"ready": "green", "replaying": "yellow", "lost": "red", "unknown": "red"}
    pipelines = snap.get("pipelines") or []
    many, wide = len(pipelines) > 1, width >= WIDE
    t = Table(title="stagemesh pipeline (stages left to right = top to bottom)", title_justify="left")
    columns = ["stage", "layers", *(("address",) if wide else ()), "state", "busy", "compute/mb", "hop→next",
               "KV slots", "restarts"]
    for col in columns:
        t.add_column(col, justify="left" if col in ("stage", "layers", "address", "state") else "right",
                     no_wrap=not wide)
    notes = []
    for s in snap.get("stages", []):
        name = (f"{s['pipeline']}/{s['index']}" if many and s.get("pipeline") else str(s["index"]))
        layers = f"{s['layers'][0]}:{s['layers'][1]}" if s.get("layers") else "–"
        busy = None if s.get("busy_fraction") is None else 100 * s["busy_fraction"]
        kv = f"{s['kv_slots_used']}/{s['kv_slots']}" if s.get("kv_slots") is not None else "–"
        cached = _kv_cached(s)
        if wide and cached:
            kv += f" ({cached})"
        addr = s["url"] + (f"\n{s['listen']}" if s.get("listen") else "")
        if not wide:
            notes.append(f"stage {name}: {s['url']}" + (f" · {s['listen']}" if s.get("listen") else "")
                         + (f"\n  cached prefixes: {cached}" if cached else ""))
        t.add_row(name, layers, *((addr,) if wide else ()), Text(s["state"], style=colors.get(s["state"], "")),
                  _fmt(busy, "%"), _fmt(s.get("compute_ms"), " ms"), _fmt(s.get("hop_next_ms"), " ms", 2), kv,
                  str(s.get("restarts", 0)))
    g = snap.get("gateway", {})
    lines = [f"gateway: queue {g.get('queue')} · running {g.get('running')} · in flight {g.get('inflight')}/"
             f"{g.get('max_inflight')} · {_fmt(g.get('tokens_per_s'), ' tok/s')}",
             f"  TTFT {_fmt(g.get('ttft_ms'), ' ms', 0)} · failovers {g.get('failovers')} · replayed "
             f"{g.get('replayed_sequences')}"]
    pc = g.get("prefix_cache")
    if pc:
        rate = "–" if pc.get("hit_rate") is None else f"{100 * pc['hit_rate']:.0f}%"
        lines += [f"prefix cache: {pc['prefixes']} prefixes, {pc['cached_tokens']} tokens · hits {pc['hits']}/"
                  f"{pc['lookups']} ({rate}) · misses {pc['misses']}",
                  f"  {pc['reused_tokens']} prompt tokens reused · evicted {pc['evicted']}"
                  + (f" · audited {pc['audits']}, {pc['audit_mismatches']} mismatched" if pc.get("audits") else "")]
    sp = g.get("speculation")
    if sp:
        rate = None if sp["hit_rate"] is None else 100 * sp["hit_rate"]
        lines += [f"speculation {sp['mode']}: {sp['accepted']}/{sp['drafted']} drafted tokens stood ({_fmt(rate, '%', 0)})",
                  f"  {_fmt(sp['tokens_per_pass'], ' tokens a pass', 2)} · drafting {_fmt(sp['draft_ms'], ' ms', 0)}"]
    for p in pipelines:
        lines += replica_lines(p, f"pipeline {p['name']}: " if many else "")
        if p.get("split_auto"):  # --split auto: the split chosen at start and the prediction it came from
            lines.append((f"pipeline {p['name']}: " if many else "") + p["split_auto"]["summary"])
        for r in (p.get("replacements") or [])[-2:]:  # the last stage processes handed a place
            lines.append((f"pipeline {p['name']}: " if many else "") + (
                f"stage {r['stage']} replaced by {r['url']} ({r['took_s']:.2f} s; was {r.get('replaced')})"
                if r["outcome"] == "done" else f"stage {r['stage']} not replaced by {r['url']}: {r['error']}"))
    reason = not_ready_reason(snap)
    verdict = Text("ready", style="bold green") if reason is None else Text(f"NOT READY: {reason}", style="bold red")
    return Group(*((_pipelines_table(pipelines),) if many else ()), t, *(Text(n) for n in notes), Text("\n".join(lines)),
                 verdict)


def cmd_status(args) -> int:
    from rich.console import Console

    console = Console()
    try:
        return _status(args, console)
    except KeyRefused as e:
        print(f"stagemesh status: {e}", file=sys.stderr)
        return KEY_REFUSED


def _status(args, console) -> int:
    if not args.watch:
        snap = fetch(args.url)
        if args.json:
            print(json.dumps(snap))
        else:
            console.print(render(snap, console.width))
        reason = not_ready_reason(snap)
        if reason is not None:
            print(f"stagemesh status: not ready: {reason}", file=sys.stderr)
        return 0 if reason is None else NOT_READY
    snap: dict = {}
    if args.json:
        try:
            while True:
                snap = fetch(args.url)
                print(json.dumps(snap), flush=True)
                time.sleep(args.interval)
        except KeyboardInterrupt:
            pass
        return 0 if snap and not_ready_reason(snap) is None else NOT_READY
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                try:
                    snap = fetch(args.url)
                    live.update(render(snap, console.width), refresh=True)
                except StagemeshError as e:
                    snap = {}
                    from rich.text import Text
                    live.update(Text(str(e), style="bold red"), refresh=True)
                time.sleep(args.interval)
        except KeyboardInterrupt:
            pass
    return 0 if snap and not_ready_reason(snap) is None else NOT_READY
