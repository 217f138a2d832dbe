"""`stagemesh gateway`: serve the API in front of running stages."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from aiohttp import web

from services.gateway.app import make_app, serve_until_signal
from services.gateway.engine.pipeline import Pipeline
from services.gateway.flags import gateway_config_from_args
from services.gateway.frontend.durable import default_state_dir, open_store
from services.process.args import (
    config_from_args,
    otlp_from_args,
    parse_host_port,
)
from services.process.keys import join_token_from_args, key_set_from_args
from shared.config import SchedulerConfig, check_address
from shared.errors import StagemeshError
from shared.observe.otlp import OtlpTracer
from shared.runtime.model_files import ModelFiles

log = logging.getLogger("stagemesh.gateway")


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
                          s.first_stage, poll_s=scheduling.stage_poll_s, keys=keys, stall_s=scheduling.stall_timeout_s) for s in specs]
    # K = stages: each stage has a micro-batch to work on; more splits the running sequences into smaller
    # micro-batches, which on a CPU costs more than the gateway's turnaround it hides (compare --max-inflight
    # values with benchmarks.compare_llamacpp, which passes up flags after --)
    inflight = scheduling.max_inflight or len(specs[0].stage_urls)
    otlp_url = otlp_from_args(args)
    otlp = OtlpTracer(otlp_url, "stagemesh-gateway") if otlp_url else None
    store = None
    if config.state_dir != "off":
        port = args.port if hasattr(args, "port") else parse_host_port(args.listen, "--listen")[1]  # up / gateway
        try:
            store = open_store(config.state_dir or default_state_dir(port), f"{socket.gethostname()}:{port}",
                               files.loader.fingerprint, config.state_keep_s)
        except StagemeshError as e:
            if config.state_dir:  # asked for: its problem is the user's to fix
                raise
            # the default place cannot be used (a read-only root file system, a second gateway on this port's dir)
            log.warning("no durable request log: %s", e)
    split_auto = getattr(args, "split", None) == "auto"  # `gateway --split auto`, `up --split auto`
    join_token = join_token_from_args(args)
    if join_token is not None:
        if len(pipelines) > 1:
            raise StagemeshError("--join-token serves one pipeline: hosts join it as new stages (drop --pipeline)")
        if getattr(args, "join_token", None) == "auto":
            where = getattr(args, "listen", None) or f"{getattr(args, 'host', '127.0.0.1')}:{getattr(args, 'port', '')}"
            print(f"join this mesh from another host: stagemesh join http://{where} --token {join_token} --model "
                  f"{model}", flush=True)
    return make_app(files, pipelines, config, inflight, scheduling, otlp, store, split_auto=split_auto,
                    join_token=join_token)


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
