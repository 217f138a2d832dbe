"""`stagemesh up`: a gateway and N stage processes on loopback, one command, clean shutdown on Ctrl-C/SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import math
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.cli.flags import STAGE_FLAGS
from services.gateway.flags import gateway_config_from_args
from services.process.args import (
    config_argv,
    config_from_args,
    otlp_from_args,
)
from shared.config import GATEWAY_PORT, LoadConfig, SchedulerConfig, StageConfig
from shared.cpu import usable_cores
from shared.errors import StagemeshError
from shared.files.gguf_header import layer_count
from shared.files.layers import parse_split
from shared.files.model_registry import resolve_model
from shared.models.memory import stage_shares
from shared.text.chat_template import template_source

if TYPE_CHECKING:
    from aiohttp import web

    from services.process.launch import LocalMesh, SparePool


def log_dir_from_args(given: str | None) -> str:
    """The directory stage logs go to, created and writable, or a one-line StagemeshError that says what to fix."""
    if given is None:
        return tempfile.mkdtemp(prefix="stagemesh-")
    try:
        os.makedirs(given, exist_ok=True)
    except OSError as e:
        raise StagemeshError(f"--log-dir {given!r} cannot be created: {e.strerror}; pass a writable directory") from None
    if not os.access(given, os.W_OK | os.X_OK):
        raise StagemeshError(f"--log-dir {given!r} is not writable; pass a writable directory")
    return given


def check_port_free(host: str, port: int) -> None:
    """Raise a one-line StagemeshError when the gateway could not listen on host:port, before any stage starts: a
    taken port found only after the stages load would cost the user their load time. The bind mirrors aiohttp's
    (SO_REUSEADDR), so a port in TIME_WAIT passes and one a server listens on does not."""
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StagemeshError(f"--host {host!r} does not resolve ({e.strerror}); pass an address such as 127.0.0.1") from None
    for family, kind, proto, _, addr in addrs:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise StagemeshError(_bind_problem(host, port, e)) from None


def _bind_problem(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} is already in use on {host}; stop what is listening there or pass --port with a free port"
    if e.errno == errno.EACCES:
        return f"not allowed to listen on port {port} on {host}; pass --port 1024 or above"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine; pass 127.0.0.1 or 0.0.0.0"
    return f"cannot listen on {host}:{port}: {e.strerror}"


def check_model(name: str) -> str:
    """The model file `name` resolves to, checked to be a GGUF before any stage starts; else a one-line error."""
    path = resolve_model(name)  # ModelNotFound names the alias's package or the missing path
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise StagemeshError(f"model file {path} cannot be read: {e.strerror}") from None
    if magic != b"GGUF":
        raise StagemeshError(f"model file {path} is not a GGUF file (it does not start with the GGUF magic)")
    return path


def model_layers(path: str) -> int:
    """The model's layer count from its GGUF header alone (read before any stage starts: nothing is loaded)."""
    try:
        return layer_count(path)
    except OSError as e:
        raise StagemeshError(f"model file {path}: {e.strerror or e}") from None


GATEWAY_LOG = "gateway.log"  # in --log-dir: the gateway's log lines (the access log among them)


def log_to_file(log_dir: str, verbose: bool) -> str:
    """The terminal is for people: the gateway's log lines go to GATEWAY_LOG in log_dir, and only warnings and errors
    also to the terminal (every line with -v). Returns the file's path."""
    root = logging.getLogger()
    if not verbose:
        for handler in root.handlers:
            handler.setLevel(logging.WARNING)
    path = os.path.join(log_dir, GATEWAY_LOG)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(to_file)
    return path


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_up(args) -> int:
    # Everything a user can get wrong is checked here, in a second, before any stage loads a model.
    split_auto = args.split is not None and args.split.strip().lower() == "auto"
    if split_auto:
        args.split = "auto"  # the gateway's build_app reads it: move to the measured split before ready
    if args.stages is None:
        args.stages = 2 if args.split is None or split_auto else len([p for p in args.split.split(",") if p.strip()]) + 1
    if args.stages < 1:
        raise StagemeshError(f"--stages {args.stages} must be at least 1")
    if args.replicas < 1:
        raise StagemeshError(f"--replicas {args.replicas} must be at least 1")
    if not 0 <= args.spares <= 8:
        raise StagemeshError(f"--spares {args.spares} must be 0 to 8 (each spare holds the runtime and the model's "
                             "file open, ~0.3 GiB before it takes over)")
    otlp_url = otlp_from_args(args)  # the stages export to the same collector
    stage = config_from_args(StageConfig, args)
    load = config_from_args(LoadConfig, args)
    # one host: every stage `up` starts (each replica's) shares its default memory budget and cached-prefix bound,
    # each fixed once here, before any stage takes memory
    stages_on_host = args.stages * args.replicas
    budget, prefix_bound = stage_shares(stages_on_host)
    if load.memory_budget is None:
        load = dataclasses.replace(load, memory_budget=budget)
    if stage.prefix_cache_memory is None:
        stage = dataclasses.replace(stage, prefix_cache_memory=prefix_bound)
    config_from_args(SchedulerConfig, args)  # the gateway's flags, checked now (build_app builds them again)
    gateway = gateway_config_from_args(args, args.model)
    if gateway.chat_template is not None:
        template_source(gateway.chat_template)  # a name that is neither built in nor a file, refused now
    log_dir = log_dir_from_args(args.log_dir)
    check_port_free(args.host, args.port)
    log_to_file(log_dir, getattr(args, "verbose", False))
    model_path = check_model(args.model)
    layers = model_layers(model_path)
    if args.stages > layers:
        raise StagemeshError(f"--stages {args.stages}: {os.path.basename(model_path)} has {layers} layers, so at most "
                             f"{layers} stages (each holds at least one layer)")
    ranges = None
    if args.split is not None and not split_auto:
        try:
            ranges = [str(r) for r in parse_split(args.split, layers)]
        except StagemeshError as e:
            raise StagemeshError(f"--split {args.split!r}: {e}; or give --split auto (measure each stage at start "
                                 "and balance the split)") from None
        if len(ranges) != args.stages:
            raise StagemeshError(f"--split {args.split} makes {len(ranges)} stages, not --stages {args.stages}: "
                                 "leave --stages out (the split decides it)")
    # --split auto: each stage times its layers at one sequence and at the micro-batch a full pipeline runs (its KV
    # slots over the stages in flight) before it reports ready; the gateway balances those times
    calibrate = ["--calibrate", f"1,{max(1, math.ceil(stage.kv_slots / args.stages))}"] if split_auto else []
    many = f"{args.replicas} pipelines of " if args.replicas > 1 else ""
    _say(f"starting {many}{args.stages} stage{'s' if args.stages > 1 else ''} of {os.path.basename(model_path)} "
         f"(logs in {log_dir}) ...")
    # everything above is checked before torch loads; what serves is imported now
    from services.gateway.main import PipelineSpec, build_app
    from services.process.launch import SparePool, start_mesh

    meshes: list[LocalMesh] = []
    spares: SparePool | None = None
    try:
        for r in range(args.replicas):
            # replicas share the first one's ephemeral key set (0700 temporary directory, deleted when it stops):
            # the gateway holds one set of keys for every pipeline
            keys_dir = meshes[0].keys_dir if meshes else None
            if args.replicas > 1:
                os.makedirs(os.path.join(log_dir, f"p{r}"), exist_ok=True)
            meshes.append(start_mesh(
                args.model, args.stages, log_dir=log_dir if args.replicas == 1 else os.path.join(log_dir, f"p{r}"),
                avoid_ports=frozenset({args.port}), keys_dir=keys_dir,
                threads=max(1, usable_cores() // (args.stages * args.replicas)),
                # alone in its pipeline, a micro-batch may use its replica's cores (the other replicas may be busy)
                threads_alone=stage.threads_alone or max(1, usable_cores() // args.replicas),
                extra=config_argv(load) + config_argv(stage, STAGE_FLAGS) + calibrate
                + (["--otlp-endpoint", otlp_url] if otlp_url else []),
                insecure_plaintext=args.insecure_plaintext, layers=ranges,
                progress=lambda line, r=r: _say(f"  {f'p{r} ' if args.replicas > 1 else ''}{line}")))
        args.keys = meshes[0].keys_dir
        if args.spares:  # started once the stages are ready, so they do not compete with the stages' loads
            spares = SparePool(args.model, args.spares, env=meshes[0].stages[0].env, log_dir=log_dir)
            _say(f"  {args.spares} spare stage process{'es' if args.spares > 1 else ''} waiting to take over a stage "
                 "that exits")
        app = build_app(args.model, [PipelineSpec(m.stage_urls, m.result_listen, m.first_stage) for m in meshes], args)
        asyncio.run(_serve(app, args.host, args.port, meshes, spares))
    except OSError as e:  # the port was taken between check_port_free and the gateway's bind
        if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise StagemeshError(_bind_problem(args.host, args.port, e)) from None
        raise
    finally:
        _say("stopping stages ...")
        if spares is not None:
            spares.stop()
        for mesh in reversed(meshes):  # the first owns the key set: it goes last
            mesh.stop()
    return 0


def ready_banner(host: str, port: int, stages: int, model: str, replicas: int = 1, chat: bool = True) -> str:
    """What `up` prints once the gateway is ready: where to go, a request to paste (a completion when the model has
    no chat template, which chat requests need), and how to run `stagemesh`."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # a wildcard listens on loopback too
    url = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"
    if chat:
        route, body = "chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hello!"}]}
    else:
        route, body = "completions", {"model": model, "prompt": "Once upon a time"}
    body = json.dumps({**body, "max_tokens": 32})
    return "\n".join([
        f"stagemesh is up ({f'{replicas} pipelines of ' if replicas > 1 else ''}{stages} stage{'s' if stages > 1 else ''}"
        f", pid {os.getpid()}; Ctrl-C to stop)",
        f"  chat page  {url}/",
        f"  API        {url}/v1   (OpenAI-compatible)",
        f"  try        curl -s {url}/v1/{route} -H 'Content-Type: application/json' -d {shlex.quote(body)}",
        f"  CLI        {_cli_hint('' if url == f'http://127.0.0.1:{GATEWAY_PORT}' else url)}",
    ])


def _cli_hint(url: str = "") -> str:
    """How to run `stagemesh status` from the user's shell (for a gateway at `url`, "" for the default one): plain
    `stagemesh` when PATH already finds this one, else the path of the script beside this interpreter (a venv's
    bin/) and how to activate that venv."""
    here = os.path.join(os.path.dirname(sys.executable), "stagemesh")
    found = shutil.which("stagemesh")
    status = f"status {url}".rstrip()
    if found and os.path.realpath(found) == os.path.realpath(here):
        return f"stagemesh {status}   (stagemesh --help for every command)"
    shown = os.path.relpath(here) if not os.path.relpath(here).startswith("..") else here
    activate = os.path.join(os.path.dirname(shown), "activate")
    return f"{shown} {status}   (or `source {activate}`, then `stagemesh --help`)"


def decode_notes(previous: dict[int, str], entries: dict[int, dict]) -> list[str]:
    """Lines announcing each stage's change of decode mode since `previous` (stage -> state, updated in place), from
    the stages' compiled_decode entries (StageInfo.compiled_decode, stage -> entry): compiling in the background,
    switched to the compiled step, failed (decoding eagerly, with the reason), off (with the reason)."""
    lines = []
    for i, entry in sorted(entries.items()):
        state = entry.get("state")
        one = entry.get("one_sequence") or {}
        packaged = str(one.get("path") or "").startswith("aoti")
        if state == "compiling" and packaged and one.get("ready"):
            state = "compiling, one sequence ready"  # its saved package runs while the batched graph compiles
        if state == previous.get(i) or state is None:
            continue
        previous[i] = state
        if state == "compiling":
            lines.append(f"stage {i}: decode runs slower while its compiled step builds in the background "
                         "(a minute or more the first time on a small CPU, then saved: seconds on later starts)")
        elif state == "compiling, one sequence ready":
            took = sum((one.get("seconds") or {}).values())
            how = "loaded from cache" if one["path"] == "aoti-loaded" else "built and saved for later starts"
            lines.append(f"stage {i}: decoding one stream at full speed: compiled step {how} in {took:.1f} s "
                         "(several streams at once still run slower until their step compiles)")
        elif state == "ready":
            batched = entry.get("batched") or {}
            took = sum((entry.get("compile_seconds") or {}).values())
            took += sum((batched.get("compile_seconds") or {}).values())
            if packaged:  # the one-sequence step's package: loaded or built
                took += sum((one.get("seconds") or {}).values())
            if batched.get("sizes") and batched.get("reason") is None:
                lo, hi = batched["sizes"]
                what = f"the compiled steps, one sequence and batches of {lo}-{hi}"
            else:
                what = "the compiled step" + (f" (batches decode eagerly: {batched['reason']})" if batched.get("reason")
                                              else "")
            lines.append(f"stage {i}: decode switched to {what}" + (f" (compiled in {took:.0f} s)" if took else ""))
        elif state == "failed":
            lines.append(f"stage {i}: the compiled decode step failed, decoding stays eager: {entry.get('error')}")
        elif state == "off":
            lines.append(f"stage {i}: decode runs eagerly ({entry.get('reason') or 'compiled decode off'})")
    return lines


DEAD_POLL_S = 0.25  # how often the supervisor looks for a stage process that exited (a poll of each child)


@dataclass(frozen=True)
class MeshNow:
    """A pipeline as the gateway routes it now: its stages' URLs in order and the split its last re-split or
    membership change committed (None: none yet, the stages' own flags)."""

    routed: list[str]
    committed: list[str] | None


def restart_ranges(local: list[str], now: MeshNow) -> tuple[list[str | None], dict[str, str]]:
    """How `up` restarts its stage processes (at the URLs `local`, in the order it started them) in the mesh `now`:
    each one's range (None: the one it has), and the ones not to restart in place, with why. While the gateway routes
    through up's own stages alone, in their order, a restart serves the committed split (a re-split, or hosts that
    joined and left, moved the layers: the first range would not fit its neighbours). Once hosts joined, a stage
    beside them is not restarted in place: its neighbours' CURVE keys are the joined hosts' own, which a process of
    up's key set does not hold; the gateway covers its loss (its layers go to a neighbour, services/gateway/engine/
    membership.py). A stage the mesh no longer routes through is not restarted either."""
    norm = [u.rstrip("/") for u in local]
    routed = [u.rstrip("/") for u in now.routed]
    if routed == norm:
        ranges = now.committed if now.committed is not None and len(now.committed) == len(norm) else [None] * len(norm)
        return list(ranges), {}
    skip = {}
    for url in norm:
        skip[url] = ("the mesh no longer routes through it (its layers went to another stage)" if url not in routed
                     else "hosts joined the mesh beside it: the gateway routes around it")
    return [None] * len(norm), skip


async def _supervise(meshes: list[LocalMesh], now: Callable[[int], MeshNow | None] = lambda r: None,
                     spares: SparePool | None = None) -> None:
    """Restart a stage process that exits as the mesh now routes it (`now(r)`: pipeline r as the gateway routes it,
    None: as up started it; restart_ranges says with which range, or why not; a spare from `spares` takes its place
    where one waits), and announce each stage's decode mode as it changes."""
    states: list[dict[int, str]] = [{} for _ in meshes]
    watching, last_poll = True, 0.0
    left: set[tuple[int, int]] = set()  # (pipeline, stage) not restarted, said once
    while True:
        await asyncio.sleep(DEAD_POLL_S)
        for r, mesh in enumerate(meshes):
            name = f"pipeline p{r} " if len(meshes) > 1 else ""
            mesh_now = now(r)
            ranges, skip = restart_ranges(mesh.stage_urls, mesh_now) if mesh_now is not None else ([], {})
            for stage, layers in zip(mesh.stages, ranges):
                if layers is not None:
                    stage.serve_layers(layers)
            for stage in mesh.stages:
                why = skip.get(stage.url)
                if why is not None and stage.proc.poll() is not None and (r, stage.index) not in left:
                    left.add((r, stage.index))
                    _say(f"{name}stage {stage.index} exited; not restarted: {why}")
            before = len(spares.taken) if spares is not None else 0
            restarted = mesh.restart_dead(spares, keep=set(skip))
            by_spare = dict(spares.taken[before:]) if spares is not None else {}  # stage index -> the spare's pid
            for i in restarted:
                how = f"spare pid {by_spare[i]} took its place" if i in by_spare else "restarted it"
                print(f"{name}stage {i} exited; {how} (the gateway replays what it was serving"
                      f"{' on another pipeline' if len(meshes) > 1 else ''})", flush=True)
                states[r].pop(i, None)
                watching = True
        if watching and time.monotonic() - last_poll >= 2.0:
            last_poll = time.monotonic()
            watching = False
            for r, mesh in enumerate(meshes):
                infos = await asyncio.to_thread(_compiled_decode, mesh)
                for line in decode_notes(states[r], infos):
                    _say(f"p{r} {line}" if len(meshes) > 1 else line)
                watching |= (len(states[r]) < len(mesh.stages)
                             or any(v.startswith("compiling") for v in states[r].values())
                             or "pending" in states[r].values())


def _compiled_decode(mesh: LocalMesh) -> dict[int, dict]:
    """Each reachable stage's compiled_decode entry of its /info (a stage that does not answer is left out and asked
    again next time)."""
    infos = {}
    for s in mesh.stages:
        try:
            infos[s.index] = s.info().compiled_decode
        except (OSError, ValueError):  # InfoError is a ValueError
            pass
    return infos


async def _serve(app: web.Application, host: str, port: int, meshes: list[LocalMesh],
                 spares: SparePool | None = None) -> None:
    """Serve until SIGINT/SIGTERM; the gateway drains (serve_until_signal) before cmd_up stops the stages, so no
    stage is stopped with a micro-batch of a live request in hand."""
    from services.gateway.app import serve_until_signal
    from services.gateway.frontend.frontend import GATEWAY

    async def started() -> None:
        replicas = app[GATEWAY].replicas
        while len(replicas.ready) < len(replicas.all):
            await asyncio.sleep(0.2)
        gw = app[GATEWAY]
        _say(ready_banner(host, port, len(meshes[0].stages), gw.config.model_id, len(meshes),
                          chat=gw.files.chat_template is not None))
        def now(r: int) -> MeshNow:
            engine = gw.replicas.all[r].engine
            committed = engine.mesh.committed
            return MeshNow(list(engine.pipeline.stage_urls), None if committed is None else [str(c) for c in committed])

        await _supervise(meshes, now, spares)

    await serve_until_signal(app, host, port, started)
