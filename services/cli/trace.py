"""`stagemesh trace`: pin where a deployment diverges from a reference, layer by layer and step by step (its flags,
and what REF and TARGET can be: services/cli/flags.py)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import torch
from rich.console import Console
from rich.table import Table

from services.gateway.config import API_KEY_ENV
from shared.errors import StagemeshError
from shared.files.layers import parse_split
from shared.models.device import DTYPES
from shared.runtime.model_files import ModelFiles
from shared.runtime.stage_runtime import LocalPipeline
from shared.runtime.trace import TraceRecorder, TraceResult, compare_captures, trace_local


def run_spec(spec: str, files: ModelFiles, prompt: str, steps: int) -> TraceRecorder:
    if spec.startswith(("http://", "https://")):
        return trace_gateway(spec, prompt, steps)
    if not spec.startswith("local"):
        raise StagemeshError(f"run {spec!r} must be local[:DTYPE][@SPLIT] or a gateway http:// URL")
    rest = spec[len("local"):]
    split = None
    if "@" in rest:
        rest, split = rest.split("@", 1)
    dtype = rest.lstrip(":") or "float32"
    if dtype not in DTYPES:
        raise StagemeshError(f"dtype {dtype!r} in {spec!r} is not one of {', '.join(DTYPES)}")
    ranges = parse_split(split, files.config.num_layers) if split else None
    pipeline = LocalPipeline.load(files.loader, ranges, DTYPES[dtype], kv_slots=1)
    return trace_local(pipeline, files.tokenizer.encode(prompt), steps)  # the gateway's prefill chunk: positions align


def trace_gateway(url: str, prompt: str, steps: int) -> TraceRecorder:
    """One traced greedy completion through a gateway started with --allow-trace (the API key from
    STAGEMESH_API_KEY when set)."""
    body = json.dumps({"prompt": prompt, "max_tokens": steps + 1, "temperature": 0, "ignore_eos": True,
                       "trace": True}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:  # the gateway's error says why (e.g. trace off: --allow-trace)
        try:
            why = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = str(e)
        raise StagemeshError(f"tracing through {url} failed: HTTP {e.code}: {why}") from None
    except OSError as e:
        raise StagemeshError(f"tracing through {url} failed: {e}") from None
    trace = answer.get("trace")
    if not trace:
        raise StagemeshError(f"{url} returned no trace; is it a stagemesh gateway?")
    if trace.get("truncated"):
        raise StagemeshError(f"{url} stopped the trace at its --trace-budget; trace fewer --steps or a shorter prompt, "
                             "or raise the gateway's --trace-budget")
    return TraceRecorder.from_json(trace)


def print_table(result: TraceResult, show_all: bool) -> None:
    console = Console() if Console().is_terminal else Console(width=120)
    table = Table(title=f"{result.baseline} vs {result.target} (threshold {result.threshold:g})")
    for col, justify in (("step", "right"), ("layer", "right"), ("at", "left"), ("stage", "left"), ("max |Δ|", "right"),
                         ("mean |Δ|", "right"), ("cosine", "right"), ("", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    steps_with_diff = {c.step for c in result.comparisons if c.max_abs_diff or c.problem}
    for c in result.comparisons:
        if not show_all and c.step not in steps_with_diff and c is not result.first_divergence:
            continue
        fmt = lambda v: "–" if v is None else f"{v:.2e}"  # noqa: E731
        flag = "[red]◀ first[/red]" if c is result.first_divergence else ("[yellow]![/yellow]" if c.exceeds else "")
        stage = (c.stage_target or c.stage_baseline or "?").removeprefix("stage")
        table.add_row(str(c.step), str(c.layer), "out" if c.point == "layer_output" else "in", stage,
                      fmt(c.max_abs_diff), fmt(c.mean_abs_diff), "–" if c.cosine is None else f"{c.cosine:.6f}",
                      c.problem or flag)
    console.print(table)
    if result.first_divergence is None:
        console.print(f"[green]no difference above {result.threshold:g} at any layer or step[/green]")
    else:
        d = result.first_divergence
        console.print(f"first divergence: step {d.step}, layer {d.layer} ({d.point}) on {d.stage_target}: "
                      f"max |Δ| {d.max_abs_diff:.3e}")
    tok = result.first_token_divergence
    console.print("generated tokens agree" if tok is None else f"generated tokens differ from token {tok}")


def cmd_trace(args) -> int:
    if args.steps < 0:
        raise StagemeshError("--steps must be >= 0")
    files = ModelFiles.open(args.model)
    torch.set_grad_enabled(False)
    if args.threads is not None:
        if args.threads < 1:
            raise StagemeshError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    base = run_spec(args.baseline, files, args.prompt, args.steps)
    target = run_spec(args.target, files, args.prompt, args.steps)
    result = compare_captures(base, target, args.threshold, args.baseline, args.target, args.prompt)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print_table(result, args.all)
    return 0
