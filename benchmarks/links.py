"""What a real link between stages costs: the gateway and 2 stages each in its own network namespace (the Kubernetes
manifests' command lines, services/testing/netns.py), every hop through a relay that adds half the RTT each way, every
host's link capped by `tc tbf`; measured interleaved against the same deployment with a zero-delay relay and no cap
(the calibration: what the relay itself costs is in both).

    python -m benchmarks.links [--model ALIAS_OR_GGUF] [--rtt-ms 1,2] [--rate 1gbit] [--streams 1,16] [--rounds 2]
        [--output-len 64] [--out DIR]

Per condition and streams level: output tok/s, mean time per output token (ITL), TTFT, the ratio to the calibration
in the same round, and the link's share of a token's time at one stream ((ITL - calibration ITL) / ITL). Per hop:
the activation bytes a token position sends (stage 0's bytes out over the token positions it sent). Writes
links.json and links.md into --out (default: a new benchmarks/results/<date>-links). Needs root (`ip netns`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

from services.testing.harness import add_out_arg, results_dir, scrape_metric, wait_compiled, write_results
from services.testing.k8s_render import config, container_args, render
from services.testing.netns import namespaces, netns_permitted, shape_links, start_pods
from shared.files.model_registry import resolve_model
from shared.wire.mesh_keys import write_key_set
from shared.wire.stage_info import StageInfo

SUBNET = "10.79.0"
HOSTS = {"gw": 10, "s0": 11, "s1": 12}
NAMES = {"gw": "stagemesh-gateway", "s0": "stagemesh-stage-0.stagemesh-stages", "s1": "stagemesh-stage-1.stagemesh-stages"}
PORTS = {"gw": [5599], "s0": [5550, 8101], "s1": [5550, 8101]}
TAG = "l"


def commands(model: str, log_dir: str) -> dict[str, list[str]]:
    """Each host's `stagemesh` arguments, from the cpu overlay's manifests."""
    docs = render("cpu")
    keys = os.path.join(log_dir, "mesh-keys")
    write_key_set(keys, 2)
    # both stages share this machine's cores: one torch thread each (more threads than cores spin against each other)
    cfg = {**config(docs), "MODEL": resolve_model(model), "THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    out = {f"s{i}": container_args(docs, "StatefulSet", "stagemesh-stage", {**cfg, "POD_INDEX": str(i)},
                                   {"stagemesh-keys": keys}) for i in range(2)}
    out["gw"] = container_args(docs, "Deployment", "stagemesh-gateway", cfg, {"stagemesh-keys": keys})
    return out


def stage_info(i: int) -> StageInfo:
    with urllib.request.urlopen(f"http://{SUBNET}.{HOSTS[f's{i}']}:8101/info", timeout=10) as r:
        return StageInfo.from_json(json.loads(r.read()))


def stage0_bytes_out() -> float:
    with urllib.request.urlopen(f"http://{SUBNET}.{HOSTS['s0']}:8101/metrics", timeout=10) as r:
        return scrape_metric(r.read().decode(), "stagemesh_stage_bytes_out_total")


def bench(url: str, streams: int, args, out: str, label: str) -> dict:
    result = os.path.join(out, f"{label}-c{streams}.json")
    subprocess.run([sys.executable, "-m", "services.cli", "bench", "--base-url", url, "--max-concurrency", str(streams),
                    "--num-prompts", str(max(args.min_prompts, 2 * streams)), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--ignore-eos", "--save-result", result, "--quiet",
                    "--warmup", "1"], check=True, stdout=subprocess.DEVNULL)
    return json.load(open(result))


def conditions(args) -> list[tuple[str, float, str | None]]:
    """(label, one-way delay in seconds, tbf rate or None): the calibration first."""
    return [("relay 0 ms, no cap", 0.0, None)] + [
        (f"{args.rate}, {rtt:g} ms RTT", rtt / 2000, args.rate) for rtt in (float(r) for r in args.rtt_ms.split(","))]


def measure(url: str, relays, args, out: str) -> dict[str, dict[int, list[dict]]]:
    conds = conditions(args)
    levels = [int(s) for s in args.streams.split(",")]
    runs: dict[str, dict[int, list[dict]]] = {label: {c: [] for c in levels} for label, _, _ in conds}
    for c in levels:  # warm-up, not kept: the first requests after start pay one-off costs (the first condition did)
        bench(url, c, args, out, "warm-up")
    for r in range(args.rounds):
        for label, delay, rate in conds if r % 2 == 0 else conds[::-1]:
            relays.set_delay(delay)
            shape_links(TAG, list(HOSTS), rate)
            for c in levels:
                before = stage0_bytes_out()
                m = bench(url, c, args, out, f"{label.replace(' ', '_').replace(',', '')}-r{r}")
                positions = m["total_input_tokens"] + m["total_output_tokens"]
                m["stage0_bytes_per_position"] = (stage0_bytes_out() - before) / max(1, positions)
                runs[label][c].append(m)
                print(f"  round {r + 1}, {label}, {c} streams: {m['output_throughput']:.2f} tok/s, "
                      f"ITL {m['mean_itl_ms']:.1f} ms", flush=True)
    relays.set_delay(0)
    shape_links(TAG, list(HOSTS), None)
    return runs


def table(runs: dict[str, dict[int, list[dict]]]) -> str:
    base_label = next(iter(runs))
    rows = ["| link | streams | output tok/s | × calibration (each round) | mean ITL | link share of a token | "
            "mean TTFT | bytes / position / hop |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, by_level in runs.items():
        for c, rounds in by_level.items():
            base = runs[base_label][c]
            tps = sum(m["output_throughput"] for m in rounds) / len(rounds)
            itl = sum(m["mean_itl_ms"] for m in rounds) / len(rounds)
            base_itl = sum(m["mean_itl_ms"] for m in base) / len(base)
            each = ", ".join(f"{a['output_throughput'] / b['output_throughput']:.2f}" for a, b in zip(rounds, base))
            ratio = tps / (sum(m["output_throughput"] for m in base) / len(base))
            share = (itl - base_itl) / itl if label != base_label else 0.0
            ttft = sum(m["mean_ttft_ms"] for m in rounds) / len(rounds)
            per_pos = sum(m["stage0_bytes_per_position"] for m in rounds) / len(rounds)
            rows.append(f"| {label} | {c} | {tps:.2f} | {ratio:.2f}× ({each}) | {itl:.1f} ms | {share:.1%} | "
                        f"{ttft:.0f} ms | {per_pos:,.0f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="alias or GGUF path (default smollm2)")
    p.add_argument("--rtt-ms", default="1,2", help="round-trip times to add per hop, comma-separated")
    p.add_argument("--rate", default="1gbit", help="each host's link bandwidth, in tc's units")
    p.add_argument("--streams", default="1,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-prompts", type=int, default=4)
    add_out_arg(p, "links")
    args = p.parse_args()
    if reason := netns_permitted():
        sys.exit(f"benchmarks.links needs network namespaces: {reason}")
    out = results_dir(args.out, "links")
    with contextlib.ExitStack() as stack:
        logs = stack.enter_context(tempfile.TemporaryDirectory())
        relays = stack.enter_context(contextlib.contextmanager(namespaces)(TAG, SUBNET, HOSTS, NAMES, PORTS))
        url = f"http://{SUBNET}.{HOSTS['gw']}:8000"
        stack.enter_context(contextlib.contextmanager(start_pods)(TAG, commands(args.model, logs), url, logs,
                                                                  timeout=900))
        print("compiled decode:", wait_compiled(lambda: [stage_info(0), stage_info(1)], 1800) and "yes", flush=True)
        runs = measure(url, relays, args, out)
    md = (f"2 stages + gateway in 3 network namespaces, model {os.path.basename(resolve_model(args.model))}, "
          f"{args.input_len}-token prompts, {args.output_len} tokens out, {args.rounds} rounds interleaved\n\n"
          + table(runs))
    write_results(out, "links", {"args": vars(args), "runs": runs}, md)
    print(md)


if __name__ == "__main__":
    main()
