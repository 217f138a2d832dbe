"""`stagemesh gateway`: serve the API in front of running stages."""

from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web

from services.cli_args import (
    add_edge_args,
    add_model_args,
    add_otlp_args,
    add_scheduler_args,
    edge_from_args,
    otlp_from_args,
    parse_host_port,
    serving_from_args,
    stall_from_args,
)
from services.gateway.app import API_KEY_ENV, GatewayConfig, make_app, serve_until_signal
from services.gateway.pipeline import Pipeline
from services.keys_cli import add_security_args, key_set_from_args
from shared.errors import StagemeshError
from shared.model_files import ModelFiles
from shared.otlp import OtlpTracer
from shared.transport import check_address

log = logging.getLogger("stagemesh.gateway")


def register(sub) -> None:
    p = sub.add_parser("gateway", help="serve the API in front of running stages",
                       description="OpenAI-compatible API, websocket stream and chat page over a pipeline of stages.")
    add_model_args(p, dtype=False)
    p.add_argument("--stages", required=True,
                   help="comma-separated stage HTTP URLs in pipeline order, or one pattern with {i} and --num-stages")
    p.add_argument("--num-stages", type=int, default=None, help="with a --stages pattern: how many stages")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve HTTP on (default 127.0.0.1:8000)")
    p.add_argument("--result-listen", default="tcp://127.0.0.1:5599",
                   help="ZeroMQ address the last stage sends results to (bound here)")
    p.add_argument("--first-stage", default=None, help="ZeroMQ address of stage 0 (default: from its /info)")
    add_scheduler_args(p)
    add_edge_args(p)
    add_otlp_args(p)
    add_security_args(p)
    p.set_defaults(func=cmd_gateway)


def build_app(model: str, stage_urls: list[str], result_listen: str, first_stage: str | None, args) -> web.Application:
    files = ModelFiles.open(model)
    for u in stage_urls:
        if not u.startswith(("http://", "https://")):
            raise StagemeshError(f"--stages entry {u!r} must be an http:// URL of a stage's HTTP endpoint")
    check_address(result_listen, "--result-listen")
    key_set = key_set_from_args(args, "stagemesh gateway")
    keys = None
    if key_set is not None:
        key_set.check_stages(len(stage_urls), "the gateway's --stages")
        keys = key_set.for_gateway()
    pipeline = Pipeline(stage_urls, result_listen, files.loader.fingerprint, files.config.num_layers, first_stage,
                        keys=keys, stall_s=stall_from_args(args))
    # K = stages: each stage has a micro-batch to work on; more splits the running sequences into smaller
    # micro-batches, which on a CPU costs more than the gateway's turnaround it hides (compare --max-inflight
    # values with benchmarks.compare_llamacpp, which passes up flags after --)
    inflight = args.max_inflight or len(stage_urls)
    if inflight < 1:
        raise StagemeshError("--max-inflight must be positive")
    api_key = os.environ.get(API_KEY_ENV) or None
    edge = edge_from_args(args)
    if edge["metrics_require_key"] and not api_key:
        raise StagemeshError(f"--metrics-require-key needs an API key: set {API_KEY_ENV}")
    otlp_url = otlp_from_args(args)
    otlp = OtlpTracer(otlp_url, "stagemesh-gateway") if otlp_url else None
    return make_app(files, pipeline, GatewayConfig(model_id=model, api_key=api_key, **edge), inflight,
                    serving_from_args(args), otlp, prefix_cache=getattr(args, "prefix_cache", "on") == "on")


def stage_urls(stages: str, num_stages: int | None) -> list[str]:
    if "{i}" in stages:
        if not num_stages or num_stages < 1:
            raise StagemeshError("a --stages pattern with {i} needs --num-stages N")
        return [stages.replace("{i}", str(i)) for i in range(num_stages)]
    return [u.strip() for u in stages.split(",") if u.strip()]


def cmd_gateway(args) -> int:
    host, port = parse_host_port(args.listen, "--listen")
    urls = stage_urls(args.stages, args.num_stages)
    app = build_app(args.model, urls, args.result_listen, args.first_stage, args)
    print(f"stagemesh gateway on http://{host}:{port}/ over {len(urls)} stages", flush=True)
    asyncio.run(serve_until_signal(app, host, port))  # SIGTERM: drain, then exit 0
    return 0
