"""The one harness every benchmark runs on (the tests use it too): start and stop a mesh, a `stagemesh up` or a
llama-server; run a load level against a server; scrape Prometheus metrics; read processes from /proc; write a
results directory. A benchmark script imports its helpers from here, never from another script nor from tests/;
the product (services/, shared/, loadtest/) never imports this.

    with running_up(2, "--kv-slots", "32") as gw:          # up's own dtype unless dtype= says otherwise
        level = asyncio.run(run_level(gw.url, concurrency=16, max_tokens=64))
    write_results(out, "batching", {"levels": [level.as_dict()]}, markdown)

Every server runs with stagemesh's default dtype unless the script's --dtype (add_dtype_arg) names one: dtype None
is passed on as no --dtype flag at all, so the stages choose as `stagemesh up` does (shared.models.device.default_dtype_name,
with weights auto)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import aiohttp

from loadtest.client import send_sse, sse_events
from services.process.launch import LocalMesh, free_ports, start_mesh
from shared.errors import StagemeshError
from shared.files.model_registry import resolve_model
from shared.models.device import DTYPES, default_dtype_name
from shared.runtime.generation import SequenceState, run_group_on_mesh
from shared.wire.stage_info import StageInfo, read_info

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_ROOT = os.path.join(REPO_ROOT, "benchmarks", "results")


# ---- flags ----------------------------------------------------------------------------------------------------------

def add_dtype_arg(p: argparse.ArgumentParser, what: str = "the stages'") -> None:
    """--dtype, default None: stagemesh's own default (no --dtype passed to the stages)."""
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help=f"{what} activation dtype (default: stagemesh's default, shared.models.device.default_dtype_name, "
                        "with weights auto)")


def dtype_label(dtype: str | None) -> str:
    """What a run's dtype was, for its printed header and results: "bfloat16" or "float32 (stagemesh's default)"."""
    return dtype or f"{default_dtype_name()} (stagemesh's default)"


def add_out_arg(p: argparse.ArgumentParser, name: str) -> None:
    """--out DIR, default benchmarks/results/<today>-<name> (a new directory: -2, -3, ... when it exists)."""
    p.add_argument("--out", default=None,
                   help=f"results directory (default: benchmarks/results/<date>-{name}, a new one)")


def results_dir(given: str | None, name: str) -> str:
    """The directory a run writes into, created: `given`, or a new benchmarks/results/<YYYY-MM-DD>-<name>."""
    if given:
        os.makedirs(given, exist_ok=True)
        return given
    base = os.path.join(RESULTS_ROOT, f"{datetime.date.today().isoformat()}-{name}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    os.makedirs(path)
    return path


def write_results(out: str, stem: str, data, markdown: str | None = None) -> str:
    """`out`/<stem>.json (data, indented) and, when given, `out`/<stem>.md (markdown + a newline). Returns the JSON
    file's path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    if markdown is not None:
        with open(os.path.join(out, f"{stem}.md"), "w") as f:
            f.write(markdown + "\n")
    return path


class Report:
    """What a run prints, kept for its results directory: say() prints a line and keeps it; write(data) writes
    <name>.json ({"results": data, "printed": the lines}) and <name>.md (the lines, verbatim) into --out (default: a
    new benchmarks/results/<date>-<name>) and returns that directory."""

    def __init__(self, name: str, out: str | None):
        self.name, self.out, self.lines = name, out, []

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, data) -> str:
        out = results_dir(self.out, self.name)
        write_results(out, self.name, {"results": data, "printed": self.lines},
                      "```\n" + "\n".join(self.lines) + "\n```")
        print(f"results in {out}")
        return out


# ---- processes: stages, up, llama-server --------------------------------------------------------------------------

def free_port() -> int:
    return free_ports(1)[0]


def wait_compiled(stage_infos: Callable[[], list[StageInfo]], timeout: float = 900) -> list[dict]:
    """Poll `stage_infos()` (every stage's /info) until no stage is still compiling its decode step (--compile-decode
    auto compiles in the background after /ready); returns each stage's compiled_decode entry. Benchmarks wait for it
    so that they measure steady state, not a stage sharing its cores with the compiler."""
    deadline = time.monotonic() + timeout
    while True:
        entries = [info.compiled_decode for info in stage_infos()]
        if all(e["state"] != "compiling" for e in entries) or time.monotonic() > deadline:
            return entries
        time.sleep(1)


def mesh_compiled(mesh: LocalMesh, timeout: float = 900) -> list[dict]:
    """wait_compiled for the stages of a mesh started by start_mesh."""
    return wait_compiled(lambda: [s.info() for s in mesh.stages], timeout)


@contextlib.contextmanager
def running_mesh(model: str, stages: int, dtype: str | None = None, *, compiled: bool = True,
                 log_dir: str | None = None, **start_mesh_args) -> Iterator[LocalMesh]:
    """start_mesh (stage logs in log_dir, else a temporary directory), waited until its decode steps compiled unless
    compiled=False; stopped when the block ends."""
    with contextlib.ExitStack() as stack:
        logs = log_dir or stack.enter_context(tempfile.TemporaryDirectory())
        mesh = start_mesh(model, stages, dtype=dtype, log_dir=logs, **start_mesh_args)
        stack.callback(mesh.stop)
        if compiled:
            mesh_compiled(mesh)
        yield mesh


@dataclass
class RunningGateway:
    """A `stagemesh up` subprocess, talked to as clients do."""

    url: str
    proc: subprocess.Popen
    log_path: str

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stage_urls(self) -> list[str]:
        return json.loads(self.get("/ready")[1])["stages"]

    def stage_info(self, i: int) -> StageInfo:
        return read_info(self.stage_urls()[i], timeout=5)

    def wait_compiled(self, timeout: float = 900) -> list[dict]:
        return wait_compiled(lambda: [self.stage_info(i) for i in range(len(self.stage_urls()))], timeout)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (NaN when absent), read with prometheus_client's parser."""
        return scrape_metric(self.get("/metrics")[1], name, labels or None)

    def stage_pids(self) -> dict[int, int]:
        """Stage index -> pid of this up's stage processes: from their command lines, or for a spare that took a
        stage's place (`up --spares`), from the stage log its output went to (stageN.log)."""
        out = {}
        for pid, argv, output in self._children():
            if "--stage-index" in argv:
                out[int(argv[argv.index("--stage-index") + 1])] = pid
            elif "spare" in argv and (took := re.search(r"stage(\d+)\.log$", output)):
                out[int(took[1])] = pid
        return out

    def spare_pids(self) -> list[int]:
        """The pids of this up's spares still waiting to take a stage's place (`up --spares`)."""
        return [pid for pid, argv, output in self._children() if "spare" in argv and re.search(r"spare\d+\.log$", output)]

    def _children(self) -> list[tuple[int, list[str], str]]:
        """(pid, command line, where its stdout goes) of each child process of this up."""
        out = []
        for pid in children(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    argv = f.read().split("\0")
                output = os.readlink(f"/proc/{pid}/fd/1")
            except OSError:
                continue  # exited meanwhile
            out.append((pid, argv, output))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_gateway(mesh: LocalMesh, log_dir: str, *flags: str, model: str = "smollm2") -> RunningGateway:
    """`stagemesh gateway` over a started mesh (its stages, result address and keys) with `flags`, on a free port,
    its output in log_dir/gateway.log; returned as soon as it is started (wait_http its /ready)."""
    port = free_port()
    log_path = os.path.join(log_dir, "gateway.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--model", model,
                                 "--stages", ",".join(mesh.stage_urls), "--listen", f"127.0.0.1:{port}",
                                 "--result-listen", mesh.result_listen, "--keys", mesh.keys_dir, *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    return RunningGateway(f"http://127.0.0.1:{port}", proc, log_path)


@contextlib.contextmanager
def mesh_and_gateway(stages: int, log_dir: str, *gateway_flags: str, stage_flags: Sequence[str] = (),
                     model: str = "smollm2", dtype: str = "float32") -> Iterator[tuple[LocalMesh, RunningGateway]]:
    """A started mesh of `stages` stages (CURVE; `stage_flags` for each) and start_gateway over it, yielded once its
    /ready answers 200; both stopped after (the gateway first)."""
    mesh = start_mesh(model, stages, dtype=dtype, log_dir=log_dir, extra=list(stage_flags))
    try:
        gw = start_gateway(mesh, log_dir, *gateway_flags, model=model)
        try:
            wait_http(gw.url + "/ready", 120)
            yield mesh, gw
        finally:
            gw.stop()
    finally:
        mesh.stop()


def start_up(stages: int, dtype: str | None, log_dir: str, *extra: str, timeout: float = 240,
             port: int | None = None, while_starting: Callable[[RunningGateway], None] | None = None) -> RunningGateway:
    """`stagemesh up --stages N` as a subprocess on `port` (default: a free one); returns once /ready answers 200.
    dtype None: up's default (and with it weights auto). while_starting: called every few ms until then (e.g. to put
    each stage process in a cgroup as soon as it exists, before it loads or measures anything)."""
    port = port or free_port()
    log_path = os.path.join(log_dir, f"up-{stages}.log")
    out = open(log_path, "w")
    cmd = [sys.executable, "-m", "services.cli", "up", "--stages", str(stages), *(["--dtype", dtype] if dtype else []),
           "--port", str(port), "--log-dir", log_dir, *extra]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    gw = RunningGateway(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    next_ready_check = 0.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StagemeshError(f"stagemesh up exited: {open(log_path).read()[-2000:]}")
        if while_starting is not None:
            while_starting(gw)
        if time.monotonic() >= next_ready_check:
            next_ready_check = time.monotonic() + 0.3
            try:
                if gw.get("/ready")[0] == 200:
                    return gw
            except OSError:
                pass
        time.sleep(0.02 if while_starting is not None else 0.3)
    gw.stop()
    raise StagemeshError(f"gateway not ready after {timeout}s: {open(log_path).read()[-2000:]}")


@contextlib.contextmanager
def running_up(stages: int, *extra: str, dtype: str | None = None, compiled: bool = True,
               log_dir: str | None = None) -> Iterator[RunningGateway]:
    """start_up (logs in log_dir, else a temporary directory), waited until its stages' decode steps compiled unless
    compiled=False (a stage compiling in the background shares the cores with what is measured); stopped when the
    block ends."""
    with contextlib.ExitStack() as stack:
        logs = log_dir or stack.enter_context(tempfile.TemporaryDirectory())
        gw = start_up(stages, dtype, logs, *extra)
        stack.callback(gw.stop)
        if compiled:
            gw.wait_compiled()
        yield gw


def ups_in_turn(stack: contextlib.ExitStack, stage_counts: list[int], model: str, dtype: str | None,
                extra: list[str]) -> dict[int, str]:
    """A `stagemesh up --stages N` serving `model` for each N, entered into `stack` (stopped when it closes), each
    started once the one before has compiled its decode step, so no compilation overlaps another server's start or
    a measurement; N -> its URL."""
    urls = {}
    for stages in stage_counts:
        gw = stack.enter_context(running_up(stages, "--model", resolve_model(model), *extra, dtype=dtype))
        print(f"stagemesh {stages} stage(s): compiled decode {gw.wait_compiled()}", flush=True)
        urls[stages] = gw.url
    return urls


LLAMA_SERVER = os.path.expanduser("~/.cache/stagemesh/llama-server/bin/llama-server")  # `make llama-server`


def wait_http(url: str, timeout: float = 120) -> None:
    """Until GET url answers 200 (TimeoutError naming url after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


async def seeded_streams(url: str, prompt: str, seed: int, n: int, max_tokens: int,
                         on_token: Callable[[int], None] | None = None) -> list[str]:
    """n streamed /v1/completions at once, stream i's prompt `prompt` with {i} filled in, sampled at temperature 0.8
    with seed + i, ignore_eos; their texts, each checked to end by its length. on_token(n) hears, after every chunk,
    the fewest chunks any stream has had so far."""
    bodies = [{"prompt": prompt.format(i=i), "max_tokens": max_tokens, "temperature": 0.8, "seed": seed + i,
               "ignore_eos": True, "stream": True} for i in range(n)]
    counts = [0] * n

    async def one(s: aiohttp.ClientSession, i: int) -> str:
        text, chunk = [], {}
        async with s.post(url + "/v1/completions", json=bodies[i]) as r:
            assert r.status == 200, await r.text()
            async for chunk in sse_events(r):
                assert "error" not in chunk, chunk
                text += [c["text"] for c in chunk["choices"]]
                counts[i] += 1
                if on_token is not None:
                    on_token(min(counts))
        assert chunk["choices"][0]["finish_reason"] == "length", chunk
        return "".join(text)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        return list(await asyncio.gather(*(one(s, i) for i in range(n))))


class Load:
    """`streams` streams (the re-split benchmarks' load), each sending one completion after another until stopped; every token's time kept."""

    def __init__(self, url: str, streams: int, max_tokens: int):
        self.url, self.streams, self.max_tokens = url, streams, max_tokens
        self.tokens: list[float] = []  # perf_counter time of every token
        self.worst_gap: list[tuple[float, float]] = []  # (time, gap) of each request's longest gap
        self.gaps: list[tuple[float, float]] = []  # (time, gap) of every gap between two tokens of one request
        self.failed = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            await asyncio.gather(*(self._stream(s, i) for i in range(self.streams)))

    async def _stream(self, s: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"prompt": f"Story {i}.{n}: the lighthouse keeper opened the door and", "stream": True,
                    "max_tokens": self.max_tokens, "temperature": 0.8, "seed": i * 1000 + n, "ignore_eos": True}
            last, gap = None, (0.0, 0.0)
            try:
                async with s.post(self.url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        self.failed += 1
                        continue
                    async for chunk in sse_events(r):
                        if "error" in chunk:
                            self.failed += 1
                            break
                        now = time.perf_counter()
                        self.tokens.append(now)
                        if last is not None:
                            self.gaps.append((now, now - last))
                        if last is not None and now - last > gap[1]:
                            gap = (now, now - last)
                        last = now
            except (aiohttp.ClientError, TimeoutError):
                self.failed += 1
            self.worst_gap.append(gap)

    def rate(self, t0: float, t1: float) -> float:
        return sum(1 for t in self.tokens if t0 <= t < t1) / max(t1 - t0, 1e-9)


def model_file(name: str, preset: str) -> str:
    """A path for a benchmark's --models `name`: a shaped file built (once) at `preset`, else an alias or path as up
    takes it."""
    from services.testing.shaped_gguf import SHAPES, shaped_gguf

    return shaped_gguf(name, preset) if name in SHAPES else resolve_model(name)


@contextlib.contextmanager
def running_llama_server(model: str, binary: str = LLAMA_SERVER, slots: int = 32, context: int = 8192,
                         extra: Sequence[str] = (), log_path: str | None = None) -> Iterator[str]:
    """llama.cpp's llama-server for `model` (alias or GGUF path) on a free port, continuous batching with `slots`
    parallel slots sharing `context` tokens (8192 gives each of 32 slots 256 tokens, room for 64 in + 64 out), and
    `extra` flags (e.g. its --spec-type); yields its base URL once /health answers; stopped when the block ends.
    log_path: where its output goes (default: nowhere)."""
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"no llama-server at {binary}: run `make llama-server` first")
    port = free_port()
    cmd = [binary, "-m", resolve_model(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(os.cpu_count()), "-np", str(slots), "-cb", "-c", str(context), "--no-webui", *extra]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)
        if log_path:
            log.close()


def children(pid: int) -> list[int]:
    """Direct children of `pid` (the stage processes of a `stagemesh up`), from /proc/*/stat (Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def _proc_kib(pid: int, name: str, field: str) -> float:
    """The kB value of `field` (e.g. "VmRSS:") in /proc/<pid>/<name>, in MB; NaN once the process has exited."""
    try:
        with open(f"/proc/{pid}/{name}") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def pss_mb(pid: int) -> float:
    """Proportional set size of `pid` in MB: its memory as the kernel counts it, a page mapped n times counting 1/n
    each time (VmRSS counts a page each time it is mapped, e.g. a kept prefix's K/V pages that many sequences map);
    NaN once it has exited."""
    return _proc_kib(pid, "smaps_rollup", "Pss:")


def anon_mb(pid: int) -> float:
    """Anonymous resident memory of `pid` in MB (RssAnon: what the process itself holds, without the file pages it
    has mapped, which the OS reclaims under pressure); NaN once it has exited."""
    return _proc_kib(pid, "status", "RssAnon:")


def peak_rss_mb(pid: int) -> float:
    """The highest resident set `pid` has had (VmHWM), in MB; NaN once it has exited."""
    return _proc_kib(pid, "status", "VmHWM:")


def rss_mb(pid: int) -> float:
    """Resident set size of `pid` in MB (NaN once it has exited)."""
    return _proc_kib(pid, "status", "VmRSS:")


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per minute."""
    n = len(samples)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else float("nan")


# ---- metrics --------------------------------------------------------------------------------------------------------

def scrape_metric(text: str, sample_name: str, labels: dict[str, str] | None = None) -> float:
    """One sample's value from Prometheus text (NaN when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name and (labels is None or labels.items() <= sample.labels.items()):
                return float(sample.value)
    return float("nan")


def scrape(url: str, names: list[str]) -> list[float]:
    """The named samples of `url`/metrics (a stage's or the gateway's), in order (NaN for an absent one)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [scrape_metric(text, n) for n in names]


# ---- load -----------------------------------------------------------------------------------------------------------

PROMPTS = ["Write a story about a dragon.", "Explain how rain forms.", "List some fruits and describe them.",
           "Describe a busy city street.", "What is machine learning?", "Tell me about the history of Rome."]


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between ranks; NaN for no values."""
    if not values:
        return float("nan")
    ranked = sorted(values)
    k = (len(ranked) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ranked) - 1)
    return ranked[lo] + (ranked[hi] - ranked[lo]) * (k - lo)


@dataclass(frozen=True)
class LevelResult:
    """One load level: concurrency x rounds streamed /v1/completions at once, each generating max_tokens."""

    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float  # output tokens of every request / wall time of the whole level
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float  # over every gap between two chunks of every request
    itl_ms_p99: float

    def as_dict(self) -> dict:
        return asdict(self)


async def run_level(url: str, concurrency: int, max_tokens: int, rounds: int = 1, prompts: list[str] = PROMPTS,
                    temperature: float = 0.7, model: str = "smollm2") -> LevelResult:
    """concurrency x rounds streamed /v1/completions (ignore_eos: each generates exactly max_tokens) sent at once,
    after one 4-token warm-up request. A failed request raises RuntimeError with its error: a benchmark reports
    speed only of a level that completed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def one(prompt: str, tokens: int):
            res = await send_sse(s, url, "openai", model, prompt, 0, tokens, ignore_eos=True, temperature=temperature)
            if not res.success:
                raise RuntimeError(res.error)
            return res

        await one(prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(prompts[i % len(prompts)], max_tokens) for i in range(concurrency * rounds)))
        wall = time.perf_counter() - t0
    tokens = sum(r.output_tokens for r in results)
    ttft = [1e3 * r.ttft for r in results]
    itl = [1e3 * gap for r in results for gap in r.itl]
    return LevelResult(concurrency, len(results), tokens, wall, tokens / wall, _percentile(ttft, 50),
                       _percentile(ttft, 99), _percentile(itl, 50), _percentile(itl, 99))


STAGE_WORK = ["stagemesh_stage_busy_seconds_total", "stagemesh_stage_microbatches_total"]


async def run_groups(mesh: LocalMesh, prompt: list[int], inflight: int, batch: int, steps: int, warmup: int) -> dict:
    """Decode straight into a mesh (no gateway): `inflight` groups of `batch` sequences, each group one micro-batch
    per step, all in flight at once. After `warmup` decode steps of every group, `steps` measured ones; returns the
    measured window's throughput (micro-batches/s) against the ideal 1 / max(stage compute per micro-batch), and each
    stage's busy fraction, from the stages' own busy-seconds and micro-batch counters."""
    client = mesh.client()
    await client.start()
    t_start: list[float] = []
    before: list = []

    async def group(g: int) -> None:
        states = [SequenceState(f"g{g}s{i}", prompt, max_tokens=1 + warmup + steps) for i in range(batch)]

        async def before_step(i: int) -> None:  # step 0 is the prefill; then warmup decodes, then measured ones
            if i == 1 + warmup:
                await barrier.wait()

        await run_group_on_mesh(client, states, before_step=before_step)

    class Barrier:  # all groups finish warm-up before the measured window opens
        def __init__(self, n):
            self.n, self.event = n, asyncio.Event()

        async def wait(self):
            self.n -= 1
            if self.n == 0:
                before.extend(scrape(u, STAGE_WORK) for u in mesh.stage_urls)
                t_start.append(time.perf_counter())
                self.event.set()
            await self.event.wait()

    barrier = Barrier(inflight)
    await asyncio.gather(*(group(g) for g in range(inflight)))
    elapsed = time.perf_counter() - t_start[0]
    after = [scrape(u, STAGE_WORK) for u in mesh.stage_urls]
    await client.close()
    stages = []
    for (b0, n0), (b1, n1) in zip(before, after):
        stages.append({"busy_fraction": (b1 - b0) / elapsed, "compute_s_per_mb": (b1 - b0) / max(1, n1 - n0)})
    mbs = inflight * steps
    throughput = mbs / elapsed
    ideal = 1.0 / max(s["compute_s_per_mb"] for s in stages)
    return {"elapsed_s": elapsed, "microbatches": mbs, "throughput_mb_s": throughput, "ideal_mb_s": ideal,
            "ratio": throughput / ideal, "stages": stages}


# ---- servers benched side by side (benchmarks.compare_llamacpp, benchmarks.roofline) ----------------------------------

def prompt_seed(concurrency: int, round_: int) -> int:
    """The random prompts' seed of one level's round: distinct for every (level, round), the same for every server in
    a round. llama-server keeps each slot's last prompt and reuses it (`cache_prompt`, on by default): a repeated
    64-token prompt was prefilled in 11 ms instead of 204-283 ms (timings.prompt_n 1, not 64), so benching every
    round with the same prompts measured llama-server's prompt cache from the second round on. Fresh random prompts
    measure both servers the same way, as a stream of distinct requests (no prefix to reuse); the prompt caches are
    measured by benchmarks.chat_workloads."""
    return 1000 * concurrency + round_


def bench_server(url: str, label: str, concurrency: int, round_: int, out: str, args) -> dict:
    """`stagemesh bench` of the server at `url` at one level's round (args: min_prompts, input_len, output_len), its
    result kept in `out`; exits naming the server when it returned fewer tokens than --ignore-eos asks."""
    result = os.path.join(out, f"{label.replace(' ', '_')}-c{concurrency}-r{round_}.json")
    cmd = [sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--label", label,
           "--max-concurrency", str(concurrency), "--num-prompts", str(max(args.min_prompts, 2 * concurrency)),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
           "--temperature", "0.7", "--save-result", result, "--quiet", "--warmup", "2",
           "--seed", str(prompt_seed(concurrency, round_))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = json.load(open(result))  # vLLM-named metrics at the top level
    expected = metrics["completed"] * args.output_len
    if metrics["total_output_tokens"] != expected:  # a server that stops early would look faster per token
        sys.exit(f"{label} returned {metrics['total_output_tokens']} output tokens for {metrics['completed']} requests "
                 f"of {args.output_len} (--ignore-eos): its context per sequence is too short for --input-len + "
                 f"--output-len ({result})")
    return metrics


def measure_servers(servers: dict[str, str], levels: list[int], out: str, args) -> dict[str, dict[int, list[dict]]]:
    """server name -> level -> one bench result per round (args.rounds), the servers interleaved within each round,
    their order reversed every other round."""
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in servers}
    names = list(servers)
    for c in levels:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                runs[name][c].append(bench_server(servers[name], name, c, r, out, args))
            print(f"  {c:>3} streams, round {r + 1}: " + ", ".join(
                f"{name} {runs[name][c][-1]['output_throughput']:.1f}" for name in names) + " tok/s", flush=True)
    return runs
