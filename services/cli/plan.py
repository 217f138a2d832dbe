"""`stagemesh plan --model M --host NAME:mem=8G[,ms_per_layer=1.2,rtt_ms=1,gbit=1] ... [--streams 16] [--json]`: the
split over the hosts, each stage's memory, and the predicted tok/s at 1 and N streams, against the first host alone
("will a second machine help?"). Hosts without a measured ms_per_layer are measured here (shared/runtime/plan.py has the
model of time)."""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, replace

import torch

from services.cli.flags import HOST_FORM
from shared.batch.steps import Decode, Prefill
from shared.config import parse_bytes
from shared.cpu import usable_cores
from shared.errors import StagemeshError
from shared.files.layers import LayerRange
from shared.models.device import default_device, resolve_dtype, resolve_kv_dtype
from shared.runtime.model_files import ModelFiles
from shared.runtime.plan import STAGE_HANDOFF_MS, Host, ModelFacts, Plan, Workload, gib, plan
from shared.runtime.roofline import Roofline, token_bytes, triad_bandwidth
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import SeqEntry

# a --host key -> how its value parses, for the keys that are Host fields (mem and cores are read apart)
_HOST_KEYS = {"ms_per_layer": float, "head_ms": float, "rtt_ms": float, "gbit": float, "overhead_ms": float}
MEASURE_LAYERS = 4  # the longer piece timed (the shorter has one layer): ms per layer is their difference
MEASURE_STEPS = 12  # timed decode steps of each piece (median), after 2 untimed
IDLE_GAP_S = 0.003  # before each timed step: a stage at one stream waits for its next input (a hop, or the other
# stages' turn) and computes on a core gone cold meanwhile, slower than back to back (a cold core:
# docs/performance.md#one-stream-over-several-stages)


@dataclass(frozen=True)
class HostSpec:
    """A --host as given: the Host's fields that were set, and the threads to measure it with when ms_per_layer is
    missing."""

    name: str
    memory: int
    cores: int | None
    given: dict


def parse_host(text: str) -> HostSpec:
    name, sep, rest = text.partition(":")
    if not sep or not name.strip() or not rest.strip():
        raise StagemeshError(f"--host {text!r} must be {HOST_FORM}")
    given: dict = {}
    memory = cores = None
    for item in rest.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        try:
            if not eq:
                raise ValueError("KEY=VALUE")
            if key == "mem":
                memory = parse_bytes(value)
            elif key == "cores":
                cores = int(value)
                if cores < 1:
                    raise ValueError("at least 1")
            elif key in _HOST_KEYS:
                given[key] = _HOST_KEYS[key](value)
                if not math.isfinite(given[key]):
                    raise ValueError("a finite number")
            else:
                raise StagemeshError(f"--host {name}: unknown key {key!r}; keys: mem, cores, {', '.join(_HOST_KEYS)}")
        except ValueError as e:
            raise StagemeshError(f"--host {name}: {item!r} is not valid ({e}); write {HOST_FORM}") from None
    if memory is None:
        raise StagemeshError(f"--host {name} gives no mem=; write {HOST_FORM}")
    try:
        Host(name, memory, given.get("ms_per_layer", 1.0), **{k: v for k, v in given.items() if k != "ms_per_layer"})
    except StagemeshError as e:
        raise StagemeshError(f"--host {text!r}: {e}") from None
    return HostSpec(name.strip(), memory, cores, given)


@dataclass(frozen=True)
class Measured:
    """Decode steps timed on this machine (eager, the weights mode `auto`, one sequence unless said)."""

    threads: int
    ms_per_layer: float
    head_ms: float  # the last stage's norm + lm_head beyond its layers
    overhead_ms: float  # a piece's fixed cost per step, and the hand-off to a stage's compute thread and back
    batch_factor: float  # a step of `rows` sequences over a step of one
    rows: int
    bandwidth: float | None = None  # bytes/s this machine reads with `threads` threads (a STREAM triad; roofline.py)


def _steps_ms(probes: list[tuple], context: int) -> list[float]:
    """Median ms of a decode step of each probe (runtime, rows, hidden: None to feed token ids, else the width of
    the hidden [rows, D] fed), its `rows` sequences holding `context` positions. The probes take turns step by step,
    so that the machine's drift touches each alike."""
    def inputs(n: int, hidden: int | None) -> dict:
        if hidden is None:
            return {"token_ids": torch.randint(100, 1000, (n,))}
        return {"hidden": torch.randn(n, hidden) * 0.1}

    seqs = [[f"plan{i}" for i in range(rows)] for _, rows, _ in probes]
    for (runtime, _, hidden), ids in zip(probes, seqs):
        for s in ids:
            runtime.run([SeqEntry(s, Prefill(context, 0, context, True))], **inputs(context, hidden))
    times: list[list[float]] = [[] for _ in probes]
    for k in range(2 + MEASURE_STEPS):  # the first 2 untimed: a kernel's first call at a shape pays one-off costs
        for (runtime, rows, hidden), ids, out in zip(probes, seqs, times):
            x = inputs(rows, hidden)
            time.sleep(IDLE_GAP_S)
            t = time.perf_counter()
            runtime.run([SeqEntry(s, Decode(context + k)) for s in ids], **x)
            out.append(time.perf_counter() - t)
    for (runtime, _, _), ids in zip(probes, seqs):
        for s in ids:
            runtime.release(s)
    return [1e3 * statistics.median(t[2:]) for t in times]


def measure_here(files: ModelFiles, dtype_name: str | None, threads: int, rows: int, context: int = 64) -> Measured:
    """Times a first piece of 1 and of MEASURE_LAYERS layers and a last piece of 1 layer (its head), eagerly, with
    `threads` torch threads: ms per layer is the difference of the first two, the head the last's excess over the
    first's. The batch factor is the longer piece's step at `rows` sequences over one, its fixed cost left out."""
    n = files.config.num_layers
    if n < 3:
        raise StagemeshError(f"{files.loader.path} has {n} layers; measuring needs 3 or more: give ms_per_layer= for "
                             "every --host")
    k = min(MEASURE_LAYERS, n - 1)
    device = default_device()
    dtype = resolve_dtype(dtype_name, device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    quiet = logging.getLogger("stagemesh")  # each piece's load says how it holds its weights: not this command's news
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING) if not quiet.isEnabledFor(logging.DEBUG) else level)
    try:
        def load(a: int, b: int):
            return StageRuntime.load(files.loader, LayerRange(a, b), dtype, device, kv_slots=rows,
                                     max_seq_len=context + 2 + MEASURE_STEPS + 1, weights="auto", compile_decode="off")

        one, longer, last = load(0, 1), load(0, k), load(n - 1, n)
        probes = [(one, 1, None), (longer, 1, None), (last, 1, files.config.hidden_size)]
        t1, tk, t_last = _steps_ms(probes, context)
        tk_rows = _steps_ms([(longer, rows, None)], context)[0] if rows > 1 else tk
        del one, longer, last  # their memory back before the triad's arrays
        bandwidth = triad_bandwidth(threads=threads)
    finally:
        torch.set_num_threads(before)
        quiet.setLevel(level)
    per_layer = max(1e-3, (tk - t1) / (k - 1))
    fixed = max(0.0, t1 - per_layer)
    return Measured(threads, per_layer, max(0.0, t_last - t1), fixed + STAGE_HANDOFF_MS,
                    max(1.0, (tk_rows - fixed) / (tk - fixed)), rows, bandwidth)


def build_hosts(specs: list[HostSpec], measured: dict[int, Measured]) -> list[Host]:
    """Hosts from their specs; what a spec leaves out of ms_per_layer, head_ms and overhead_ms comes from the
    measurement at its cores, where there is one."""
    hosts = []
    for s in specs:
        m = measured.get(s.cores or usable_cores()) if "ms_per_layer" not in s.given else None
        fields = {"ms_per_layer": m.ms_per_layer, "head_ms": m.head_ms, "overhead_ms": m.overhead_ms} if m else {}
        hosts.append(Host(s.name, s.memory, **(fields | s.given)))
    return hosts


def rooflines(model: ModelFacts, p: Plan, bandwidths: list[float | None]) -> dict | None:
    """The plan's one stream against the memory roofline (shared/runtime/roofline.py), where every host's bandwidth
    was measured here (None: a host gave its own speed): each stage's one-row step against the weight bytes it reads
    over its host's bandwidth, and the token's time against the sum of those. K/V is left out on both sides: the
    model of time has no context term (its speeds are timed at a short context)."""
    if not bandwidths or any(b is None for b in bandwidths):
        return None
    last = len(p.ranges) - 1
    stages = [Roofline(bw, token_bytes(model, range(r.start, r.stop), head=i == last))
              for i, (r, bw) in enumerate(zip(p.ranges, bandwidths))]
    ms = sum(r.ms_per_token for r in stages)
    return {"bandwidth_bytes_per_s": [round(b) for b in bandwidths],
            "bytes_per_token": sum(r.bytes_per_token for r in stages), "tokens_per_s": round(1e3 / ms, 2),
            "predicted_fraction": round(p.tokens_per_s * ms / 1e3, 4),
            "stages": [{"host": h.name, "bytes_per_token": r.bytes_per_token, "roofline_ms": round(r.ms_per_token, 3),
                        "step_ms": round(t, 3), "fraction": round(r.ms_per_token / t, 4)}
                       for h, r, t in zip(p.hosts, stages, p.stage_ms)]}


def alone(model: ModelFacts, host: Host, work: Workload) -> Plan | str:
    """The first host serving every layer by itself, or why it cannot."""
    try:
        return plan(model, [replace(host, rtt_ms=0.0, gbit=None)], work)
    except StagemeshError as e:
        return str(e)


def cmd_plan(args) -> int:
    specs = [parse_host(h) for h in args.hosts]
    if not specs:
        raise StagemeshError(f"give at least one --host {HOST_FORM}")
    if len({s.name for s in specs}) < len(specs):
        raise StagemeshError("--host names must differ (they name the stages in the plan)")
    if args.streams < 1 or args.context < 1:
        raise StagemeshError("--streams and --context must be at least 1")
    if args.batch_factor is not None and not 1.0 <= args.batch_factor <= args.streams:
        raise StagemeshError(f"--batch-factor must be between 1 (a step of {args.streams} sequences costs one's) and "
                             f"{args.streams} (costs {args.streams} steps)")
    files = ModelFiles.open(args.model)
    if args.context > files.config.context_length:
        raise StagemeshError(f"--context {args.context} is longer than the model's context of "
                             f"{files.config.context_length} tokens; give at most that")
    dtype = resolve_dtype(args.dtype, default_device())
    model = ModelFacts.from_gguf(files.loader, resolve_kv_dtype(getattr(args, "kv_dtype", None), dtype).itemsize)
    measured: dict[int, Measured] = {}
    here = usable_cores()
    for s in specs:
        threads = s.cores or here
        if "ms_per_layer" not in s.given and threads not in measured:
            if threads > here:
                raise StagemeshError(f"--host {s.name}: cores={threads} cannot be measured on this machine's {here}; "
                                     "give ms_per_layer= measured on that host")
            measured[threads] = measure_here(files, args.dtype, threads, args.streams)
    if args.batch_factor is None and not measured:  # every host gave its speed: the batch factor is still timed here
        measured[here] = measure_here(files, args.dtype, here, args.streams)
    factor = args.batch_factor or next(iter(measured.values())).batch_factor
    work = Workload(args.streams, args.context, (factor - 1) / max(1, args.streams - 1))
    hosts = build_hosts(specs, measured)
    result = plan(model, hosts, work)
    first = alone(model, hosts[0], work) if len(hosts) > 1 else result
    bandwidths = [None if "ms_per_layer" in s.given else measured[s.cores or here].bandwidth for s in specs]
    roof = rooflines(model, result, bandwidths)
    if args.json:
        print(json.dumps({"model": model.name, "layers": model.num_layers, "dtype": str(dtype).removeprefix("torch."),
                          "streams": args.streams, "context": args.context, "batch_factor": round(factor, 3),
                          "measured": [vars(m) for m in measured.values()], "plan": result.as_dict(),
                          "first_host_alone": first if isinstance(first, str) else first.as_dict(),
                          "roofline": roof}))
        return 0
    print(f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, {gib(sum(model.layer_bytes))} of "
          f"layers in the file; KV for {args.streams} streams x {args.context} tokens "
          f"({str(dtype).removeprefix('torch.')})")
    for m in measured.values():
        print(f"measured here ({m.threads} threads, eager decode): {m.ms_per_layer:.3f} ms a layer, head "
              f"{m.head_ms:.2f} ms, {m.overhead_ms:.2f} ms fixed a step; {m.rows} sequences a step "
              f"{m.batch_factor:.2f}x one")
    print_plan(result)
    if roof is not None:
        print(f"memory roofline: a token reads {roof['bytes_per_token'] / 2**20:.0f} MiB of weights; at {', '.join(f'{b / 1e9:.1f}' for b in roof['bandwidth_bytes_per_s'])} GB/s (STREAM triad "
              f"here) one stream makes at most {roof['tokens_per_s']:.1f} tok/s: the prediction is "
              f"{100 * roof['predicted_fraction']:.0f} % of it (" + ", ".join(
                  f"{s['host']} {100 * s['fraction']:.0f} %" for s in roof["stages"]) + " of each stage's)")
    if len(hosts) > 1:
        print(f"will a second machine help? {answer(first, result, hosts[0].name, args.streams)}")
    return 0


def print_plan(p: Plan) -> None:
    rows = [("host", "layers", "memory: weights + KV + runtime = need / has", "ms a step")]
    for h, r, m, t in zip(p.hosts, p.ranges, p.memory, p.stage_ms):
        rows.append((h.name, str(r), f"{m.weights / 2**30:.2f} + {m.kv / 2**30:.2f} + {m.runtime / 2**30:.2f} = "
                                     f"{gib(m.total)} / {gib(h.memory)}", f"{t:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"predicted: 1 stream {p.token_ms:.2f} ms a token, {p.tokens_per_s:.1f} tok/s; {p.work.streams} streams "
          f"{p.streams_tokens_per_s:.1f} tok/s (bound by {p.bottleneck})")


def answer(first: Plan | str, all_hosts: Plan, name: str, streams: int) -> str:
    ours = f"{all_hosts.tokens_per_s:.1f} tok/s at 1 stream, {all_hosts.streams_tokens_per_s:.1f} at {streams}"
    if isinstance(first, str):
        return f"yes: {name} alone cannot hold the model ({first}); the hosts together: {ours}"
    one, many = (all_hosts.tokens_per_s / first.tokens_per_s,
                 all_hosts.streams_tokens_per_s / first.streams_tokens_per_s)
    verdict = "yes" if max(one, many) > 1.05 else "no" if max(one, many) < 0.95 else "barely"
    return (f"{verdict}: {name} alone {first.tokens_per_s:.1f} tok/s at 1 stream, "
            f"{first.streams_tokens_per_s:.1f} at {streams}; the hosts together {ours} ({one:.2f}x, {many:.2f}x)")
