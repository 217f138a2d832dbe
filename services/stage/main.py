"""`stagemesh stage`: serve one layer range of a model as a pipeline stage."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from aiohttp import web

from services.process.args import (
    config_from_args,
    otlp_from_args,
    parse_host_port,
)
from services.process.keys import key_set_from_args
from services.stage.flags import calibrate_rows
from services.stage.http import LOAD_ERROR, WORKER, make_app
from services.stage.io import StageIO
from services.stage.worker import StageIdentity, StageWorker, compute_executor
from shared.config import LoadConfig, StageConfig, check_address
from shared.cpu import usable_cores
from shared.errors import StagemeshError
from shared.files.layers import LayerRange, balanced_split, parse_layer_range
from shared.files.model_registry import resolve_model
from shared.models import ModelConfig
from shared.models.device import default_device, resolve_dtype
from shared.observe.otlp import OtlpTracer
from shared.runtime.calibrate import calibrate
from shared.runtime.model_files import ModelFiles
from shared.runtime.plan import ModelFacts
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.mesh_keys import SocketKeys
from shared.wire.protocol import BatchError, ForwardBatch, KVParcel, ReleaseSeqs, Resplit
from shared.wire.transport import ZmqTransport

log = logging.getLogger("stagemesh.stage")


def stage_layers(args, config: ModelConfig) -> LayerRange:
    num_layers = config.num_layers
    if not args.layers and args.stage_index is None:
        raise StagemeshError("give --layers START:STOP or --stage-index I --num-stages N")
    if args.layers:
        return parse_layer_range(args.layers, num_layers)
    if args.num_stages is None:
        raise StagemeshError("--stage-index needs --num-stages")
    if not 0 <= args.stage_index < args.num_stages:
        raise StagemeshError(f"--stage-index {args.stage_index} must be within 0..{args.num_stages - 1}")
    return balanced_split(num_layers, args.num_stages, config.head_cost_in_layers)[args.stage_index]


def resolve_next(args, layers: LayerRange, num_layers: int) -> str:
    """The concrete next hop: --last-next for the last stage when given, else --next with {next} filled in."""
    if args.last_next and layers.stop == num_layers:
        return check_address(args.last_next, "--last-next")
    if "{next}" in args.next:
        if args.stage_index is None:
            raise StagemeshError("--next with {next} needs --stage-index")
        return check_address(args.next.replace("{next}", str(args.stage_index + 1)), "--next")
    return check_address(args.next, "--next")


@dataclass(frozen=True)
class StagePlace:
    """Where a stage sits and how it talks (its command's own flags, resolved and checked)."""

    listen: str  # the ZeroMQ address its PULL binds
    next: str  # the next stage's (or the gateway's result) address, {next} filled in
    http_host: str
    http_port: int
    index: int | None  # its index in the pipeline (None: given by --layers alone)
    prefetch: bool  # receive the next input while computing (off: the benchmark's baseline)
    tracing: bool  # answer trace requests (off: the benchmark's bypass)
    exit_with_parent: int | None  # the launcher's pid, whose end stops this stage
    otlp_endpoint: str | None  # the OTLP/HTTP traces URL (None: tracing export off)


def cmd_stage(args, opened: ModelFiles | None = None) -> int:
    """opened: the model's files already open (a spare taking over: services/stage/spare.py), used when they are
    the file --model names."""
    check_address(args.listen, "--listen")
    host, port = parse_host_port(args.http, "--http")
    config = config_from_args(StageConfig, args)
    load = config_from_args(LoadConfig, args)
    otlp_endpoint = otlp_from_args(args)  # validated before anything loads
    torch.set_num_threads(config.threads or usable_cores())
    same = opened is not None and os.path.realpath(opened.loader.path) == os.path.realpath(resolve_model(args.model))
    files = opened if same else ModelFiles.open(args.model)  # validates the file before anything binds
    layers = stage_layers(args, files.config)
    place = StagePlace(args.listen, resolve_next(args, layers, files.config.num_layers), host, port, args.stage_index,
                       prefetch=not args.no_prefetch, tracing=not args.no_trace,
                       exit_with_parent=args.exit_with_parent, otlp_endpoint=otlp_endpoint)
    keys = stage_keys(args, layers, files.config.num_layers)
    asyncio.run(serve(files, layers, place, config, load, keys, calibrate_rows(args.calibrate)))
    return 0


def stage_keys(args, layers: LayerRange, num_layers: int) -> SocketKeys | None:
    """This stage's CURVE keys (its own pair, its upstream peer, its next hop), checked before anything binds."""
    key_set = key_set_from_args(args, "stagemesh stage")
    if key_set is None:
        return None
    if args.stage_index is None:
        raise StagemeshError("--keys with --layers needs --stage-index I: which stage's keys in the set are this one's")
    if args.num_stages is not None:
        key_set.check_stages(args.num_stages, "--num-stages")
    return key_set.for_stage(args.stage_index, last=layers.stop == num_layers)


async def serve(files: ModelFiles, layers: LayerRange, place: StagePlace, config: StageConfig, load: LoadConfig,
                keys: SocketKeys | None, calibrate_rows: list[int] | None = None,
                on_ready: Callable[[StageWorker, asyncio.Event], Awaitable[None]] | None = None,
                on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """calibrate_rows: time its layers at these batch sizes before it reports ready (--calibrate; None: not).
    on_ready(worker, stop): runs beside the serving stage once it serves (a joined stage's join: it sets `stop`
    when that fails); on_stop(): awaited at SIGTERM while the stage still serves, before it stops (its leave)."""
    app = make_app()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, place.http_host, place.http_port).start()
    log.info("stage %s: http on %s:%d, loading weights", layers, place.http_host, place.http_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = (asyncio.create_task(_exit_with_parent(place.exit_with_parent, stop))
                if place.exit_with_parent else None)
    device = default_device()
    dtype = resolve_dtype(load.dtype, device)
    compute_thread = compute_executor()  # load on the thread that will compute (one OpenMP team)
    threads = config.threads or usable_cores()
    threads = (threads, config.threads_alone or threads)  # with others in flight, alone in the pipeline
    try:
        runtime = await loop.run_in_executor(
            compute_thread, lambda: StageRuntime.load(files.loader, layers, dtype, device, config.kv_slots, config.max_seq_len,
                                            weights=load.weights_mode, batch_invariant=load.batch_invariant,
                                            compile_decode=load.compile_decode,
                                            memory_budget=load.memory_budget, thread_counts=threads,
                                            prefix_slots=config.prefix_slots, prefix_memory=config.prefix_cache_memory,
                                            kv_dtype=load.kv_dtype))
    except StagemeshError as e:
        app[LOAD_ERROR].append(str(e))
        await runner.cleanup()
        raise
    calibration = None
    if calibrate_rows:  # on the compute thread with its serving thread count, before /ready: what serving will see
        def measure() -> dict:
            torch.set_num_threads(threads[0])
            return calibrate(runtime, calibrate_rows)
        calibration = await loop.run_in_executor(compute_thread, measure)
        log.info("stage %s calibrated: %s ms a decode step at %s rows, %.2f GiB free", layers,
                 calibration["ms_per_step"], calibration["rows"], calibration["free_bytes"] / 2**30)
    position = runtime.model.position
    transport = ZmqTransport(place.listen, place.next, accept=(ForwardBatch, ReleaseSeqs, BatchError, Resplit, KVParcel),
                              keys=keys)
    io = StageIO(transport, prefetch=place.prefetch)
    identity = StageIdentity(files.loader.model_name, files.loader.fingerprint, layers, files.config.num_layers,
                             position, str(dtype).removeprefix("torch."), listen=place.listen, index=place.index)
    otlp = None
    if place.otlp_endpoint is not None:
        which = f"{layers.start}-{layers.stop}" if place.index is None else str(place.index)
        otlp = OtlpTracer(place.otlp_endpoint, f"stagemesh-stage-{which}",
                          {"service.instance.id": identity.incarnation, "stagemesh.stage.layers": str(layers)})
    worker = StageWorker(runtime, io, identity, tracing=place.tracing, slot_lease_s=config.slot_lease_s,
                         compute_thread=compute_thread, otlp=otlp, threads=threads)
    worker.calibration = calibration
    worker.model_facts = ModelFacts.from_gguf(files.loader, runtime.model.kv_dtype.itemsize)
    app[WORKER] = worker
    log.info("stage %s (%s) ready: %s -> %s, incarnation %s, %s, a context of %d tokens (%s)", layers, position.value,
             place.listen, place.next, identity.incarnation,
             f"CURVE (accepts {keys.accept_name} only)" if keys else "PLAINTEXT", runtime.kv.max_seq_len,
             runtime.context["why"])
    task = asyncio.create_task(worker.run())
    side = asyncio.create_task(on_ready(worker, stop)) if on_ready is not None else None
    await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if on_stop is not None and not task.done():
        await on_stop()
    if side is not None:
        side.cancel()
    task.cancel()
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a worker that crashed raises here: logged, cleaned up after, then it ends the process
    except Exception:
        log.exception("stage loop failed")
        raise
    finally:
        transport.close()
        if otlp is not None:
            otlp.shutdown()  # exports the spans still queued (bounded by the export timeout)
        if watchdog is not None:
            watchdog.cancel()
        await runner.cleanup()


async def _exit_with_parent(pid: int, stop: asyncio.Event, every_s: float = 0.5) -> None:
    """Set `stop` once `pid` is no longer our parent (it died and we were re-parented): a launcher that was
    SIGKILLed leaves no orphan stage holding ports, memory and KV slots."""
    while os.getppid() == pid:
        await asyncio.sleep(every_s)
    log.warning("launcher (pid %d) is gone; stopping", pid)
    stop.set()

