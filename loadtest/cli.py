"""`stagemesh bench`: load-test stagemesh or any OpenAI-compatible server with the same code.

Arrivals: --request-rate R (gamma inter-arrivals, --burstiness 1 = Poisson; inf = all at once), --max-concurrency N
(alone: fixed concurrency), --ramp-up-seconds S (rate grows linearly over S seconds), --warmup N requests first.
Datasets: --dataset random (--input-len / --output-len / --range-ratio exact token lengths), sharegpt
(--dataset-path FILE), builtin (a small prompt set shipped with stagemesh).
Metrics (vLLM's definitions): TTFT = time to first streamed chunk; TPOT = (E2E - TTFT) / (output tokens - 1);
ITL = gaps between streamed chunks, pooled; E2EL = end-to-end latency; request/output/total token throughput per
second of the run; peak output tokens/s over 1-s bins; goodput = requests/s meeting every --goodput SLO."""

from __future__ import annotations

import asyncio
import json
import math
import os

from loadtest.bench import (
    SLO_KEYS,
    BenchConfig,
    compute_metrics,
    plot_run,
    plot_sweep,
    print_summary,
    run_benchmark,
    save_result,
)
from loadtest.client import BACKENDS
from loadtest.datasets import builtin_requests, random_requests, sharegpt_requests
from shared.config import GATEWAY_PORT
from shared.errors import StagemeshError


def register(sub) -> None:
    p = sub.add_parser("bench", help="load-test a server (stagemesh or any OpenAI-compatible one)", description=__doc__)
    p.add_argument("--base-url", default=f"http://127.0.0.1:{GATEWAY_PORT}",
                   help=f"server URL (default http://127.0.0.1:{GATEWAY_PORT})")
    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai (completions SSE), openai-chat (chat completions SSE), stagemesh-ws (websocket)")
    p.add_argument("--model", default="smollm2", help="model name sent in requests")
    p.add_argument("--tokenizer-model", default="smollm2", help="GGUF whose tokenizer sizes the prompts")
    p.add_argument("--dataset", choices=["random", "sharegpt", "builtin"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (with --dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length where supported")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--ramp-up-seconds", type=float, default=0.0, help="grow the request rate linearly over this time")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not measured) first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,95,99")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs like ttft:500 tpot:50 e2el:5000 (milliseconds)")
    p.add_argument("--save-result", default=None, help="write configuration and metrics to this JSON file")
    p.add_argument("--save-detailed", action="store_true", help="also write per-request arrays")
    p.add_argument("--plot", default=None, help="write PNGs (latency CDFs, timeline; sweep) into this directory")
    p.add_argument("--sweep-concurrency", default=None, help="run once per concurrency, e.g. 1,4,16, and plot")
    p.add_argument("--sweep-rate", default=None, help="run once per request rate, e.g. 1,2,4, and plot")
    p.add_argument("--label", default=None, help="name of this run in reports")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token, if the server needs one")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def _goodput(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1
        if key not in SLO_KEYS or ms <= 0:
            raise StagemeshError(f"--goodput {item!r} must be KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        out[key] = ms
    return out


def _numbers(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StagemeshError(f"{flag} {text!r} must be comma-separated numbers") from None


def cmd_bench(args) -> int:
    from shared.runtime.model_files import ModelFiles

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise StagemeshError("--num-prompts, --input-len and --output-len must be positive")
    if args.burstiness <= 0 or args.request_rate <= 0:
        raise StagemeshError("--burstiness and --request-rate must be positive")
    tok = ModelFiles.open(args.tokenizer_model).tokenizer
    if args.dataset == "random":
        reqs = random_requests(tok, args.num_prompts + args.warmup, args.input_len, args.output_len, args.range_ratio, args.seed)
    elif args.dataset == "sharegpt":
        if not args.dataset_path:
            raise StagemeshError("--dataset sharegpt needs --dataset-path FILE")
        reqs = sharegpt_requests(args.dataset_path, tok, args.num_prompts + args.warmup, args.seed, None)
    else:
        reqs = builtin_requests(tok, args.num_prompts + args.warmup, args.seed, args.output_len)
    cfg = BenchConfig(base_url=args.base_url, backend=args.backend, model=args.model, request_rate=args.request_rate,
                      burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      ramp_up_seconds=args.ramp_up_seconds, warmup=args.warmup, seed=args.seed,
                      ignore_eos=args.ignore_eos, eos_id=tok.eos_id, temperature=args.temperature,
                      percentiles=_numbers(args.percentiles, "--percentiles"), goodput=_goodput(args.goodput),
                      api_key=args.api_key, ready_timeout=args.ready_timeout)
    label = args.label or f"{args.backend} {args.base_url}"
    warm, measured = reqs[: args.warmup], reqs[args.warmup:]
    sweep_key, sweep = None, None
    if args.sweep_concurrency:
        sweep_key, sweep = "concurrency", _numbers(args.sweep_concurrency, "--sweep-concurrency")
    elif args.sweep_rate:
        sweep_key, sweep = "rate", _numbers(args.sweep_rate, "--sweep-rate")
    if sweep is None:
        run = asyncio.run(run_benchmark(cfg, warm + measured, progress=not args.quiet))
        metrics = compute_metrics(run, cfg)
        print_summary(metrics, cfg, label)
        if args.save_result:
            save_result(args.save_result, cfg, metrics, run, args.save_detailed)
        if args.plot:
            for path in plot_run(run, args.plot, label):
                print(f"wrote {path}")
        return 0
    points = []
    for value in sweep:
        if sweep_key == "concurrency":
            cfg.max_concurrency, cfg.request_rate = int(value), math.inf
        else:
            cfg.request_rate = value
        run = asyncio.run(run_benchmark(cfg, warm + measured, progress=not args.quiet))
        metrics = {**compute_metrics(run, cfg), "sweep_key": sweep_key, "sweep_value": value}
        print_summary(metrics, cfg, f"{label} ({sweep_key} {value:g})")
        points.append(metrics)
        if args.plot:
            plot_run(run, os.path.join(args.plot, f"{sweep_key}-{value:g}"), f"{label} ({sweep_key} {value:g})")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"label": label, "config": {**vars(cfg), "request_rate": str(cfg.request_rate)}, "points": points}, f,
                      indent=1)
    if args.plot:
        print(f"wrote {plot_sweep(points, args.plot, label, sweep_key)}")
    return 0
