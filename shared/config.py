"""The serving knobs, each written once: a frozen dataclass per process role, every field with its default, its help
and (through `knob`) how its command-line flag reads. `services/process/args.py` generates the flags of `stage`,
`gateway` and `up` from these fields (vLLM's EngineArgs idea), so a default or a help text lives only here.

- LoadConfig: how a model's layers are loaded and run (dtype, weights' kernels, memory budget, kernel plans,
  batch invariance, compiled decode): `stage`, `generate`, `up` (which forwards it to its stages).
- StageConfig: what one stage holds (KV capacity, slot lease, threads).
- SchedulerConfig: how the gateway batches, admits and recovers (services/gateway/engine/scheduler.py, pipeline.py).
- GatewayConfig (services/gateway/config.py): the gateway's HTTP edge and request defaults.

Flag naming: `--` + the field name in kebab case; a field in seconds ends in `_s`, which its flag drops
(`drain_timeout_s` -> `--drain-timeout SECONDS`); a field may name its flag itself (`allow_origins` ->
`--allow-origin`, repeatable). Validation is each class's `__post_init__`, whose errors name the flag, so a config
built in code is checked the same way as one built from a command line."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from shared.errors import StagemeshError

GATEWAY_PORT = 8000  # the gateway's HTTP port unless told otherwise (`up --port`, `gateway --listen`, clients' URLs)


def knob(default: Any, help: str, *, unit: str | None = None, unset: str | None = None, flag: str | None = None,
         repeatable: bool = False, parse: Any = None, metavar: str | None = None, choices: tuple[str, ...] = (),
         const: str | None = None) -> Any:
    """A config field that is a command-line flag.

    help: what it does, without its default (the flag's help appends it). unit: "seconds" or "bytes" (how the
    default is shown; "bytes" flags take 64M-style sizes). unset: what a None default means ("the number of
    stages"). flag: its flag when not derived from the name. repeatable: a tuple field given by repeating the flag.
    parse: the argparse type (default: the field's own type). choices: the values it takes. const: the value of
    the flag given alone (`--compile-decode` means on)."""
    meta = {"help": help, "unit": unit, "unset": unset, "flag": flag, "repeatable": repeatable, "parse": parse,
            "metavar": metavar, "choices": choices, "const": const}
    if repeatable:
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


def not_a_flag(reason: str, default: Any = MISSING) -> Any:
    """A config field the command sets itself (from another flag, the environment, or at run time): no flag."""
    return field(default=default, metadata={"help": reason, "not_a_flag": True})


def flag_of(f: Field) -> str | None:
    """The flag that sets field f (None: the command sets it itself)."""
    if f.metadata.get("not_a_flag"):
        return None
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    name = f.name.removesuffix("_s") if f.metadata.get("unit") == "seconds" else f.name
    return "--" + name.replace("_", "-")


def flag_for(config: Any, name: str) -> str:
    """The flag of field `name` of a config class or instance (for error messages)."""
    return flag_of(next(f for f in fields(config) if f.name == name)) or name


def check(config: Any, name: str, ok: bool, must: str) -> None:
    """Raise a StagemeshError naming the flag of `name` when not ok: '--kv-slots must be >= 1, got 0'."""
    if not ok:
        raise StagemeshError(f"{flag_for(config, name)} must be {must}, got {getattr(config, name)!r}")


def check_choice(config: Any, name: str, choices: tuple[str, ...], none_ok: bool = False) -> None:
    value = getattr(config, name)
    check(config, name, (value is None and none_ok) or value in choices, "one of " + ", ".join(choices))


def check_int(config: Any, name: str, low: int, none_ok: bool = False) -> None:
    value = getattr(config, name)
    if value is None and none_ok:
        return
    check(config, name, isinstance(value, int) and not isinstance(value, bool) and value >= low,
          f"an integer >= {low}")


def check_seconds(config: Any, name: str, low: float, strict: bool) -> None:
    value = getattr(config, name)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    check(config, name, number and (value > low if strict else value >= low),
          f"{'>' if strict else '>='} {low:g} seconds")


def check_address(addr: str, flag: str) -> str:
    """A ZeroMQ address as a flag gives it (--listen, --next, --result-listen), or a StagemeshError naming the flag."""
    if not (addr.startswith("tcp://") or addr.startswith("ipc://") or addr.startswith("inproc://")):
        raise StagemeshError(f"{flag} {addr!r} must be a ZeroMQ address such as tcp://127.0.0.1:5551 or ipc:///tmp/stage0")
    return addr


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1000000' -> bytes (binary units); ValueError naming the form otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size; give a positive number of bytes with an optional unit, e.g. 4G or 512M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # compute dtypes (shared.models.device.DTYPES: their torch dtypes)
KV_DTYPE_NAMES = ("auto", *DTYPE_NAMES)  # the K/V cache's (shared.models.device.resolve_kv_dtype)
WEIGHT_MODES = ("auto", "lean", "bf16", "f32")  # the matmul kernels a model's weights run on (shared.models.linear)
COMPILE_MODES = ("auto", "on", "off")  # when the decode graphs compile: in the background, before ready, never
SPECULATION_MODES = ("auto", "on", "off")  # the gateway's n-gram drafts (services/gateway/engine/speculator.py)
COMPILE_DECODE_ENV = "STAGEMESH_COMPILE_DECODE"  # the serving commands' --compile-decode default, when set


@dataclass(frozen=True)
class LoadConfig:
    """How a model's layers are loaded and run (`stage`, `generate`, `perplexity`; `up` forwards it to every stage it
    starts). The defaults are a one-off command's: the serving commands default --compile-decode to auto
    (serving_defaults)."""

    dtype: str | None = knob(None, "compute dtype", choices=DTYPE_NAMES,
                             unset="float32 where the integer-dot kernels run, else bfloat16 where the CPU/GPU "
                                   "multiplies it natively, else float32")
    kv_dtype: str | None = knob(None, "the K/V cache's dtype: auto is float16 where the activations are float32 (half "
                                      "the bytes a position, llama.cpp's default cache type; attention widens each "
                                      "value to float32 as it reads it), else the activations' dtype",
                                choices=KV_DTYPE_NAMES, unset="the activations' dtype")
    weights: str | None = knob(None, "matmul kernels: auto (every quantized type decodes from a kernel of about its "
                                     "stored size -- int4, two int4 planes, int8 rows -- and prefills from a dense "
                                     "copy, prepacked bf16 or f32 as timed at load, where --memory-budget holds it), "
                                     "lean (the quantized kernels only: memory about the file's share, slower "
                                     "prefill), bf16, f32 (exact reference)", choices=WEIGHT_MODES,
                               unset="f32 when --dtype float32 is given, else auto")
    memory_budget: int | None = knob(None, "bytes a stage's weights and KV cache may take, e.g. 4G: auto keeps its "
                                           "dense prefill copy only where it fits", unit="bytes", parse=parse_bytes,
                                     unset="80% of the memory available at load, shared by the stages `up` starts")
    kernel_plan: str | None = knob(None, "the kernel plans file: which kernels this machine measured fastest for each "
                                         "shape, read where it has them, measured and written where not (stages given "
                                         "one file pick the same kernels); off measures at every load",
                                   metavar="FILE|off",
                                   unset="$STAGEMESH_KERNEL_PLANS, else ~/.cache/stagemesh/kernel-plans.json")
    batch_invariant: bool = knob(False, "each sequence's numbers independent of what else is in its micro-batch "
                                        "(fixed kernels and reduction order): greedy output reproducible under any "
                                        "load; costs speed at large batches")
    compile_decode: str = knob("off", "the decode steps under torch.compile (faster per token; compiling takes "
                                      "minutes at the first start, seconds from inductor's cache after): auto compiles "
                                      "in the background while the stage already serves eagerly, where the model and "
                                      "weights allow it; on (the flag alone) compiles before the stage is ready and "
                                      "refuses what it does not cover (e.g. --batch-invariant); off never",
                               choices=COMPILE_MODES, const="on")

    def __post_init__(self):
        check_choice(self, "dtype", DTYPE_NAMES, none_ok=True)
        check_choice(self, "kv_dtype", KV_DTYPE_NAMES, none_ok=True)
        check_choice(self, "weights", WEIGHT_MODES, none_ok=True)
        check_int(self, "memory_budget", 1, none_ok=True)
        check(self, "kernel_plan", self.kernel_plan is None or (isinstance(self.kernel_plan, str) and self.kernel_plan),
              "a file path or off")
        check(self, "batch_invariant", isinstance(self.batch_invariant, bool), "on or off")
        check_choice(self, "compile_decode", COMPILE_MODES)

    @property
    def weights_mode(self) -> str | None:
        """The weights mode to load with: --weights; else auto when --dtype is left to its default (a CPU without
        native bf16 computes in float32 by default and still serves with the fast kernels); else None, which
        resolve_weights turns into f32 for an explicit --dtype float32 (the exact reference) and auto otherwise."""
        return self.weights or (None if self.dtype else "auto")


def serving_defaults(environ: dict[str, str]) -> dict[str, Any]:
    """LoadConfig defaults of a serving command (stage, up): compile in the background unless
    $STAGEMESH_COMPILE_DECODE says otherwise (a one-off generate would spend its run compiling)."""
    mode = environ.get(COMPILE_DECODE_ENV, "auto")
    if mode not in COMPILE_MODES:
        raise StagemeshError(f"{COMPILE_DECODE_ENV}={mode!r} must be one of {', '.join(COMPILE_MODES)}")
    return {"compile_decode": mode}


@dataclass(frozen=True)
class StageConfig:
    """One stage's serving knobs (`stage`; `up` passes its STAGE_FLAGS -- KV slots, length, prefix rows and bound --
    to each of its stages)."""

    kv_slots: int = knob(32, "concurrent sequences per stage")
    max_seq_len: int | None = knob(None, "tokens per sequence, capped by the model's context",
                                   unset="the model's trained context, as far as the memory budget holds one sequence "
                                         "of it beside the weights (said at start and in /info)")
    slot_lease_s: float = knob(120.0, "release a sequence's KV slot when no micro-batch has used it for this long, "
                                      "so a vanished gateway cannot hold slots forever (0 = never)", unit="seconds")
    prefix_slots: int = knob(64, "KV rows for cached prefixes beside the --kv-slots of live sequences: a finished "
                                 "sequence's K/V stays in one for later requests that share its prefix (the gateway's "
                                 "prefix cache), so a full stage still keeps them; they take memory only as written, "
                                 "within --prefix-cache-memory")
    prefix_cache_memory: int | None = knob(None, "K/V bytes this stage's cached prefixes may hold; keeping one past it "
                                                 "gives up the least recently used first (the gateway evicts by the "
                                                 "same bound)", unit="bytes", parse=parse_bytes,
                                           unset="a quarter of the memory available when the stage loads, at most "
                                                 "what the prefix rows can hold")
    threads: int | None = knob(None, "torch threads", unset="all cores; `up` divides them among its stages")
    threads_alone: int | None = knob(None, "torch threads for a micro-batch that is alone in the pipeline (the gateway "
                                           "had no other in flight, so the other stages are idle): stages sharing a "
                                           "host use the cores their idle neighbours leave",
                                     unset="--threads; `up` gives every stage all cores")

    def __post_init__(self):
        check_int(self, "kv_slots", 1)
        check_int(self, "max_seq_len", 16, none_ok=True)
        check_int(self, "prefix_slots", 0)
        check_int(self, "prefix_cache_memory", 1, none_ok=True)
        check_seconds(self, "slot_lease_s", 0, strict=False)
        check_int(self, "threads", 1, none_ok=True)
        check_int(self, "threads_alone", 1, none_ok=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """The gateway's scheduling knobs, per pipeline (`gateway`, `up`; services/gateway/engine/scheduler.py)."""

    max_inflight: int | None = knob(None, "micro-batches in flight at once", unset="the number of stages")
    max_queue: int = knob(256, "requests waiting for admission before 429")
    prefill_chunk: int = knob(128, "prompt tokens per prefill chunk: a long prompt delays running decodes by one "
                                   "chunk")
    token_budget: int = knob(512, "tokens per micro-batch (decodes count 1 each)")
    prefix_cache: bool = knob(True, "keep finished sequences' K/V on every stage and start later requests that share "
                                    "their prefix (a chat's history, a common system prompt) from it, in blocks of 16 "
                                    "tokens; kept prefixes use KV slots no request holds and give them up, least "
                                    "recently used first")
    prefix_cache_audit: float = knob(0.0, "check this share (0..1) of cache hits live: the gateway also runs the "
                                          "hit's prompt twice, one token each, from the cached prefix and computed in "
                                          "full, and compares the last stage's top logprobs; a mismatch is logged and "
                                          "counted (stagemesh_gateway_prefix_cache_audits_total; 0: off)",
                                     metavar="RATE")
    stall_timeout_s: float = knob(30.0, "a micro-batch not back after this long marks the pipeline not ready, "
                                        "naming the hop where it stopped, and its requests are replayed (far above "
                                        "any one micro-batch's compute)", unit="seconds")
    stage_poll_s: float = knob(2.0, "how often the gateway reads every stage's /info (health, incarnation, busy "
                                    "time): a dead or restarted stage is noticed within one period (below "
                                    "--stall-timeout, so a death is a failover before it looks like a stall)",
                               unit="seconds")
    failover_timeout_s: float = knob(120.0, "a pipeline not ready again after this long ends the requests it holds "
                                            "with an error naming the unreachable stage", unit="seconds")
    max_replays: int = knob(3, "times one request may be replayed after stage losses before it ends with an error")
    speculation: str = knob("auto", "n-gram drafts verified in each decode step (a request's own context and a "
                                    "pool of recent answers; several tokens a pass where they stand, the same "
                                    "tokens either way): auto (while few sequences run, as long as the measured "
                                    "cost of their rows pays), on (at any load and cost: to measure or test them), "
                                    "off (a request's `prediction` still drafts)", choices=SPECULATION_MODES)
    auto_rebalance: bool = knob(True, "re-split the pipeline live when its stages' measured times drift (a host "
                                       "slows, a co-tenant appears): over each --rebalance-window the gateway "
                                       "measures every stage's busy time per micro-batch, and when two windows in a "
                                       "row each predict at least --rebalance-gain and move the split the same way, "
                                       "layers and their K/V move between neighbouring stages with no request failing (as "
                                       "`stagemesh rebalance` does; a host that joins or leaves starts the "
                                       "measuring afresh); off: the split changes only when asked (a pinned split)")
    rebalance_window_s: float = knob(30.0, "--auto-rebalance's measuring window; it waits at least two after a "
                                           "re-split (or a refused one) before the next", unit="seconds")
    rebalance_gain: float = knob(1.15, "--auto-rebalance moves layers only for at least this predicted speed-up of "
                                       "the slowest stage (hysteresis: a split that is about as good stays)",
                                 metavar="RATIO")

    def __post_init__(self):
        check_int(self, "max_inflight", 1, none_ok=True)
        for name in ("max_queue", "prefill_chunk", "token_budget"):
            check_int(self, name, 1)
        check(self, "prefix_cache", isinstance(self.prefix_cache, bool), "on or off")
        share = self.prefix_cache_audit
        check(self, "prefix_cache_audit", isinstance(share, (int, float)) and 0.0 <= share <= 1.0,
              "a share within 0..1, e.g. 0.05 checks one cache hit in twenty")
        check_seconds(self, "stall_timeout_s", 0, strict=True)
        check_seconds(self, "stage_poll_s", 0, strict=True)
        check_seconds(self, "failover_timeout_s", 0, strict=True)
        check_int(self, "max_replays", 0)
        check_choice(self, "speculation", SPECULATION_MODES)
        check(self, "auto_rebalance", isinstance(self.auto_rebalance, bool), "on or off")
        check_seconds(self, "rebalance_window_s", 1, strict=False)
        check(self, "rebalance_gain", isinstance(self.rebalance_gain, (int, float)) and 1.0 <= self.rebalance_gain
              <= 10.0, "a ratio within 1..10, e.g. 1.15 moves layers for a 15 % faster slowest stage")


LOAD_DEFAULTS = LoadConfig()
STAGE_DEFAULTS = StageConfig()
SCHEDULER_DEFAULTS = SchedulerConfig()
