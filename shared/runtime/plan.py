"""Planning a mesh before buying it: which layers each host serves, the memory each stage needs, and the tok/s to
expect at 1 and N streams. Pure functions of the model's facts (read from the GGUF's header, no weights loaded) and
the hosts' measured speeds; `stagemesh plan` (services/cli/plan.py) measures and prints.

The model of time, per decode step (ms):

    stage_i(b)  = overhead_i + factor(b) * (layers_i * ms_per_layer_i + [last] head_ms)      a micro-batch of b rows
    hop(link,b) = HOP_MS + rtt_ms / 2 + b * hidden * 4 bytes / bandwidth                      one message
    cycle(b)    = GATEWAY_MS + sum_i stage_i(b) + sum of the S + 1 hops                       one token of one row

One stream: a token takes cycle(1). N streams: the gateway keeps m = min(S, N) micro-batches of b = ceil(N / m)
rows in flight; every m micro-batches pass each stage and each link once per cycle, so a cycle lasts
max(cycle(b), m * the busiest stage, link or gateway) and yields N tokens. The gateway sits on the first host: its
first hop is local, the last stage's result comes back over the last host's link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import StagemeshError
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange, StagePosition
from shared.models import ModelConfig
from shared.models.memory import STAGE_RUNTIME_BYTES

GiB = 2**30
RUNTIME_BYTES = STAGE_RUNTIME_BYTES  # a stage process's memory beyond its weights and KV (shared.models.memory)
# One hop's software cost beyond the link (ZeroMQ send, stagemesh's codec both ends, the receiver's wake-up): the
# loopback cost per hop from benchmarks.critical_path's time outside compute with 2 hops (1 stage) and 3 (2 stages)
# (docs/performance.md#one-stream-over-several-stages).
HOP_MS = 0.4
# The gateway's turnaround per step: taking the result, scheduling and sending the next micro-batch, streaming the
# token (the same measurement: what is outside compute less the hops).
GATEWAY_MS = 0.3
# A stage's fixed cost per step beyond its layers: the hand-off to its compute thread and back
# (docs/performance.md#one-stream-over-several-stages), and a piece's own fixed cost (positions, KV layout), which
# `plan` measures; the constant is the default where it does not.
STAGE_HANDOFF_MS = 0.2
STAGE_OVERHEAD_MS = STAGE_HANDOFF_MS + 0.3
# The residual stream is float32 between stages (StageRuntime.run returns hidden [N, D] float32, sent as is), and
# every message carries a msgpack header of about this many bytes.
ACTIVATION_ITEMSIZE = 4
HEADER_BYTES = 256


@dataclass(frozen=True)
class ModelFacts:
    """What planning needs to know of a model, from its GGUF header: sizes in bytes as the file stores them."""

    name: str
    layer_bytes: tuple[int, ...]  # [L] the file bytes of each block's tensors
    head_bytes: int  # output_norm + output (token_embd when tied): what the last stage loads besides its blocks
    hidden_size: int
    kv_bytes_per_token_layer: int  # K and V of one position in one layer, at the KV cache's dtype (--kv-dtype)
    head_cost_in_layers: float  # the last stage's norm + lm_head + sampling, in blocks (ModelConfig)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @classmethod
    def from_gguf(cls, loader: GgufLoader, kv_itemsize: int) -> ModelFacts:
        """kv_itemsize: bytes of one KV element (4 float32, 2 bfloat16/float16: the stages' --kv-dtype, resolved)."""
        c = ModelConfig.from_gguf(loader)
        head = loader.names_for(LayerRange(c.num_layers - 1, c.num_layers), StagePosition.LAST)
        block = loader.names_for(LayerRange(c.num_layers - 1, c.num_layers), StagePosition.MIDDLE)
        layer_bytes = tuple(loader.tensor_bytes(loader.names_for(LayerRange(i, i + 1), StagePosition.MIDDLE))
                            for i in range(c.num_layers))
        # the first stage's token_embd stays in the file's map, read only where looked up: not counted (weight_bytes
        # of /info leaves it out the same way)
        return cls(loader.model_name, layer_bytes, loader.tensor_bytes([n for n in head if n not in block]),
                   c.hidden_size, 2 * c.num_kv_heads * c.head_dim * kv_itemsize, c.head_cost_in_layers)


@dataclass(frozen=True)
class Host:
    """One machine of the pipeline, in pipeline order. Its link leads to the next host (the last host's back to the
    first, where the gateway runs)."""

    name: str
    memory: int  # bytes a stage may hold here
    ms_per_layer: float  # one block's decode step for one sequence, measured on this host
    head_ms: float | None = None  # norm + lm_head + sampling; None: the model's head_cost_in_layers blocks
    rtt_ms: float = 0.0  # round trip to the next host (0: the same host, loopback)
    gbit: float | None = None  # bandwidth to the next host in Gbit/s (None: unlimited, loopback)
    overhead_ms: float = STAGE_OVERHEAD_MS  # a stage's fixed cost per step beyond its layers

    def __post_init__(self):
        if self.memory <= 0 or self.ms_per_layer <= 0 or self.rtt_ms < 0 or self.overhead_ms < 0:
            raise StagemeshError(f"host {self.name}: memory and ms_per_layer must be positive, rtt_ms and "
                                 "overhead_ms not negative")
        if (self.head_ms is not None and self.head_ms < 0) or (self.gbit is not None and self.gbit <= 0):
            raise StagemeshError(f"host {self.name}: head_ms must not be negative and gbit must be positive")

    def head(self, model: ModelFacts) -> float:
        return self.head_ms if self.head_ms is not None else model.head_cost_in_layers * self.ms_per_layer

    def compute_ms(self, model: ModelFacts, layers: LayerRange) -> float:
        """One row's step of `layers` here, without the fixed overhead."""
        return len(layers) * self.ms_per_layer + (self.head(model) if layers.stop == model.num_layers else 0.0)

    def wire_ms(self, nbytes: int) -> float:
        """The time `nbytes` occupy the link to the next host."""
        return nbytes * 8 / (self.gbit * 1e9) * 1e3 if self.gbit else 0.0


@dataclass(frozen=True)
class Workload:
    """What the plan is for: streams decoding at once, each holding up to `context` positions of KV."""

    streams: int = 1
    context: int = 2048
    extra_row: float = 0.0  # each further row of a micro-batch adds this fraction of a one-row step (measured)

    def factor(self, rows: int) -> float:
        """A micro-batch of `rows` over one row's step time (linear in rows: the weights are read once a step)."""
        return 1.0 + self.extra_row * (rows - 1)


@dataclass(frozen=True)
class StageMemory:
    weights: int  # the file's bytes of the stage's tensors (a lean stage holds about that: docs/models.md)
    kv: int  # streams x context positions of its layers
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.runtime


def stage_memory(model: ModelFacts, layers: LayerRange, work: Workload) -> StageMemory:
    weights = sum(model.layer_bytes[layers.start:layers.stop])
    if layers.stop == model.num_layers:
        weights += model.head_bytes
    return StageMemory(weights, work.streams * work.context * len(layers) * model.kv_bytes_per_token_layer)


@dataclass(frozen=True)
class Plan:
    hosts: tuple[Host, ...]
    ranges: tuple[LayerRange, ...]  # one per host, contiguous, covering every layer
    memory: tuple[StageMemory, ...]
    stage_ms: tuple[float, ...]  # each stage's step for one row, its overhead included
    token_ms: float  # one stream: a token's time around the pipeline
    tokens_per_s: float  # one stream
    streams_tokens_per_s: float  # `work.streams` streams at once
    bottleneck: str  # what bounds the N-stream throughput: a stage, a link, the gateway or the latency of a cycle
    work: Workload

    def as_dict(self) -> dict:
        return {"stages": [{"host": h.name, "layers": str(r), "memory_bytes": m.total, "weights_bytes": m.weights,
                            "kv_bytes": m.kv, "runtime_bytes": m.runtime, "host_memory_bytes": h.memory,
                            "step_ms": round(t, 3)}
                           for h, r, m, t in zip(self.hosts, self.ranges, self.memory, self.stage_ms)],
                "token_ms": round(self.token_ms, 3), "tokens_per_s": round(self.tokens_per_s, 2),
                "streams": self.work.streams, "streams_tokens_per_s": round(self.streams_tokens_per_s, 2),
                "bottleneck": self.bottleneck}


def hop_bytes(model: ModelFacts, rows: int) -> int:
    """A stage-to-stage message: hidden [rows, D] in float32 and its header."""
    return rows * model.hidden_size * ACTIVATION_ITEMSIZE + HEADER_BYTES


def _cycle(model: ModelFacts, hosts: tuple[Host, ...], ranges: tuple[LayerRange, ...], rows: int,
           factor: float) -> tuple[list[float], list[float], float]:
    """(each stage's step, each link's time on the wire, the cycle) for a micro-batch of `rows` rows, in ms."""
    stages = [h.overhead_ms + factor * h.compute_ms(model, r) for h, r in zip(hosts, ranges)]
    # the gateway's token ids to stage 0 (local), each stage's hidden to the next, the last stage's token ids back
    # over the last host's link; one host is all loopback
    nbytes = [hop_bytes(model, rows)] * (len(hosts) - 1) + [HEADER_BYTES + 8 * rows]
    wires = [h.wire_ms(n) if len(hosts) > 1 else 0.0 for h, n in zip(hosts, nbytes)]
    latency = sum(h.rtt_ms / 2 for h in hosts) if len(hosts) > 1 else 0.0
    cycle = GATEWAY_MS + sum(stages) + (len(hosts) + 1) * HOP_MS + latency + sum(wires)
    return stages, wires, cycle


def predict(model: ModelFacts, hosts: list[Host], ranges: list[LayerRange], work: Workload) -> Plan:
    """The memory and tok/s of serving `ranges` on `hosts` (one range per host, in order)."""
    hosts_t, ranges_t = tuple(hosts), tuple(ranges)
    stages1, _, token_ms = _cycle(model, hosts_t, ranges_t, 1, 1.0)
    m = min(len(hosts), work.streams)  # the gateway's micro-batches in flight: one per stage
    rows = math.ceil(work.streams / m)
    stages, wires, cycle = _cycle(model, hosts_t, ranges_t, rows, work.factor(rows))
    # [(ms a cycle holds the resource, its name)]: each of the m micro-batches passes every one once a cycle
    busy = [(cycle, "the latency of a cycle"), (m * GATEWAY_MS, "the gateway")]
    busy += [(m * t, f"stage {h.name}") for h, t in zip(hosts, stages)]
    busy += [(m * t, f"the link from {h.name}") for h, t in zip(hosts, wires)]
    period, what = max(busy, key=lambda x: x[0])
    return Plan(hosts_t, ranges_t, tuple(stage_memory(model, r, work) for r in ranges), tuple(stages1), token_ms,
                1e3 / token_ms, 1e3 * m * rows / period, what, work)


def plan(model: ModelFacts, hosts: list[Host], work: Workload) -> Plan:
    """The contiguous split over `hosts` (each serving at least one layer, in order) that minimises the slowest
    stage's step, then the sum of the steps (one stream's latency), with every stage within its host's memory;
    StagemeshError naming what does not fit otherwise."""
    if not hosts:
        raise StagemeshError("no hosts to plan for; give at least one --host")
    n_layers, n_hosts = model.num_layers, len(hosts)
    if n_hosts > n_layers:
        raise StagemeshError(f"{n_hosts} hosts for {n_layers} layers: every host serves at least one layer; "
                             f"give at most {n_layers} hosts")

    def cost(h: int, a: int, b: int) -> tuple[float, float] | None:  # (max, sum) of host h serving a:b; None: no fit
        r = LayerRange(a, b)
        if stage_memory(model, r, work).total > hosts[h].memory:
            return None
        t = hosts[h].overhead_ms + hosts[h].compute_ms(model, r)
        return t, t

    # best[h][b]: the best (max, sum) and split points of layers 0:b on hosts 0..h
    best: list[dict[int, tuple[tuple[float, float], list[int]]]] = [{} for _ in range(n_hosts)]
    for b in range(1, n_layers - n_hosts + 2):
        if (c := cost(0, 0, b)) is not None:
            best[0][b] = (c, [b])
    for h in range(1, n_hosts):
        for b in range(h + 1, n_layers - n_hosts + h + 2):
            options = []
            for a, (prev, cuts) in best[h - 1].items():
                if a < b and (c := cost(h, a, b)) is not None:
                    options.append(((max(prev[0], c[0]), prev[1] + c[1]), cuts + [b]))
            if options:
                best[h][b] = min(options, key=lambda o: o[0])
    if n_layers not in best[-1]:
        raise StagemeshError(_why_not(model, hosts, work))
    cuts = best[-1][n_layers][1]
    return predict(model, hosts, [LayerRange(a, b) for a, b in zip([0, *cuts], cuts)], work)


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _why_not(model: ModelFacts, hosts: list[Host], work: Workload) -> str:
    """Why no split fits: the stages over their host's memory in the split by speed alone (memory ignored)."""
    free = ModelFacts(model.name, model.layer_bytes, model.head_bytes, model.hidden_size, 0, model.head_cost_in_layers)
    roomy = [Host(h.name, 1 << 62, h.ms_per_layer, h.head_ms, h.rtt_ms, h.gbit, h.overhead_ms) for h in hosts]
    ranges = plan(free, roomy, Workload(1, 1)).ranges
    over = []
    for h, r in zip(hosts, ranges):
        m = stage_memory(model, r, work)
        if m.total > h.memory:
            over.append(f"host {h.name} has {gib(h.memory)}; layers {r} need {gib(m.total)} ({gib(m.weights)} "
                        f"weights, {gib(m.kv)} KV, {gib(m.runtime)} runtime)")
    need = sum(stage_memory(model, r, work).total for r in ranges)
    return ("; ".join(over) + f". In all the model needs {gib(need)} on {len(hosts)} host(s), which have "
            f"{gib(sum(h.memory for h in hosts))}: add memory or a host, or plan for fewer --streams or a shorter "
            "--context")


# ---- re-splitting a mesh at work by its measured times (`stagemesh rebalance`, the gateway's --auto-rebalance) -------

UNBOUNDED = 1 << 62  # memory: the stages' own budgets are not measured here; the split is by time alone
MIN_MICROBATCHES = 8  # a window with fewer is no measurement


@dataclass(frozen=True)
class StageTime:
    """One stage's share of the window: its layers and busy milliseconds per micro-batch."""

    layers: LayerRange
    ms_per_microbatch: float
    head_ms: float | None = None  # the last stage's norm + lm_head within it, where timed apart (--split auto)

    @classmethod
    def measured(cls, layers: LayerRange, microbatches: int, busy_s: float, head_s: float = 0.0,
                 cpu_s: float = 0.0, cpu_limit: float = 0.0) -> StageTime:
        """A stage's window from its counters' growth over it: `microbatches` passed, `busy_s` computing them (of
        which `head_s` its head's), `cpu_s` of CPU time its process used (every thread: the compute's and the
        transport's), `cpu_limit` the cores its cgroup may use (0: no limit). A stage under a CPU limit runs only as
        fast as its CPU time over that limit allows, a time its busy seconds do not show (it stalls for the rest of
        each period, computing or not): its time per micro-batch is the larger of the two, its head scaled alike."""
        ms = 1e3 * busy_s / microbatches
        limited = 1e3 * cpu_s / cpu_limit / microbatches if cpu_limit > 0 else 0.0
        scale = limited / ms if ms > 0 and limited > ms else 1.0
        return cls(layers, ms * scale, 1e3 * head_s / microbatches * scale if head_s > 0 else None)


def hosts_from(model: ModelFacts, times: list[StageTime], memory: list[int] | None = None) -> list[Host]:
    """Each stage's host with the ms per layer its window measured (the last one's head in layer units), and the
    memory it may hold (None: unbounded, the split by time alone)."""
    hosts = []
    for i, t in enumerate(times):
        room = memory[i] if memory is not None else UNBOUNDED
        last = t.layers.stop == model.num_layers
        if last and t.head_ms is not None:  # the head timed apart: the layers are the rest
            hosts.append(Host(f"stage {i}", room, max((t.ms_per_microbatch - t.head_ms) / len(t.layers), 1e-6),
                              head_ms=t.head_ms, overhead_ms=0.0))
            continue
        blocks = len(t.layers) + (model.head_cost_in_layers if last else 0.0)
        hosts.append(Host(f"stage {i}", room, max(t.ms_per_microbatch / blocks, 1e-6), overhead_ms=0.0))
    return hosts


def proposal(model: ModelFacts, times: list[StageTime], streams: int, free_bytes: list[int] | None = None) -> dict:
    """The measured speeds, the split proposed and the predicted gain (JSON-able). free_bytes: what each stage's
    host has free beyond what it holds now (None: memory unbounded); a stage gains layers only within it
    (StagemeshError from plan() when no split fits)."""
    work = Workload(streams=streams)
    memory = None if free_bytes is None else [stage_memory(model, t.layers, work).total + free
                                             for t, free in zip(times, free_bytes)]
    hosts = hosts_from(model, times, memory)
    now = predict(model, hosts, [t.layers for t in times], work)
    best = plan(model, hosts, work)
    if max(best.stage_ms) >= max(now.stage_ms):  # no better split: keep the one running
        best = now
    return {
        "stages": [{"stage": i, "layers": str(t.layers), "ms_per_microbatch": round(t.ms_per_microbatch, 3),
                    "ms_per_layer": round(h.ms_per_layer, 4), "proposed_layers": str(r),
                    "predicted_ms_now": round(a, 3), "predicted_ms_proposed": round(b, 3)}
                   for i, (t, h, r, a, b) in enumerate(zip(times, hosts, best.ranges, now.stage_ms, best.stage_ms))],
        "split_now": ",".join(str(t.layers.stop) for t in times[:-1]),
        "split_proposed": ",".join(str(r.stop) for r in best.ranges[:-1]),
        "slowest_stage_ms_now": round(max(now.stage_ms), 3), "slowest_stage_ms_proposed": round(max(best.stage_ms), 3),
        "predicted_gain": round(max(now.stage_ms) / max(best.stage_ms), 3),
        "streams": streams,
    }
