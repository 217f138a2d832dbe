"""Argument helpers shared by the `stagemesh` subcommands: every flag that more than one command takes is
declared here, once, with its default from shared.config where it has one."""

from __future__ import annotations

import argparse
import os

from services.gateway.config import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_KEEPALIVE_TIMEOUT_S, DEFAULT_STALL_S
from shared.config import SERVING_DEFAULTS, ServingConfig
from shared.device import DTYPES
from shared.errors import StagemeshError
from shared.models.compiled_decode import COMPILE_MODES
from shared.models.linear import WEIGHT_MODES
from shared.models.memory import default_budget, parse_bytes
from shared.otlp import otlp_endpoint, require_sdk
from shared.sampling import SamplingParams

COMPILE_DECODE_ENV = "STAGEMESH_COMPILE_DECODE"  # the serving commands' --compile-decode default, when set


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True, serving: bool = False) -> None:
    """serving: a command that serves (stage, up): --compile-decode defaults to auto (or $STAGEMESH_COMPILE_DECODE)
    there, to off elsewhere (a one-off generate would spend its run compiling)."""
    p.add_argument("--model", default="smollm2", help="alias (smollm2, gemma3-270m) or path to a .gguf file (default: smollm2)")
    if dtype:
        p.add_argument("--dtype", choices=list(DTYPES), default=None,
                       help="compute dtype (default: bfloat16 where the CPU/GPU supports it, else float32)")
        p.add_argument("--weights", choices=list(WEIGHT_MODES), default=None,
                       help="matmul kernels: auto (every quantized type decodes from a kernel of about its stored "
                            "size -- int4, two int4 planes, int8 rows -- and prefills from a dense copy, prepacked "
                            "bf16 or f32 as timed at load, where --memory-budget holds it), lean (the quantized "
                            "kernels only: memory about the file's share, slower prefill), bf16, f32 (exact "
                            "reference) (default: f32 when --dtype float32 is given, else auto)")
        p.add_argument("--memory-budget", type=_size, default=None, metavar="BYTES",
                       help="bytes a stage's weights and KV cache may take, e.g. 4G: auto keeps its dense prefill "
                            "copy only where it fits (default: 80%% of the memory available at load, shared by the "
                            "stages `up` starts)")
        p.add_argument("--batch-invariant", action="store_true",
                       help="each sequence's numbers independent of what else is in its micro-batch (fixed kernels "
                            "and reduction order): greedy output reproducible under any load; costs speed at large "
                            "batches")
        default = os.environ.get(COMPILE_DECODE_ENV, "auto") if serving else "off"
        if default not in COMPILE_MODES:
            raise StagemeshError(f"{COMPILE_DECODE_ENV}={default!r} must be one of {', '.join(COMPILE_MODES)}")
        p.add_argument("--compile-decode", nargs="?", const="on", choices=COMPILE_MODES, default=default,
                       help="one sequence's decode step under torch.compile (20-45%% faster per token on SmolLM2; "
                            "compiling takes ~3 min at the first start, seconds from inductor's cache after): auto "
                            "compiles in the background while the stage already serves eagerly, where the model and "
                            "weights allow it; on (the flag alone) compiles before the stage is ready and refuses what "
                            f"it does not cover (e.g. --batch-invariant); off never (default: {default})")


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def weights_from_args(args) -> str | None:
    """The weights mode a command loads with: --weights; else auto when --dtype is left to its default (a CPU without
    native bf16 computes in float32 by default and still serves with the fast kernels); else None, which
    resolve_weights turns into f32 for an explicit --dtype float32 (the exact reference) and auto otherwise."""
    return args.weights or (None if args.dtype else "auto")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_from_args(args) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise StagemeshError(str(e)) from None


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """A stage's KV capacity (`stage`, and `up` for each of its stages)."""
    d = SERVING_DEFAULTS
    p.add_argument("--kv-slots", type=int, default=d.kv_slots, help=f"concurrent sequences per stage (default {d.kv_slots})")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help=f"tokens per sequence (default {d.max_seq_len}, capped by the model's context)")


def _share(text: str) -> float:
    """A --prefix-cache-audit value: a number within 0..1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a share within 0..1, e.g. 0.05") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..1; e.g. 0.05 checks one cache hit in twenty")
    return value


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The gateway's scheduling knobs (`gateway`, `up`)."""
    d = SERVING_DEFAULTS
    p.add_argument("--max-inflight", type=int, default=None,
                   help="micro-batches in flight at once (default: the number of stages)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests waiting for admission before 429 (default {d.max_queue})")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help=f"prompt tokens per prefill chunk (default {d.prefill_chunk})")
    p.add_argument("--token-budget", type=int, default=d.token_budget,
                   help=f"tokens per micro-batch (default {d.token_budget})")
    p.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                   help="keep finished sequences' K/V on every stage and start later requests that share their prefix "
                        "(a chat's history, a common system prompt) from it, in blocks of 16 tokens; kept prefixes "
                        "use KV slots no request holds and give them up, least recently used first (default on)")
    p.add_argument("--prefix-cache-audit", type=_share, default=0.0, metavar="RATE",
                   help="check this share (0..1) of cache hits live: the gateway also runs the hit's prompt twice, one "
                        "token each, from the cached prefix and computed in full, and compares the last stage's top "
                        "logprobs; a mismatch is logged and counted (stagemesh_gateway_prefix_cache_audits_total; "
                        "default 0: off)")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_S, metavar="SECONDS",
                   help="a micro-batch not back after this long marks the pipeline not ready, naming the hop where it "
                        f"stopped, and its requests are replayed (default {DEFAULT_STALL_S:g})")


def stall_from_args(args) -> float:
    """--stall-timeout, checked: seconds > 0 (inf: never)."""
    if not args.stall_timeout > 0:
        raise StagemeshError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout:g}")
    return args.stall_timeout


def add_edge_args(p: argparse.ArgumentParser) -> None:
    """The gateway's HTTP edge: origin policy, /metrics access, timeouts, drain (`gateway`, `up`)."""
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of ORIGIN (e.g. https://app.example.com; repeatable; * = any) call the API "
                        "and the websocket; default: only pages the gateway serves itself")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host is NAME (repeatable; .example.com = that domain and every "
                        "name below it; * = any); default: IP addresses, localhost and the --listen/--host address "
                        "only, so a page on another name that resolves here (DNS rebinding) is refused with 403")
    p.add_argument("--allow-trace", action="store_true",
                   help="answer requests with \"trace\": true (every layer's activations of that request: an operator's "
                        "debugging tool, off by default; `stagemesh trace` needs it)")
    p.add_argument("--trace-budget", default="64M", metavar="BYTES",
                   help="activation bytes one traced request may collect (e.g. 16M); beyond it the trace stops and "
                        "says so (default 64M)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="require the API key (STAGEMESH_API_KEY) on /metrics too")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="SECONDS",
                   help=f"on SIGTERM, how long running requests may finish (default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="a request that leaves out max_tokens generates at most N tokens (default: until a stop or "
                        "the context is full, as OpenAI's API defines it)")
    p.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_TIMEOUT_S, metavar="SECONDS",
                   help="close a connection idle this long, or that has not sent its request headers within it "
                        f"(default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})")


def edge_from_args(args) -> dict:
    """GatewayConfig fields from add_edge_args' flags, validated."""
    origins = []
    for o in args.allow_origin:
        o = o.strip().lower().rstrip("/")
        if o != "*" and not (o.startswith(("http://", "https://")) and "/" not in o.split("://", 1)[1]):
            raise StagemeshError(f"--allow-origin {o!r} must be '*' or SCHEME://HOST[:PORT], "
                                 "e.g. https://app.example.com (no path)")
        origins.append(o)
    hosts = []
    for h in args.allow_host:
        h = h.strip().lower().rstrip(".")
        if not h or "/" in h or ":" in h:
            raise StagemeshError(f"--allow-host {h!r} must be a host name such as gateway.example.com, "
                                 ".example.com (a domain and the names below it) or * (no scheme, port or path)")
        hosts.append(h)
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise StagemeshError(f"--default-max-tokens must be a positive number of tokens, got {args.default_max_tokens}")
    if args.drain_timeout < 0 or args.keepalive_timeout <= 0:
        raise StagemeshError("--drain-timeout must be >= 0 and --keepalive-timeout > 0 (seconds)")
    try:
        trace_budget = parse_bytes(args.trace_budget)
    except ValueError as e:
        raise StagemeshError(f"--trace-budget: {e}") from None
    return {"allow_trace": args.allow_trace, "trace_budget": trace_budget, "allow_origins": tuple(origins),
            "allow_hosts": tuple(hosts), "metrics_require_key": args.metrics_require_key,
            "drain_timeout_s": args.drain_timeout, "keepalive_timeout_s": args.keepalive_timeout,
            "default_max_tokens": args.default_max_tokens}


def model_flags(args) -> list[str]:
    """The add_model_args flags of args as a stage command line wants them (what `up` forwards to its stages)."""
    flags = []
    if getattr(args, "dtype", None):
        flags += ["--dtype", args.dtype]
    if getattr(args, "weights", None):
        flags += ["--weights", args.weights]
    if getattr(args, "batch_invariant", False):
        flags.append("--batch-invariant")
    if getattr(args, "memory_budget", None) is not None or getattr(args, "stages", None):
        # up's stages load at once on one host: each gets its share of the default, fixed here
        budget = args.memory_budget if args.memory_budget is not None else default_budget(args.stages)
        flags += ["--memory-budget", str(budget)]
    if getattr(args, "compile_decode", None):
        flags += ["--compile-decode", args.compile_decode]
    return flags


def serving_from_args(args) -> ServingConfig:
    """The ServingConfig these arguments describe (flags a command lacks keep their defaults); validated."""
    d = SERVING_DEFAULTS
    return ServingConfig(**{name: getattr(args, name, getattr(d, name))
                            for name in ("prefill_chunk", "token_budget", "max_queue", "kv_slots", "max_seq_len")})


def add_otlp_args(p: argparse.ArgumentParser) -> None:
    """Optional distributed tracing (`gateway`, `stage`, `up`, which passes it to its stages)."""
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces (one per request, a span per micro-batch per stage) over "
                        "OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 (needs the otlp extra: from the "
                        "checkout, .venv/bin/pip install -e '.[otlp]'; default: off)")


def otlp_from_args(args) -> str | None:
    """The validated OTLP/HTTP traces URL of --otlp-endpoint (None: tracing off); checks that the SDK is installed."""
    if getattr(args, "otlp_endpoint", None) is None:
        return None
    url = otlp_endpoint(args.otlp_endpoint)
    require_sdk()
    return url


def parse_host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise StagemeshError(f"{flag} {text!r} must be HOST:PORT, e.g. 127.0.0.1:8101")
    return host.strip("[]"), int(port)
