"""Chat workloads side by side, in one run: llama.cpp's `llama-server` (its prompt cache on, as by default) against
`stagemesh up` (its prefix cache on, as by default), same model file, same machine, the same requests to both.

    make llama-server                                     # builds it once into ~/.cache/stagemesh (~8 min)
    python -m benchmarks.chat_workloads [--out DIR] [--turns 12] [--rounds 3] [--dtype D]
        [--stages 1] [--model ALIAS_OR_GGUF] [-- up flags]

Two workloads, each server measured in turn within every round (the order reversed every other round):
- multi-turn chat: one conversation of --turns turns whose history grows to ~1.9k tokens (a long system prompt,
  user messages of ~120 tokens, scripted assistant replies of ~40 tokens -- the same history for every server, so
  both reuse exactly the previous request's prompt); each turn streams a 16-token reply; time to first token (TTFT)
  per turn. A new conversation (new words) for every server and round.
- shared system prompt: a ~700-token system prompt and --concurrent distinct short questions at once, 32 tokens
  each; wall time of the whole burst, --bursts bursts per round (the very first one also primes the caches, and is
  reported apart; new questions every burst).

Writes chat.json, chat.md (tables with ratios to llama-server) and chat.png (TTFT per turn against history length)
into --out (default: a new benchmarks/results/<date>-chat)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time

import aiohttp

from benchmarks.harness import (
    LLAMA_SERVER,
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    results_dir,
    running_llama_server,
    ups_in_turn,
    write_results,
)
from loadtest.client import sse_events
from shared.gguf_loader import GgufLoader
from shared.model_registry import resolve_model

WORDS = ("river mountain city garden window morning evening market bridge harbour library station forest meadow "
         "village kitchen letter teacher student doctor farmer sailor painter engineer question answer story history "
         "science music weather winter summer autumn spring journey travel machine engine signal network language "
         "number figure table chapter reason method result problem solution careful quiet bright heavy gentle simple "
         "ancient modern distant narrow open closed early late quick slow warm cold green blue yellow silver golden "
         "walks reads writes builds carries opens closes finds keeps shows brings follows explains remembers "
         "describes compares measures repairs collects").split()


def words(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        out.append(rng.choice(WORDS))
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out).capitalize() + "."


def conversation(seed: int, turns: int) -> tuple[str, list[str], list[str]]:
    """(system prompt, user messages, scripted assistant replies) of one conversation."""
    rng = random.Random(seed)
    return (words(rng, 120), [words(rng, 90) for _ in range(turns)], [words(rng, 30) for _ in range(turns)])


async def stream_chat(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: TTFT (to the first content), total time, and the prompt's token count."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, {}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        async for chunk in sse_events(r):
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "total_s": time.perf_counter() - t0,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def multi_turn(url: str, seed: int, turns: int) -> list[dict]:
    system, users, replies = conversation(seed, turns)
    messages = [{"role": "system", "content": system}]
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:  # one connection a request
        for user, reply in zip(users, replies):
            messages.append({"role": "user", "content": user})
            out.append(await stream_chat(s, url, messages, 16))
            messages.append({"role": "assistant", "content": reply})
    return out


async def shared_prompt(url: str, system: str, seed: int, concurrent: int) -> dict:
    rng = random.Random(seed)
    questions = [words(rng, 14).rstrip(".") + "?" for _ in range(concurrent)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:  # one connection a request
        t0 = time.perf_counter()
        requests = await asyncio.gather(*(stream_chat(s, url, [{"role": "system", "content": system},
                                                               {"role": "user", "content": q}], 32) for q in questions))
        return {"wall_s": time.perf_counter() - t0, "requests": requests}


def tables(chat: dict[str, list[list[dict]]], burst: dict[str, list[dict]], turns: int) -> str:
    names = list(chat)
    ref = "llama-server"

    def mean_ttft(name: str, turn: int) -> float:
        return sum(r[turn]["ttft_s"] for r in chat[name]) / len(chat[name])

    tokens = [chat[names[-1]][0][t]["prompt_tokens"] for t in range(turns)]
    rows = ["| turn | prompt tokens | " + " | ".join(f"{n} TTFT" for n in names) + " | "
            + " | ".join(f"{n} ÷ llama-server" for n in names if n != ref) + " |",
            "| ---: | ---: | " + " | ".join("---:" for _ in names) + " | " + " | ".join("---:" for n in names if n != ref) + " |"]
    for t in range(turns):
        rows.append(f"| {t + 1} | {tokens[t]} | " + " | ".join(f"{1e3 * mean_ttft(n, t):.0f} ms" for n in names) + " | "
                    + " | ".join(f"{mean_ttft(n, t) / mean_ttft(ref, t):.2f}×" for n in names if n != ref) + " |")
    rows += ["", "| server | first burst (cold) | later bursts, wall time each | mean of later | ÷ llama-server | mean TTFT |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]

    def warm(name: str) -> list[dict]:
        return burst[name][1:] or burst[name]

    def mean_wall(name: str) -> float:
        return sum(b["wall_s"] for b in warm(name)) / len(warm(name))

    for n in names:
        ttfts = [r["ttft_s"] for b in warm(n) for r in b["requests"]]
        each = ", ".join(f"{b['wall_s']:.2f}" for b in warm(n))
        rows.append(f"| {n} | {burst[n][0]['wall_s']:.2f} s | {each} s | "
                    f"{mean_wall(n):.2f} s | {mean_wall(n) / mean_wall(ref):.2f}× | {1e3 * sum(ttfts) / len(ttfts):.0f} ms |")
    return "\n".join(rows)


def plot(chat: dict[str, list[list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rounds in chat.items():
        turns = len(rounds[0])
        xs = [rounds[0][t]["prompt_tokens"] or t for t in range(turns)]
        ax.plot(xs, [1e3 * sum(r[t]["ttft_s"] for r in rounds) / len(rounds) for t in range(turns)], marker="o",
                label=name)
    ax.set_xlabel("prompt tokens (the conversation so far)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("multi-turn chat, each turn's prompt = the last one + a reply + a message")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arg(p, "chat")
    p.add_argument("--turns", type=int, default=12, help="turns of the multi-turn conversation (default 12)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the servers in turn in each (default 3)")
    p.add_argument("--concurrent", type=int, default=8, help="questions at once after the shared prompt (default 8)")
    p.add_argument("--bursts", type=int, default=3, help="bursts of questions per server and round (default 3)")
    add_dtype_arg(p, "stagemesh's")
    p.add_argument("--model", default="smollm2", help="alias or GGUF path, served by all of them (default smollm2)")
    p.add_argument("--stages", default="1", help="stagemesh meshes to run beside llama-server (default 1)")
    p.add_argument("--llama-server", default=LLAMA_SERVER, help="path of llama.cpp's llama-server (make llama-server)")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    if args.rounds < 1 or args.turns < 1 or args.concurrent < 1:
        sys.exit("--rounds, --turns and --concurrent must be at least 1")
    system = words(random.Random(7), 640)  # ~700 tokens
    with contextlib.ExitStack() as stack:
        # per slot: the longest conversation (~1.9k tokens) and its reply
        servers = {"llama-server": stack.enter_context(running_llama_server(
            args.model, args.llama_server, args.concurrent, 2304 * args.concurrent))}
        for stages, url in ups_in_turn(stack, [int(x) for x in args.stages.split(",")], args.model, args.dtype,
                                       args.extra).items():
            servers[f"stagemesh --stages {stages}"] = url
        names = list(servers)
        chat: dict[str, list[list[dict]]] = {n: [] for n in names}
        burst: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                chat[n].append(asyncio.run(multi_turn(servers[n], 100 + r, args.turns)))
                for b in range(args.bursts):
                    burst[n].append(asyncio.run(shared_prompt(servers[n], system, 200 + 10 * r + b, args.concurrent)))
            print(f"round {r + 1}: last-turn TTFT " + ", ".join(
                f"{n} {1e3 * chat[n][-1][-1]['ttft_s']:.0f} ms" for n in names) + "; burst " + ", ".join(
                f"{n} {burst[n][-1]['wall_s']:.2f} s" for n in names), flush=True)
    md = tables(chat, burst, args.turns)
    model = resolve_model(args.model)
    header = (f"{GgufLoader(model).model_name} ({os.path.basename(model)}), {os.cpu_count()} CPU cores; llama-server "
              f"-np {args.concurrent} -cb (prompt cache on); stagemesh up {' '.join(args.extra) or '(defaults)'}, "
              f"{dtype_label(args.dtype)}; "
              f"{args.rounds} rounds, the servers in turn; TTFT = mean over rounds")
    print(header + "\n\n" + md)
    out = results_dir(args.out, "chat")
    write_results(out, "chat", {"settings": header, "multi_turn": chat, "shared_prompt_burst_s": burst},
                  header + "\n\n" + md)
    plot(chat, os.path.join(out, "chat.png"))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
