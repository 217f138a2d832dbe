"""`stagemesh up`: a gateway and N stage processes on loopback, one command, clean shutdown on Ctrl-C/SIGTERM."""

from __future__ import annotations

import asyncio
import os
import tempfile

from aiohttp import web

from services.cli_args import (
    add_edge_args,
    add_kv_args,
    add_model_args,
    add_otlp_args,
    add_scheduler_args,
    model_flags,
    otlp_from_args,
    serving_from_args,
)
from services.gateway.app import GATEWAY, serve_until_signal
from services.gateway.main import build_app
from services.keys_cli import add_security_args
from services.launch import LocalMesh, start_mesh
from shared.errors import StagemeshError


def register(sub) -> None:
    p = sub.add_parser("up", help="start a gateway and N stages on this machine",
                       description="Start N stage processes on loopback and a gateway in front of them.")
    add_model_args(p, serving=True)
    p.add_argument("--stages", type=int, default=2, help="number of stage processes (default 2)")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="gateway HTTP host (default 127.0.0.1: loopback only)")
    add_kv_args(p)
    p.add_argument("--log-dir", default=None, help="where stage logs go (default: a temporary directory)")
    add_scheduler_args(p)
    add_edge_args(p)
    add_otlp_args(p)
    add_security_args(p, up=True)  # up makes ephemeral keys itself; only --insecure-plaintext is offered
    p.set_defaults(func=cmd_up)


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


def cmd_up(args) -> int:
    otlp_url = otlp_from_args(args)  # checked before any stage starts; the stages export to the same collector
    log_dir = log_dir_from_args(args.log_dir)
    print(f"starting {args.stages} stages (logs in {log_dir}) ...", flush=True)
    serving = serving_from_args(args)
    mesh = start_mesh(args.model, args.stages, log_dir=log_dir, avoid_ports=frozenset({args.port}),
                      extra=model_flags(args) + ["--kv-slots", str(serving.kv_slots),
                                                 "--max-seq-len", str(serving.max_seq_len)]
                      + (["--otlp-endpoint", otlp_url] if otlp_url else []),
                      insecure_plaintext=args.insecure_plaintext)
    args.keys = mesh.keys_dir  # the ephemeral key set (0700 temporary directory, deleted at stop)
    try:
        app = build_app(args.model, mesh.stage_urls, mesh.result_listen, mesh.first_stage, args)
        asyncio.run(_serve(app, args.host, args.port, mesh))
    finally:
        print("stopping stages ...", flush=True)
        mesh.stop()
    return 0


async def _supervise(mesh: LocalMesh) -> None:
    while True:
        await asyncio.sleep(1.0)
        for i in mesh.restart_dead():
            print(f"stage {i} exited; restarted it (the gateway replays what it was serving)", flush=True)


async def _serve(app: web.Application, host: str, port: int, mesh: LocalMesh) -> None:
    """Serve until SIGINT/SIGTERM; the gateway drains (serve_until_signal) before cmd_up stops the stages, so no
    stage is stopped with a micro-batch of a live request in hand."""

    async def started() -> None:
        pipeline = app[GATEWAY].pipeline
        while not pipeline.ready:
            await asyncio.sleep(0.2)
        print(f"stagemesh is up: open http://{host}:{port}/ (chat page), API at http://{host}:{port}/v1 "
              f"({len(mesh.stages)} stages, pid {os.getpid()}; Ctrl-C to stop)", flush=True)
        await _supervise(mesh)

    await serve_until_signal(app, host, port, started)
