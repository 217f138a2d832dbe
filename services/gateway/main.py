"""`stagemesh gateway`: serve the API in front of running stages."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from aiohttp import web

from services.gateway.app import make_app, serve_until_signal
from services.gateway.config import API_KEY_ENV, GatewayConfig
from services.gateway.pipeline import Pipeline
from services.process.args import (
    add_config_args,
    add_model_args,
    add_otlp_args,
    config_from_args,
    otlp_from_args,
    parse_host_port,
)
from services.process.keys import add_security_args, key_set_from_args
from shared.config import GATEWAY_PORT, SchedulerConfig
from shared.errors import StagemeshError
from shared.observe.otlp import OtlpTracer
from shared.runtime.model_files import ModelFiles
from shared.wire.transport import check_address

log = logging.getLogger("stagemesh.gateway")


def register(sub) -> None:
    p = sub.add_parser("gateway", help="serve the API in front of running stages",
                       description="OpenAI-compatible API, websocket stream and chat page over a pipeline of stages.")
    add_model_args(p, dtype=False)
    p.add_argument("--stages", default=None,
                   help="comma-separated stage HTTP URLs in pipeline order, or one pattern with {i} and --num-stages")
    p.add_argument("--num-stages", type=int, default=None, help="with a --stages pattern: how many stages")
    p.add_argument("--pipeline", action="append", default=[], metavar="URL,URL,...",
                   help="one pipeline's stage HTTP URLs in order, or one pattern with {i} and --num-stages (instead "
                        "of --stages); repeat for each replica of the model: requests are routed by prefix cache, session and load, and fail over between them")
    p.add_argument("--listen", default=f"127.0.0.1:{GATEWAY_PORT}",
                   help=f"HOST:PORT to serve HTTP on (default 127.0.0.1:{GATEWAY_PORT})")
    p.add_argument("--result-listen", action="append", default=[], metavar="ADDR",
                   help="ZeroMQ address the last stage sends results to (bound here; default tcp://127.0.0.1:5599); "
                        "with several --pipeline, one per pipeline in the same order, or one whose port is the first "
                        "of consecutive ports")
    p.add_argument("--first-stage", default=None, help="ZeroMQ address of stage 0 (default: from its /info; one "
                                                       "pipeline only)")
    add_config_args(p, SchedulerConfig)
    add_config_args(p, GatewayConfig)
    add_otlp_args(p)
    add_security_args(p)
    p.set_defaults(func=cmd_gateway)


@dataclass
class PipelineSpec:
    """Where one pipeline's stages are, as `gateway` and `up` name them."""

    stage_urls: list[str]
    result_listen: str
    first_stage: str | None = None


def build_app(model: str, specs: list[PipelineSpec], args) -> web.Application:
    """The gateway over one or several pipelines (replicas of the same model, each checked on its own)."""
    config = gateway_config_from_args(args, model)
    files = ModelFiles.open(model, config.chat_template)
    seen: set[str] = set()
    for spec in specs:
        for u in spec.stage_urls:
            if not u.startswith(("http://", "https://")):
                raise StagemeshError(f"--stages entry {u!r} must be an http:// URL of a stage's HTTP endpoint")
            if u.rstrip("/") in seen:
                raise StagemeshError(f"stage {u} is named twice: each pipeline needs stages of its own")
            seen.add(u.rstrip("/"))
        check_address(spec.result_listen, "--result-listen")
    if len({s.result_listen for s in specs}) < len(specs):
        raise StagemeshError("two pipelines share a --result-listen address; give each its own")
    if len({len(s.stage_urls) for s in specs}) > 1:
        raise StagemeshError("the pipelines have different numbers of stages "
                             f"({', '.join(str(len(s.stage_urls)) for s in specs)}); replicas share one key set and "
                             "one layout: give every --pipeline the same number of stages")
    key_set = key_set_from_args(args, "stagemesh gateway")
    keys = None
    if key_set is not None:
        key_set.check_stages(len(specs[0].stage_urls), "the gateway's --stages")
        keys = key_set.for_gateway()
    scheduling = config_from_args(SchedulerConfig, args)
    pipelines = [Pipeline(s.stage_urls, s.result_listen, files.loader.fingerprint, files.config.num_layers,
                          s.first_stage, keys=keys, stall_s=scheduling.stall_timeout_s) for s in specs]
    # K = stages: each stage has a micro-batch to work on; more splits the running sequences into smaller
    # micro-batches, which on a CPU costs more than the gateway's turnaround it hides (compare --max-inflight
    # values with benchmarks.compare_llamacpp, which passes up flags after --)
    inflight = scheduling.max_inflight or len(specs[0].stage_urls)
    otlp_url = otlp_from_args(args)
    otlp = OtlpTracer(otlp_url, "stagemesh-gateway") if otlp_url else None
    return make_app(files, pipelines, config, inflight, scheduling, otlp)


def gateway_config_from_args(args, model: str) -> GatewayConfig:
    """The GatewayConfig of `gateway`'s (or `up`'s) flags, the model's name and $STAGEMESH_API_KEY; validated. The
    model's name in the API is --served-model-name, else --model as given when it is an alias, else the file's name
    without .gguf (never a path of this machine)."""
    name = args.served_model_name or os.path.basename(model).removesuffix(".gguf")
    return config_from_args(GatewayConfig, args, model_id=name, api_key=os.environ.get(API_KEY_ENV) or None)


def stage_urls(stages: str, num_stages: int | None) -> list[str]:
    if "{i}" in stages:
        if not num_stages or num_stages < 1:
            raise StagemeshError("a --stages pattern with {i} needs --num-stages N")
        return [stages.replace("{i}", str(i)) for i in range(num_stages)]
    return [u.strip() for u in stages.split(",") if u.strip()]


def pipeline_specs(args) -> list[PipelineSpec]:
    """The pipelines `stagemesh gateway` serves: --stages (one), or one per --pipeline, with their result ports."""
    if bool(args.stages) == bool(args.pipeline):
        raise StagemeshError("name the stages with --stages URL,... (one pipeline) or with one --pipeline URL,... per "
                             "pipeline, not both")
    groups = [stage_urls(args.stages, args.num_stages)] if args.stages else [stage_urls(p, args.num_stages)
                                                                                     for p in args.pipeline]
    if any(not g for g in groups):
        raise StagemeshError("a --pipeline or --stages names no stage URL")
    results = args.result_listen or ["tcp://127.0.0.1:5599"]
    if len(results) == 1 and len(groups) > 1:
        scheme_host, _, port = results[0].rpartition(":")
        if not port.isdigit():
            raise StagemeshError(f"--result-listen {results[0]!r} must end in :PORT to serve several pipelines")
        results = [f"{scheme_host}:{int(port) + i}" for i in range(len(groups))]
    if len(results) != len(groups):
        raise StagemeshError(f"{len(results)} --result-listen addresses for {len(groups)} pipelines: give one, or "
                             "one per --pipeline")
    if args.first_stage and len(groups) > 1:
        raise StagemeshError("--first-stage serves one pipeline; with several, each stage 0 is read from its /info")
    return [PipelineSpec(g, r, args.first_stage) for g, r in zip(groups, results)]


def cmd_gateway(args) -> int:
    host, port = parse_host_port(args.listen, "--listen")
    specs = pipeline_specs(args)
    app = build_app(args.model, specs, args)
    print(f"stagemesh gateway on http://{host}:{port}/ over {len(specs)} pipeline{'s' if len(specs) > 1 else ''} "
          f"of {len(specs[0].stage_urls)} stages", flush=True)
    asyncio.run(serve_until_signal(app, host, port))  # SIGTERM: drain, then exit 0
    return 0
