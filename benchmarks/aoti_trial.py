"""AOTInductor trial (issue 53, item 8): the one-sequence decode step as the stage packages it (shared.models.aoti_decode:
exported with torch.export, the context length and the slot dynamic, the weights inputs; compiled with
aoti_compile_and_package, loaded with aoti_load_package), against the step torch.compile makes (inductor, called
without dynamo: compiled_decode.DirectCall) and the eager step.

    .venv/bin/python -m benchmarks.aoti_trial [--max-seq-len 2048] [--contexts 64,1024] [--rounds 7] [--steps 30]

What it packages is aoti_decode.build's, the stage's own code (no copy of it here); the checks below make sure the
loaded package writes the caller's cache tensors in place (the row at the step's position, nothing else) and agrees
with the DirectCall step and the eager step, beside the package's own check against the eager step.

Timing: one process, the same model and KV cache; each round runs --steps decode steps (one sequence, positions
context..context+steps-1), every path at each step in turn, in an order rotated each round (the machine is shared: a
neighbour's burst then hits every path alike); a path's round figure is its median ms per step, the reported figure
the median (and the fastest) over rounds, and its ratio the median over all steps of its time over DirectCall's at
the same step. The
inductor cache is a fresh directory, so the compile seconds are cold; a restart is then measured in subprocesses
(model load + aoti_decode.load, or model load + torch.compile from the now-warm inductor cache) up to the first
compiled step. The one-sequence graph only: the stage's batched graph is left out of both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

T_START = time.perf_counter()

import torch  # noqa: E402

from services.testing.harness import Report  # noqa: E402
from shared.batch.layout import BatchLayout  # noqa: E402
from shared.batch.steps import Decode  # noqa: E402
from shared.files.gguf_loader import GgufLoader  # noqa: E402
from shared.files.model_registry import resolve_model  # noqa: E402
from shared.models import aoti_decode  # noqa: E402
from shared.models.compiled_decode import CompiledDecode  # noqa: E402
from shared.models.device import resolve_dtype  # noqa: E402
from shared.runtime.stage_runtime import StageRuntime  # noqa: E402

SLOTS = 4


def first_lines(e: BaseException, n: int = 4) -> str:
    return " | ".join(f"{type(e).__name__}: {e}".strip().splitlines()[:n])[:600]


def load_piece(model: str, max_seq_len: int):
    """The whole model as one stage loads it by default (weights auto, the default dtype), a KV cache with the
    scratch row CompiledDecode needs, and the package's key (aoti_decode.package_key) for them."""
    loader = GgufLoader(resolve_model(model))
    rt = StageRuntime.load(loader, None, resolve_dtype(None), kv_slots=SLOTS, max_seq_len=max_seq_len,
                           compile_decode="off", weights="auto")
    kv = rt.model.new_kv_cache(SLOTS, max_seq_len, scratch=True)
    return rt.model, kv, aoti_decode.package_key(rt.model, kv, torch.get_num_threads(), loader.fingerprint)


def compiled_decode(model, kv) -> tuple[CompiledDecode, float]:
    """The stage's compiled step (one-sequence graph only), warmed up; its compile seconds."""
    compiled = CompiledDecode(model, kv)
    compiled._batched = None  # the batched graph is not part of this trial
    t = time.perf_counter()
    compiled.warm_up()
    return compiled, time.perf_counter() - t


def step_fns(model, kv, compiled, package) -> dict:
    def eager(hidden, layout, pos):
        return model.forward(hidden, layout, kv)

    def direct(hidden, layout, pos):
        out = compiled.forward(hidden, layout)
        assert out is not None, "the compiled step declined"
        return out

    fns = {"eager": eager, "directcall": direct}
    if package is not None:
        fns["aoti"] = package  # an aoti_decode.PackagedStep: (hidden, layout, pos) -> [1, D]
    return fns


@torch.inference_mode()
def check(model, kv, fns: dict, cases: list[tuple[int, int]]) -> list[dict]:
    """Each case (slot, pos): every path runs the same step from the same cache; its output and the K/V it wrote
    (row `slot`, position `pos`, every layer) are compared with DirectCall's, and the rest of the slot's row and the
    next row must be unchanged (in place, nothing else written)."""
    rows = []
    gen = torch.Generator().manual_seed(1)
    for slot, pos in cases:
        other = (slot + 1) % kv.k[0].shape[0]
        for t in [*kv.k, *kv.v]:
            t[slot, :, :pos].normal_(generator=gen)
        hidden = torch.randn(1, model.config.hidden_size, generator=gen)
        layout = BatchLayout.build([slot], [Decode(pos)], kv.max_seq_len)
        got = {}
        for name, fn in fns.items():
            for t in [*kv.k, *kv.v]:
                t[slot, :, pos].fill_(float("nan"))  # a row the step must write
            before = [t[[slot, other]].clone() for t in [*kv.k, *kv.v]]
            out = fn(hidden, layout, pos).clone()
            written = torch.stack([t[slot, :, pos].clone() for t in [*kv.k, *kv.v]])
            untouched = all(torch.equal(t[slot, :, :pos], b[0, :, :pos]) and torch.equal(t[slot, :, pos + 1:], b[0, :, pos + 1:])
                            and torch.equal(t[other], b[1]) for t, b in zip([*kv.k, *kv.v], before))
            got[name] = (out, written, untouched)
        ref_out, ref_kv, _ = got["directcall"]
        for name, (out, written, untouched) in got.items():
            rows.append({"slot": slot, "pos": pos, "path": name, "kv_written": bool(not written.isnan().any()),
                         "rest_untouched": untouched,
                         "out_max_abs_diff_vs_directcall": float((out - ref_out).abs().max()),
                         "out_max_abs": float(ref_out.abs().max()),
                         "kv_max_abs_diff_vs_directcall": float((written - ref_kv).abs().max())})
    return rows


@torch.inference_mode()
def time_paths(model, kv, fns: dict, context: int, rounds: int, steps: int, slot: int = 0) -> dict:
    gen = torch.Generator().manual_seed(2)
    for t in [*kv.k, *kv.v]:
        t[slot, :, :context].normal_(generator=gen)
    hiddens = [torch.randn(1, model.config.hidden_size, generator=gen) for _ in range(steps)]
    layouts = [BatchLayout.build([slot], [Decode(context + k)], kv.max_seq_len) for k in range(steps)]
    names = list(fns)
    per_round = {n: [] for n in names}
    ratios = {n: [] for n in names}  # per step: the path's time over DirectCall's at the same step
    for n in names:  # warm-up: first calls at a shape pay one-off costs
        for k in range(3):
            fns[n](hiddens[k], layouts[k], context + k)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times = {n: [] for n in names}
        for k in range(steps):  # the paths alternate step by step: a neighbour's burst hits them alike
            for n in order:  # each rewrites the same K/V row with the same numbers (the checks: bit for bit)
                t = time.perf_counter()
                fns[n](hiddens[k], layouts[k], context + k)
                times[n].append(time.perf_counter() - t)
        for n in names:
            per_round[n].append(1e3 * statistics.median(times[n]))
            ratios[n] += [a / b for a, b in zip(times[n], times["directcall"])]
    out = {"context": context, "per_round_ms": per_round,
           "median_ms": {n: statistics.median(v) for n, v in per_round.items()},
           "min_ms": {n: min(v) for n, v in per_round.items()},
           "ratio_vs_directcall": {n: statistics.median(v) for n, v in ratios.items()}}
    return out


def restart(kind: str, model: str, max_seq_len: int, package_path: str | None) -> None:
    """A fresh process's way to its first compiled step: the model load, then aoti_decode.load or torch.compile (the
    inductor cache warm); one JSON line of seconds."""
    t_imports = time.perf_counter() - T_START
    t = time.perf_counter()
    m, kv, key = load_piece(model, max_seq_len)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    if kind == "aoti":
        step = aoti_decode.load(package_path, m, kv, key)
    else:
        compiled, _ = compiled_decode(m, kv)
        step = step_fns(m, kv, compiled, None)["directcall"]
    ready_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        step(torch.randn(1, m.config.hidden_size), BatchLayout.build([0], [Decode(10)], kv.max_seq_len), 10)
    first_s = time.perf_counter() - t
    print(json.dumps({"kind": kind, "imports_s": t_imports, "model_load_s": load_s, "package_load_or_compile_s": ready_s,
                      "first_step_s": first_s, "to_first_compiled_step_s": time.perf_counter() - T_START}))


def run_restart(kind: str, args, package_path: str | None, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.aoti_trial", "--restart", kind, "--model", args.model,
           "--max-seq-len", str(args.max_seq_len)] + (["--package", package_path] if package_path else [])
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - t
    if p.returncode:
        return {"kind": kind, "error": p.stderr.strip().splitlines()[-3:]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV cache length (the stage's default)")
    p.add_argument("--contexts", default="64,1024")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--restart", choices=("aoti", "compile"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--package", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.restart:
        restart(args.restart, args.model, args.max_seq_len, args.package)
        return

    cache = tempfile.mkdtemp(prefix="aoti-trial-inductor-")  # cold: compile seconds from nothing
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    work = tempfile.mkdtemp(prefix="aoti-trial-")
    report = Report("aoti-trial", args.out)  # default: benchmarks/results/<date>-aoti-trial
    res: dict = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
                 "cpu": platform.processor() or platform.machine(), "model": args.model, "max_seq_len": args.max_seq_len,
                 "kv_slots": SLOTS, "rounds": args.rounds, "steps": args.steps}
    t = time.perf_counter()
    model, kv, key = load_piece(args.model, args.max_seq_len)
    res["model_load_s"] = time.perf_counter() - t
    res["dtype"] = str(model.dtype).removeprefix("torch.")
    res["matmul_kind"] = model.blocks[0].qkv.kind
    report.say(f"AOTInductor trial: {args.model} ({len(model.blocks)} layers, {res['dtype']}, weights {res['matmul_kind']}),"
               f" torch {torch.__version__}, {torch.get_num_threads()} threads, KV {SLOTS}+1 rows x {args.max_seq_len}")

    # 1. the stage's package: export, AOTI compile and package, load (aoti_decode.build), its own check
    package, package_path = None, os.path.join(work, "decode_one.pt2")
    try:
        package = aoti_decode.build(package_path, model, kv, key)
        res["aoti_build_s"] = package.seconds
        res["package_mb"] = os.path.getsize(package_path) / 2**20
        t = time.perf_counter()
        aoti_decode.load(package_path, model, kv, key)
        res["aoti_load_s"] = time.perf_counter() - t
        package.check()
        res["package_exact_vs_eager"] = package.exact
    except Exception as e:
        res["aoti_error"] = first_lines(e)
        traceback.print_exc()
    report.say(f"aoti_decode.build (export, aoti_compile_and_package, load) {res.get('aoti_build_s', float('nan')):.1f} s, "
               f"package {res.get('package_mb', 0):.1f} MB, aoti_decode.load {res.get('aoti_load_s', float('nan')):.2f} s, "
               f"bit for bit the eager step: {res.get('package_exact_vs_eager')}"
               + (f"; FAILED: {res['aoti_error']}" if "aoti_error" in res else ""))

    # 2. the stage's compiled step
    compiled, res["torch_compile_s"] = compiled_decode(model, kv)
    res["directcall_bound"] = ("one", torch.get_num_threads()) in compiled._direct
    report.say(f"torch.compile (one-sequence graph, cold cache) {res['torch_compile_s']:.1f} s, DirectCall bound: "
               f"{res['directcall_bound']} {compiled.direct_reason or ''}")
    fns = step_fns(model, kv, compiled, package)

    # 3. in place and equal
    last = kv.max_seq_len - 2
    res["checks"] = check(model, kv, fns, [(0, 1), (2, 63), (kv.scratch_slot, min(700, last - 1)), (SLOTS - 1, last)])
    report.say("checks (slot, pos): path kv_written rest_untouched out_diff/out_max kv_diff, against DirectCall")
    for r in res["checks"]:
        report.say(f"  ({r['slot']}, {r['pos']:>4}) {r['path']:<11} {r['kv_written']!s:<5} {r['rest_untouched']!s:<5} "
                   f"{r['out_max_abs_diff_vs_directcall']:.2e}/{r['out_max_abs']:.0f} {r['kv_max_abs_diff_vs_directcall']:.2e}")

    # 4. timing, paired
    res["timing"] = []
    for context in (int(c) for c in args.contexts.split(",")):
        tm = time_paths(model, kv, fns, context, args.rounds, args.steps)
        res["timing"].append(tm)
    names = list(fns)
    report.say(f"ms per decode step (median over {args.rounds} rounds of each round's median of {args.steps} steps; "
               "ratio: median per-step ratio to DirectCall)")
    report.say(f"{'context':>8}" + "".join(f"{n:>20}" for n in names))
    for tm in res["timing"]:
        report.say(f"{tm['context']:>8}" + "".join(f"{tm['median_ms'][n]:>11.2f} ({tm['ratio_vs_directcall'][n]:.2f}x)"
                                                    for n in names))
        report.say(f"{'fastest':>8}" + "".join(f"{tm['min_ms'][n]:>20.2f}" for n in names))

    # 5. restart: a fresh process to its first compiled step
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res["restart"] = []
    for _ in range(2):  # alternating, twice each
        res["restart"].append(run_restart("compile", args, None, env))
        if package is not None:
            res["restart"].append(run_restart("aoti", args, package_path, env))
    for r in res["restart"]:
        if "error" in r:
            report.say(f"restart {r['kind']}: FAILED {r['error']}")
            continue
        report.say(f"restart {r['kind']:<8}: imports {r['imports_s']:.1f} s, model load {r['model_load_s']:.1f} s, "
                   f"{'aoti_decode.load' if r['kind'] == 'aoti' else 'torch.compile (warm cache)'} "
                   f"{r['package_load_or_compile_s']:.2f} s, first step {r['first_step_s']:.2f} s; process "
                   f"{r['process_wall_s']:.1f} s")
    report.write(res)


if __name__ == "__main__":
    main()
