"""A stage's KV memory by what its sequences hold: `stagemesh up` with the default slots and context, its stages'
resident memory (VmRSS) and their K/V bytes (/info kv.resident_bytes of kv.reserved_bytes) idle, under a burst of
concurrent requests, and after them (finished requests stay as cached prefixes until room is needed).

--shared-prompt-words N: every request starts with the same N-word system text (one request first, so that the
stages keep it), as users of one system prompt do. The K/V positions held slots read from a kept prefix's pages
instead of copies of their own are in "K/V shared" (kv.shared_bytes). PSS is each stage's memory as the kernel
counts it, a page mapped n times counting 1/n each time (VmRSS counts such a page each time).

    python -m benchmarks.kv_memory [--stages 1] [--concurrent 32] [--prompt-words 300] [--shared-prompt-words 0]
        [--dtype D] [--out DIR] [-- up flags]

Writes kv_memory.json and kv_memory.md into --out (default: a new benchmarks/results/<date>-kv-memory)."""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

import aiohttp

from services.testing.harness import (
    add_dtype_arg,
    add_out_arg,
    children,
    dtype_label,
    pss_mb,
    results_dir,
    rss_mb,
    running_up,
    write_results,
)

MIB = 2**20


def snapshot(gw, stages: int, pids: list[int]) -> list[dict]:
    """Per stage: VmRSS (MiB) and the K/V bytes its held positions take, of what every slot could take."""
    largest = sorted(pids, key=rss_mb)[-stages:]  # the stages: the largest children of up
    out = []
    for i in range(stages):
        info = gw.stage_info(i)
        out.append({"rss_mib": rss_mb(largest[i]), "pss_mib": pss_mb(largest[i]),
                    "kv_resident_mib": info.kv_resident_bytes / MIB,
                    "kv_reserved_mib": info.kv_reserved_bytes / MIB, "kv_slots_used": info.kv_slots_used,
                    "kv_shared_mib": info.kv_shared_bytes / MIB, "kv_slots_cached": info.kv_slots_cached})
    return out


VOCAB = ["river", "stone", "lantern", "harbour", "meadow", "engine", "violet", "copper", "thunder", "willow"]


def shared_text(words: int) -> str:
    """The system text every request of a --shared-prompt-words run starts with."""
    rng = random.Random(0)
    return "You are the harbour's assistant. " + " ".join(rng.choice(VOCAB) for _ in range(words)) + "\n" if words else ""


async def burst(url: str, n: int, words: int, seed: int, shared: str = "") -> None:
    rng = random.Random(seed)

    async def one(session: aiohttp.ClientSession, k: int) -> None:
        text = " ".join(rng.choice(VOCAB) for _ in range(words))
        body = {"prompt": f"{shared}Request {k}: {text}", "max_tokens": 32, "temperature": 0.7, "seed": k,
                "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*(one(session, k) for k in range(n)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--shared-prompt-words", type=int, default=0,
                   help="words of a system text every request starts with (0: none)")
    add_dtype_arg(p)
    add_out_arg(p, "kv-memory")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    with running_up(args.stages, *args.extra, dtype=args.dtype, compiled=False) as gw:
        pids = children(gw.proc.pid)
        shared = shared_text(args.shared_prompt_words)
        if shared:  # the stages keep the system text's K/V from this one on
            asyncio.run(burst(gw.url, 1, 8, 0, shared))
            deadline = time.monotonic() + 10
            while gw.stage_info(0).kv_slots_cached == 0 and time.monotonic() < deadline:
                time.sleep(0.1)  # its release (keep) is on its way to the stages
        idle = snapshot(gw, args.stages, pids)
        peak: list[dict] = []
        done = threading.Event()

        def sample() -> None:  # the burst's largest K/V footprint, polled
            while not done.is_set():
                now = snapshot(gw, args.stages, pids)
                if not peak or sum(s["kv_resident_mib"] for s in now) > sum(s["kv_resident_mib"] for s in peak):
                    peak[:] = now
                time.sleep(0.2)

        poller = threading.Thread(target=sample, daemon=True)
        poller.start()
        asyncio.run(burst(gw.url, args.concurrent, args.prompt_words, 1, shared))
        done.set()
        poller.join()
        after = snapshot(gw, args.stages, pids)
    rows = ["| | per stage: VmRSS | PSS | K/V held / reserved | K/V shared | live slots | cached prefixes |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, snap in (("idle" + (" (system text kept)" if shared else ""), idle),
                       (f"during {args.concurrent} requests (peak)", peak), ("after", after)):
        rows.append(f"| {name} | " + " · ".join(f"{s['rss_mib']:.0f} MiB" for s in snap) + " | " +
                    " · ".join(f"{s['pss_mib']:.0f} MiB" for s in snap) + " | " +
                    " · ".join(f"{s['kv_resident_mib']:.1f} / {s['kv_reserved_mib']:.0f} MiB" for s in snap) + " | " +
                    " · ".join(f"{s['kv_shared_mib']:.1f} MiB" for s in snap) + " | " +
                    " · ".join(str(s["kv_slots_used"]) for s in snap) + " | " +
                    " · ".join(str(s["kv_slots_cached"]) for s in snap) + " |")
    header = (f"stagemesh up --stages {args.stages} {' '.join(args.extra) or '(defaults)'}, {dtype_label(args.dtype)}; "
              f"{args.concurrent} concurrent completions of ~{args.prompt_words + 2}-word prompts"
              + (f" after a {args.shared_prompt_words + 4}-word system text they share" if shared else "")
              + ", 32 output tokens each")
    md = header + "\n\n" + "\n".join(rows)
    print(md)
    write_results(results_dir(args.out, "kv-memory"), "kv_memory",
                  {"settings": header, "idle": idle, "peak": peak, "after": after}, md)


if __name__ == "__main__":
    main()
