"""Start stage processes on loopback and wait until they are ready: what `stagemesh up` runs (the tests and the
benchmarks start meshes with it too; their own helpers, e.g. a whole `up` as a subprocess, are in
services/testing/harness.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.cpu import usable_cores
from shared.errors import StagemeshError
from shared.wire.mesh_keys import KeySet, ephemeral_key_set
from shared.wire.pipeline_client import PipelineClient
from shared.wire.stage_info import StageInfo, read_info

# Stages on one host that use every core for a micro-batch alone in the pipeline (--threads-alone) take turns with
# the cores: stage 0 computes a token, then stage 1. libgomp's threads spin ~300,000 rounds before they sleep (its
# default), so a stage that has just finished kept spinning on the cores its neighbour then computed on; 0, a sleep
# at every parallel region, is slower still. A few thousand rounds was fastest for one stream over 2 stages on 2
# cores (benchmarks.critical_path --stages 2 under each GOMP_SPINCOUNT; the sweep is in
# docs/performance.md#one-stream-over-several-stages). Set for the stages `start_mesh` starts with both thread
# counts, unless the caller's environment already says how OpenMP threads wait.
SHARED_HOST_SPINCOUNT = "3000"
WAIT_POLICY_SET = frozenset({"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"})


def free_ports(n: int, avoid: frozenset[int] = frozenset()) -> list[int]:
    """n distinct free ports, none in `avoid`: every socket stays bound until all are chosen, so none is handed
    out twice."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] in avoid:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class StageProcess:
    index: int
    listen: str
    http: str
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)
    log_path: str | None = None  # stdout+stderr of this stage, every incarnation appended (None: discarded)
    env: dict[str, str] = field(default_factory=dict)  # set in its environment, over this process's

    def spawn(self, mode: str = "a") -> subprocess.Popen:
        """Start this stage's command, its output appended to log_path (truncated first when mode is "w")."""
        env = {**os.environ, **self.env}
        if self.log_path is None:
            return subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        with open(self.log_path, mode) as out:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=env)

    def serve_layers(self, layers: str) -> None:
        """From its next start on, the stage serves `layers` (START:STOP): the range a live re-split moved it to, so
        that a restart after it fits its neighbours."""
        if "--layers" in self.args:
            self.args[self.args.index("--layers") + 1] = layers
        else:
            self.args += ["--layers", layers]

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    def info(self) -> StageInfo:
        """Its /info (InfoError if it is not one, a redirect or over MAX_INFO_BYTES included: read_info)."""
        return read_info(self.url, timeout=5)


@dataclass
class LocalMesh:
    stages: list[StageProcess]
    result_listen: str  # where the last stage sends; the client binds it
    keys_dir: str | None = None  # the mesh's CURVE key set (None: plaintext)
    owns_keys: bool = False  # ephemeral keys made by start_mesh, deleted by stop()

    def client(self, enter_at: int = 0) -> PipelineClient:
        """A client with the gateway's keys that sends into stage `enter_at` (a later stage: as its upstream peer,
        which only a holder of the whole key set can be) and receives the last stage's results."""
        keys = KeySet(self.keys_dir).for_gateway(enter_at) if self.keys_dir else None
        return PipelineClient(self.stages[enter_at].listen, self.result_listen, keys=keys)

    @property
    def first_stage(self) -> str:
        return self.stages[0].listen

    @property
    def stage_urls(self) -> list[str]:
        return [s.url for s in self.stages]

    def restart_dead(self, spares: SparePool | None = None, keep: set[str] = frozenset()) -> list[int]:
        """Start again, with the same command and ports, every stage process that has exited (what a
        StatefulSet does for a pod), but those whose URL is in `keep`: a spare from `spares` takes its place where
        one is waiting, else a new process starts. Returns the indices restarted (`spares.taken` says which a spare
        took)."""
        restarted = []
        for s in self.stages:
            if s.proc.poll() is not None and s.url not in keep:
                s.proc = (spares.take(s) if spares is not None else None) or s.spawn("a")
                restarted.append(s.index)
        return restarted

    def stop(self, timeout: float = 10.0) -> None:
        for s in self.stages:
            if s.proc.poll() is None:
                s.proc.terminate()
        deadline = time.monotonic() + timeout
        for s in self.stages:
            try:
                s.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
        if self.owns_keys and self.keys_dir:
            shutil.rmtree(self.keys_dir, ignore_errors=True)


STAGE_COMMAND = [sys.executable, "-m", "services.cli", "stage"]  # a stage's command line before its flags


class SparePool:
    """Spare stage processes (`stagemesh spare`, services/stage/spare.py) on this host, started ahead of need: each
    has imported the runtime and opened the model's file, and waits on its stdin, which only this pool holds, for
    the stage command it takes over. take() hands a waiting spare a dead stage's command and starts another spare in
    its place, so the pool stays `size` strong."""

    def __init__(self, model: str, size: int, env: dict[str, str] | None = None, log_dir: str | None = None):
        self.model, self.size, self.env, self.log_dir = model, size, dict(env or {}), log_dir
        self.waiting: list[subprocess.Popen] = []
        self.taken: list[tuple[int, int]] = []  # (stage index, pid) of every takeover, in order
        self.started = 0
        self.fill()

    def fill(self) -> None:
        """Start spares until `size` are waiting (one that exited, e.g. refused an order, is replaced)."""
        self.waiting = [p for p in self.waiting if p.poll() is None]
        while len(self.waiting) < self.size:
            self.started += 1
            out = (open(os.path.join(self.log_dir, f"spare{self.started}.log"), "w") if self.log_dir
                   else subprocess.DEVNULL)
            try:
                self.waiting.append(subprocess.Popen(
                    [sys.executable, "-m", "services.cli", "spare", "--model", self.model], stdin=subprocess.PIPE,
                    stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env}))
            finally:
                if out is not subprocess.DEVNULL:
                    out.close()  # the child keeps its own copy

    def take(self, stage: StageProcess) -> subprocess.Popen | None:
        """A waiting spare, ordered to serve as `stage` (its flags and log), or None when no spare waits. The pool
        starts a new spare at once; the one taken becomes the stage's process."""
        self.waiting = [p for p in self.waiting if p.poll() is None]
        if not self.waiting:
            self.fill()
            return None
        spare = self.waiting.pop(0)
        order = {"argv": stage.args[len(STAGE_COMMAND):], "log": stage.log_path}
        try:
            spare.stdin.write((json.dumps(order) + "\n").encode())
            spare.stdin.close()
        except OSError:  # it died between the poll and the write
            spare.kill()
            self.fill()
            return None
        self.taken.append((stage.index, spare.pid))
        self.fill()
        return spare

    def stop(self, timeout: float = 10.0) -> None:
        """Spares still waiting end when their stdin closes."""
        for p in self.waiting:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.waiting:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.waiting = []


def stage_command(model: str, index: int, num_stages: int, listen: str, next_hop: str, http: str,
                  dtype: str | None, threads: int | None, extra: list[str], keys_dir: str | None = None,
                  layers: str | None = None) -> list[str]:
    """The stage's command line: CURVE with keys_dir, else --insecure-plaintext; it exits when this process dies.
    layers: its range START:STOP (None: the equal-compute split of --num-stages)."""
    cmd = [*STAGE_COMMAND, "--model", model, "--stage-index", str(index),
           "--num-stages", str(num_stages), "--listen", listen, "--next", next_hop, "--http", http,
           "--exit-with-parent", str(os.getpid())]
    if layers:
        cmd += ["--layers", layers]
    cmd += ["--keys", keys_dir] if keys_dir else ["--insecure-plaintext"]
    if dtype:
        cmd += ["--dtype", dtype]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + list(extra)


def start_mesh(model: str, num_stages: int, dtype: str | None = None, threads: int | None = None,
               threads_alone: int | None = None, extra: list[str] | None = None, result_listen: str | None = None,
               log_dir: str | None = None,
               ready_timeout: float = 180.0, avoid_ports: frozenset[int] = frozenset(), keys_dir: str | None = None,
               insecure_plaintext: bool = False, progress: Callable[[str], None] | None = None,
               layers: list[str] | None = None) -> LocalMesh:
    """Start num_stages stage processes on loopback and wait until every one is ready. Their sockets use CURVE with
    the key set in keys_dir, or with ephemeral keys made here (a private 0700 temporary directory, deleted by
    stop()); plaintext only with insecure_plaintext. Each stage exits when this process dies. `progress` (e.g.
    print) hears one line as each stage becomes ready, and one every PROGRESS_EVERY_S while any is loading.
    threads: each stage's torch threads (default: the cores divided among the stages); threads_alone: for a
    micro-batch alone in the pipeline (default: every core, as the stages share this host). layers: each stage's
    range START:STOP, in order (None: the equal-compute split)."""
    if layers is not None and len(layers) != num_stages:
        raise ValueError(f"{len(layers)} layer ranges for {num_stages} stages")
    owns_keys = False
    if insecure_plaintext:
        keys_dir = None
    elif keys_dir is None:
        keys_dir, owns_keys = ephemeral_key_set(num_stages), True
    threads = threads or max(1, usable_cores() // num_stages)
    # a micro-batch alone in the pipeline (the other stages idle) may use every core, its stage's share otherwise
    threads_alone = threads_alone or usable_cores()
    alone = ["--threads-alone", str(threads_alone)] if threads_alone != threads else []
    env = {"GOMP_SPINCOUNT": SHARED_HOST_SPINCOUNT} if alone and not WAIT_POLICY_SET.intersection(os.environ) else {}
    ports = free_ports(2 * num_stages + 1, avoid_ports)
    listens = [f"tcp://127.0.0.1:{p}" for p in ports[:num_stages]]
    result_listen = result_listen or f"tcp://127.0.0.1:{ports[-1]}"
    stages = []
    for i in range(num_stages):
        http = f"127.0.0.1:{ports[num_stages + i]}"
        next_hop = listens[i + 1] if i + 1 < num_stages else result_listen
        cmd = stage_command(model, i, num_stages, listens[i], next_hop, http, dtype, threads, alone + (extra or []),
                            keys_dir, layers[i] if layers else None)
        stage = StageProcess(i, listens[i], http, None, cmd, os.path.join(log_dir, f"stage{i}.log") if log_dir else None,
                             env)
        stage.proc = stage.spawn("w")
        stages.append(stage)
    mesh = LocalMesh(stages, result_listen, keys_dir, owns_keys)
    try:
        wait_ready([s.url for s in stages], ready_timeout, procs=[s.proc for s in stages],
                   log_paths=[s.log_path for s in stages], progress=progress)
    except BaseException:
        mesh.stop()
        raise
    return mesh


PROGRESS_EVERY_S = 15.0  # how often wait_ready says which stages are still loading


def wait_ready(urls: list[str], timeout: float, procs: list[subprocess.Popen] | None = None,
               log_paths: list[str | None] | None = None, progress: Callable[[str], None] | None = None) -> None:
    """Wait until every stage answers /ready with 200. A stage process that exits first raises a StagemeshError that
    names the stage and quotes the last line of its log (its own one-line error, e.g. an unreadable model file)."""
    start = time.monotonic()
    deadline, next_note = start + timeout, start + PROGRESS_EVERY_S
    pending = dict(enumerate(urls))
    while pending:
        for i, p in enumerate(procs or []):
            if p.poll() is not None:
                last = _last_line(log_paths[i] if log_paths and i < len(log_paths) else None)
                who = f"stage {i}" if log_paths else f"the stage at {urls[i]}"  # log_paths: urls is the whole mesh
                raise StagemeshError(f"{who} exited with code {p.returncode} before it was ready"
                                     + (f": {last}" if last else ""))
        for i, url in list(pending.items()):
            if _is_ready(url):
                del pending[i]
                if progress:
                    progress(f"stage {i} loaded{_layers_note(url)} in {time.monotonic() - start:.0f} s")
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            raise StagemeshError(f"{', '.join(pending.values())} not ready after {timeout:.0f} s")
        if progress and now >= next_note:
            waiting = ", ".join(str(i) for i in pending)
            progress(f"still loading stage{'s' if len(pending) > 1 else ''} {waiting} ({now - start:.0f} s) ...")
            next_note = now + PROGRESS_EVERY_S
        time.sleep(0.2)


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _layers_note(url: str) -> str:
    """" (layers a:b)" from the stage's /info, or "" when it cannot be read (the note is for people, not a check)."""
    try:
        start, stop = read_info(url, timeout=2).layers
        return f" (layers {start}:{stop})"
    except (OSError, ValueError):  # InfoError is a ValueError
        return ""


def _last_line(path: str | None) -> str:
    """The last non-empty line of a log file ("" when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""
