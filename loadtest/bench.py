"""Load generation, metrics and reports.

Metrics follow vLLM's benchmark definitions and key names:
  TTFT  time from sending a request to its first streamed text chunk
  TPOT  (E2E - TTFT) / (output tokens - 1), per request with more than one output token
  ITL   gaps between consecutive streamed chunks, pooled over all requests
  E2EL  time from sending a request to its last byte
  request / output / total token throughput = completed requests, output tokens, input+output tokens per second
  of the benchmark's duration; peak output tokens/s = most chunks in any 1-second bin; goodput = requests/s that
  met every --goodput SLO (ttft:MS tpot:MS e2el:MS)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
from tqdm import tqdm

from loadtest.client import RequestResult, send_sse, send_ws
from loadtest.datasets import BenchRequest

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class BenchConfig:
    base_url: str
    backend: str = "openai"
    model: str = "smollm2"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ramp_up_seconds: float = 0.0
    warmup: int = 1
    seed: int = 0
    ignore_eos: bool = False
    eos_id: int | None = None
    temperature: float = 0.0
    percentiles: list[float] = field(default_factory=lambda: [50, 90, 95, 99])
    goodput: dict[str, float] = field(default_factory=dict)
    api_key: str | None = None
    ready_timeout: float = 300.0


def interarrival(rng: random.Random, rate: float, burstiness: float) -> float:
    """Gamma inter-arrival times with mean 1/rate; burstiness 1 = Poisson, < 1 burstier, > 1 more regular."""
    if math.isinf(rate):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def wait_ready(session: aiohttp.ClientSession, cfg: BenchConfig) -> None:
    deadline = time.monotonic() + cfg.ready_timeout
    last = ""
    while time.monotonic() < deadline:
        for path in ("/ready", "/health", "/v1/models"):
            try:
                async with session.get(cfg.base_url.rstrip("/") + path, headers=_headers(cfg)) as r:
                    if r.status == 200:
                        return
                    last = f"{path} answered {r.status}"
                    if r.status != 404:
                        break
            except aiohttp.ClientError as e:
                last = str(e)
                break
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{cfg.base_url} not ready after {cfg.ready_timeout:.0f} s ({last})")


def _headers(cfg: BenchConfig) -> dict | None:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None


class _WsPool:
    """One stagemesh websocket shared by many generations, events dispatched by id."""

    def __init__(self, session, url, cfg):
        self.session, self.url, self.cfg = session, url, cfg
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.ws = None
        self.task = None
        self.ids = 0

    async def start(self):
        self.ws = await self.session.ws_connect(self.url.rstrip("/") + "/v1/stream", max_msg_size=0)
        self.task = asyncio.create_task(self._read())

    async def _read(self):
        try:
            async for msg in self.ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    ev = json.loads(msg.data)
                    q = self.inboxes.get(ev.get("id"))
                    if q:
                        q.put_nowait(ev)
        finally:
            for q in self.inboxes.values():
                q.put_nowait(None)

    async def request(self, req: BenchRequest) -> RequestResult:
        self.ids += 1
        rid = f"b{self.ids}"
        q = self.inboxes[rid] = asyncio.Queue()
        try:
            return await send_ws(self.ws, rid, req.prompt, req.prompt_len, req.output_len, self.cfg.ignore_eos,
                                 self.cfg.temperature, q)
        finally:
            self.inboxes.pop(rid, None)

    async def close(self):
        if self.ws:
            await self.ws.close()
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def run_benchmark(cfg: BenchConfig, requests: list[BenchRequest], progress: bool = True) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # a fresh connection per request (as vLLM's benchmark_serving does): reusing a keep-alive connection the server
    # is closing at that moment fails the request ("Can not write request body", seen against llama-server)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await wait_ready(session, cfg)
        pool = None
        if cfg.backend == "stagemesh-ws":
            pool = _WsPool(session, cfg.base_url, cfg)
            await pool.start()

        async def one(req: BenchRequest) -> RequestResult:
            if pool:
                return await pool.request(req)
            return await send_sse(session, cfg.base_url, cfg.backend, cfg.model, req.prompt, req.prompt_len,
                                  req.output_len, cfg.ignore_eos, cfg.eos_id, cfg.temperature, _headers(cfg))

        warm, requests = requests[: cfg.warmup], requests[cfg.warmup:]
        for req in warm:  # not measured
            await one(BenchRequest(req.prompt, req.prompt_len, min(req.output_len, 8)))
        rng = random.Random(cfg.seed)
        limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)

        async def limited(req: BenchRequest) -> RequestResult:
            if limit is None:
                out = await one(req)
            else:
                async with limit:
                    out = await one(req)
            bar.update()
            return out

        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            rate = cfg.request_rate
            if cfg.ramp_up_seconds > 0 and not math.isinf(rate):
                rate = max(rate * 0.05, rate * min(1.0, (time.perf_counter() - t0) / cfg.ramp_up_seconds))
            await asyncio.sleep(interarrival(rng, rate, cfg.burstiness))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        if pool:
            await pool.close()
    return {"results": results, "duration": duration, "t0": t0}


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    v = np.array(values_s or [0.0]) * 1000.0
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)), f"std_{name}_ms": float(v.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p))
    return out


def compute_metrics(run: dict, cfg: BenchConfig) -> dict:
    results: list[RequestResult] = run["results"]
    duration = run["duration"]
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    bins: dict[int, int] = {}
    for r in ok:
        for t in r.chunk_times:
            bins[int(t - run["t0"])] = bins.get(int(t - run["t0"]), 0) + 1
    m = {
        "duration": duration, "completed": len(ok), "failed": len(failed),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_output_tokens_per_s": max(bins.values(), default=0),
        "errors": sorted({r.error for r in failed})[:5],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, values, cfg.percentiles))
    if cfg.goodput:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            vals = {"ttft": r.ttft * 1000, "tpot": tpot * 1000, "e2el": r.latency * 1000}
            good += all(vals[k] <= v for k, v in cfg.goodput.items())
        m["request_goodput"] = good / duration
    return m


def per_request(run: dict) -> dict:
    rs = run["results"]
    return {"ttfts": [r.ttft for r in rs], "itls": [r.itl for r in rs], "e2els": [r.latency for r in rs],
            "output_lens": [r.output_tokens for r in rs], "input_lens": [r.prompt_len for r in rs],
            "start_times": [r.start - run["t0"] for r in rs], "errors": [r.error for r in rs],
            "chunk_times": [[t - run["t0"] for t in r.chunk_times] for r in rs]}


def print_summary(m: dict, cfg: BenchConfig, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("completed / failed", f"{m['completed']} / {m['failed']}"), ("duration (s)", f"{m['duration']:.2f}"),
            ("request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("output throughput (tok/s)", f"{m['output_throughput']:.1f}"),
            ("total token throughput (tok/s)", f"{m['total_token_throughput']:.1f}"),
            ("peak output tokens/s", f"{m['max_output_tokens_per_s']}")]
    if "request_goodput" in m:
        rows.append(("goodput (req/s)", f"{m['request_goodput']:.2f}"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows.append((f"{name.upper()} mean / median / std (ms)",
                     f"{m[f'mean_{name}_ms']:.1f} / {m[f'median_{name}_ms']:.1f} / {m[f'std_{name}_ms']:.1f}"))
        rows.append((f"{name.upper()} " + " / ".join(f"p{p:g}" for p in cfg.percentiles) + " (ms)",
                     " / ".join(f"{m[f'p{p:g}_{name}_ms']:.1f}" for p in cfg.percentiles)))
    for k, v in rows:
        table.add_row(k, v)
    console = Console() if Console().is_terminal else Console(width=110)
    console.print(table)
    for e in m["errors"]:
        console.print(f"[red]example error:[/red] {e}")


def save_result(path: str, cfg: BenchConfig, metrics: dict, run: dict | None, detailed: bool) -> None:
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": {**asdict(cfg), "request_rate": str(cfg.request_rate)},
           **metrics}
    if detailed and run is not None:
        out.update(per_request(run))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def plot_run(run: dict, directory: str, label: str) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    rs = [r for r in run["results"] if r.success]
    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    series = {"TTFT": [r.ttft for r in rs], "TPOT": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in rs if r.output_tokens > 1],
              "ITL": [g for r in rs for g in r.itl], "E2E latency": [r.latency for r in rs]}
    for ax, (name, vals) in zip(axes.flat, series.items()):
        v = np.sort(np.array(vals) * 1000) if vals else np.array([0.0])
        ax.plot(v, np.arange(1, len(v) + 1) / len(v))
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(label)
    fig.tight_layout()
    paths.append(os.path.join(directory, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    end = run["duration"]
    grid = np.arange(0, max(end, 1.0) + 1, 1.0)
    tokens = np.zeros(len(grid))
    for r in rs:
        for t in r.chunk_times:
            tokens[min(int(t - run["t0"]), len(grid) - 1)] += 1
    starts = [r.start - run["t0"] for r in run["results"]]
    ends = [(r.start - run["t0"]) + (r.latency or 0) for r in run["results"]]
    conc = [sum(1 for s, e in zip(starts, ends) if s <= t + 0.5 < max(e, s)) for t in grid]  # at each bin's middle
    fig, ax1 = plt.subplots(figsize=(10, 4))
    ax1.plot(grid, tokens, label="output tokens/s", color="tab:blue")
    ax1.set_xlabel("seconds since start")
    ax1.set_ylabel("tokens/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(grid, conc, where="post", label="requests in flight", color="tab:orange")
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax1.set_title(f"{label}: throughput and concurrency over time")
    fig.tight_layout()
    paths.append(os.path.join(directory, "timeline.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def plot_sweep(points: list[dict], directory: str, label: str, xkey: str) -> str:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for stat, style in (("median", "-o"), ("p99", "--s")):
            x = [p["output_throughput"] for p in points]
            y = [p[f"{stat}_{metric}_ms"] for p in points]
            ax.plot(x, y, style, label=f"{stat} {metric.upper()}")
            for p, xi, yi in zip(points, x, y):
                ax.annotate(f"{xkey}={p['sweep_value']:g}", (xi, yi), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.upper()} against throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(label)
    fig.tight_layout()
    path = os.path.join(directory, "sweep.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
