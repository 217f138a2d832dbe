"""The flags of the commands in this package (up, generate, perplexity, tokenize, inspect, trace, plan), declared
without importing what runs them: each names its function as "module:function" (args.later), imported when the command
runs, so `--help` and a flag's error come before torch loads."""

from __future__ import annotations

import argparse
import os
import sys

from services.gateway.config import GatewayConfig
from services.process.args import (
    add_config_args,
    add_model_args,
    add_otlp_args,
    add_sampling_args,
    later,
)
from services.process.keys import add_join_token_arg, add_security_args
from shared.config import DTYPE_NAMES, GATEWAY_PORT, KV_DTYPE_NAMES, SchedulerConfig, StageConfig
from shared.files.model_registry import resolve_model

# the StageConfig fields `up` takes and passes on to every stage it starts (and threads_alone, which it defaults to
# the cores of one replica)
STAGE_FLAGS = ("kv_slots", "max_seq_len", "prefix_slots", "prefix_cache_memory")
HOST_FORM = "NAME:mem=8G[,cores=4,ms_per_layer=1.2,head_ms=5,overhead_ms=0.5,rtt_ms=1,gbit=1]"  # `plan --host`
TRACE_DESCRIPTION = """Pin where a deployment diverges from a reference, layer by layer and step by step.

REF and TARGET are each either an in-process run -- `local`, `local:bfloat16`, `local:float32@10,20` (dtype and
split points) -- or the URL of a running gateway started with --allow-trace (`http://127.0.0.1:8000`), traced through
a real request."""


def register(sub) -> None:
    register_local(sub)
    register_up(sub)
    register_trace(sub)
    register_plan(sub)
    register_rebalance(sub)


def register_local(sub) -> None:
    p = sub.add_parser("generate", help="generate text in one process", description="Stream generated text to stdout.")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message via the chat template")
    add_sampling_args(p)
    p.add_argument("--split", default=None, help="run the layers as range-limited pieces split at these layers, e.g. 7,19")
    p.add_argument("--json", action="store_true", help='print {"token_ids", "text", "timings"} instead of streaming')
    p.set_defaults(func=later("services.cli.local:cmd_generate", check=check_model))

    p = sub.add_parser("perplexity", help="perplexity of a text file",
                       description="Perplexity as llama.cpp's llama-perplexity computes it: the text is cut into "
                                   "consecutive chunks of --context tokens (at least 2 chunks; a shorter tail is "
                                   "dropped), each chunk starts with BOS when the model asks for BOS (it replaces the "
                                   "chunk's first token), and the second half of each chunk is scored given the "
                                   "tokens before it; perplexity = exp(mean NLL over all scored tokens).")
    add_model_args(p)
    p.add_argument("--file", required=True, help="UTF-8 text file")
    p.add_argument("--context", type=int, default=256, help="chunk length in tokens (default 256)")
    p.add_argument("--split", default=None, help="layer split points, e.g. 7,19 (must not change the result)")
    p.add_argument("--json", action="store_true", help='print {"perplexity", "nll_mean", "scored_tokens", "chunks"}')
    p.set_defaults(func=later("services.cli.local:cmd_perplexity", check=check_model))

    p = sub.add_parser("tokenize", help="print token ids of a text")
    add_model_args(p, dtype=False)
    p.add_argument("--special", action="store_true", help="parse special-token text such as <|im_start|>")
    p.add_argument("text", help="the text to tokenize")
    p.add_argument("--json", action="store_true", help='print {"ids": [...]}')
    p.set_defaults(func=later("services.cli.local:cmd_tokenize", check=check_model))

    p = sub.add_parser("inspect", help="describe a GGUF model")
    add_model_args(p, dtype=False)
    p.set_defaults(func=later("services.cli.local:cmd_inspect", check=check_model))


def register_up(sub) -> None:
    p = sub.add_parser("up", help="start a gateway and N stages on this machine",
                       description="Start N stage processes on loopback and a gateway in front of them.")
    add_model_args(p, serving=True)
    p.add_argument("--stages", type=int, default=None, help="number of stage processes per pipeline (default 2, or "
                                                            "what --split makes)")
    p.add_argument("--split", default=None, metavar="B1,B2,...|auto",
                   help="fixed layer boundaries, e.g. 7,19: the stages serve 0:7, 7:19 and 19:end (as `generate "
                        "--split`; `stagemesh rebalance --dry-run` proposes one from measurement); or auto: each "
                        "stage times its own layers at start (a few seconds; a throttled host shows its real speed) "
                        "and reports its free memory, and the gateway moves the mesh to the split that balances "
                        "those times before it reports ready (/v1/mesh and `status` show the split and the "
                        "prediction). Default: equal compute per stage, the lm_head counted")
    p.add_argument("--replicas", type=int, default=1,
                   help="pipelines of --stages stages each, behind the one gateway (default 1): requests are routed "
                        "by prefix cache, session and load, and move to another pipeline when one loses a stage")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="spare stage processes kept waiting on this host (default 0): each has imported the runtime "
                        "and opened the model, and takes the place of a stage that exits, so the pipeline waits "
                        "for that stage's layers to load rather than for a whole new process to start")
    p.add_argument("--port", type=_port, default=GATEWAY_PORT, help=f"gateway HTTP port (default {GATEWAY_PORT})")
    p.add_argument("--host", default="127.0.0.1", help="gateway HTTP host (default 127.0.0.1: loopback only)")
    add_config_args(p, StageConfig, only=STAGE_FLAGS + ("threads_alone",))
    p.add_argument("--log-dir", default=None, help="where stage logs go (default: a temporary directory)")
    add_config_args(p, SchedulerConfig)
    add_config_args(p, GatewayConfig)
    add_otlp_args(p)
    add_security_args(p, up=True)  # up makes ephemeral keys itself; only --insecure-plaintext is offered
    add_join_token_arg(p)
    p.set_defaults(func=later("services.cli.up:cmd_up"))
    p.error = _one_line_error(p.prog)  # a bad flag: one line, not argparse's page of usage


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _one_line_error(prog: str):
    def error(message: str):
        print(f"{prog}: error: {message} (see {prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    return error


def register_trace(sub) -> None:
    p = sub.add_parser("trace", help="compare two runs layer by layer", description=TRACE_DESCRIPTION)
    add_model_args(p, dtype=False)
    p.add_argument("--baseline", default="local:float32", help="local[:DTYPE][@SPLIT] or a gateway URL (default local:float32)")
    p.add_argument("--target", required=True, help="local[:DTYPE][@SPLIT] or a gateway URL")
    p.add_argument("--prompt", required=True, help="prompt text (plain completion, greedy)")
    p.add_argument("--steps", type=int, default=4, help="decode steps to trace after the prefill (default 4)")
    p.add_argument("--threshold", type=float, default=1e-3, help="max abs diff that counts as a divergence")
    p.add_argument("--json", action="store_true", help="print the TraceResult as JSON")
    p.add_argument("--all", action="store_true", help="show every layer, not only steps with a difference")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of local runs; float32 is bit-identical only at equal thread counts "
                        "(BLAS reduction order), so match the target's stages (their /info says)")
    p.set_defaults(func=later("services.cli.trace:cmd_trace"))


def register_rebalance(sub) -> None:
    p = sub.add_parser("rebalance", help="measure each stage of a running mesh and propose a balanced split",
                       description="Each stage's busy time per micro-batch over --window seconds of a mesh at work "
                                   "(every micro-batch passes every stage), its time per layer, the split that "
                                   "balances them (as `plan` splits hosts) and the gain predicted for it; without "
                                   "--dry-run the gateway moves the mesh to that split live (layers and their K/V "
                                   "move between neighbouring stages at a step boundary; no request fails).")
    p.add_argument("url", nargs="?", default=os.environ.get("STAGEMESH_URL", f"http://127.0.0.1:{GATEWAY_PORT}"),
                   help=f"the gateway (default $STAGEMESH_URL or http://127.0.0.1:{GATEWAY_PORT})")
    p.add_argument("--dry-run", action="store_true", help="print the measurement and the proposal, apply nothing")
    p.add_argument("--split", default=None, help="apply this split (layer boundaries, e.g. 18) live without measuring")
    p.add_argument("--replace", default=None, metavar="STAGE=URL",
                   help="have the stage process whose HTTP is at URL take stage STAGE's place (a stage that leaves or "
                        "died; start the new one with that stage's --layers, --stage-index and keys, on any host the "
                        "stages reach): its upstream neighbour sends to it from then on, running requests replay")
    p.add_argument("--model", default="smollm2", help="the alias or .gguf the stages serve (its layer count and head)")
    p.add_argument("--window", type=float, default=10.0, help="seconds to measure over (default 10)")
    p.add_argument("--streams", type=int, default=16, help="streams the predicted gain is for (default 16)")
    p.add_argument("--pipeline", type=int, default=0, help="which pipeline of --replicas (default 0)")
    p.add_argument("--json", action="store_true", help="print the proposal as JSON")
    p.set_defaults(func=later("services.cli.rebalance:cmd_rebalance", check=check_model))


def register_plan(sub) -> None:
    p = sub.add_parser("plan", help="plan a split over hosts and predict its tok/s before buying them",
                       description="From a model file and the hosts that would serve it (memory, measured ms per "
                                   "layer, link to the next host), the split that keeps the slowest stage fastest "
                                   "within each host's memory, each stage's memory, and the tok/s predicted at one "
                                   "and --streams streams, against the first host alone. A host without ms_per_layer "
                                   "is measured on this machine (eager decode steps of a few layers, with its cores "
                                   "as threads).")
    p.add_argument("--model", default="smollm2", help="alias (smollm2, gemma3-270m) or path to a .gguf file")
    p.add_argument("--host", action="append", default=[], metavar="SPEC", dest="hosts",
                   help=f"a host in pipeline order, repeatable: {HOST_FORM}. mem: memory for its stage; ms_per_layer: "
                        "one layer's decode step there (default: measured here with `cores` threads); rtt_ms, gbit: "
                        "the link to the next host (the last host's: back to the first, where the gateway runs; "
                        "default loopback)")
    p.add_argument("--streams", type=int, default=16, help="streams decoding at once for the N-stream figure and the "
                                                           "KV memory (default 16)")
    p.add_argument("--context", type=int, default=2048, help="tokens of KV each stream may hold (default 2048)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="the stages' compute dtype (default: this machine's, as a stage picks it: float32 "
                        "where the integer-dot kernels run, else bfloat16 where the CPU has it natively)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default=None,
                   help="the stages' K/V dtype (auto: float16 beside float32 activations, else theirs; default: the "
                        "compute dtype, as a stage keeps it)")
    p.add_argument("--batch-factor", type=float, default=None, metavar="F",
                   help="a decode step of --streams sequences over a step of one, as measured on the hosts (default: "
                        "measured here)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=later("services.cli.plan:cmd_plan"))


def check_model(args) -> None:
    """--model names an installed alias or an existing file: refused before torch loads when not."""
    resolve_model(args.model)
