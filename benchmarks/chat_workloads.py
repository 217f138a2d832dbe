"""Chat workloads side by side, in one run: llama.cpp's `llama-server` (its prompt cache on, as by default) against
`stagemesh up` (its prefix cache on, as by default), same model file, same machine, the same requests to both.

    make llama-server                                     # builds it once into ~/.cache/stagemesh (~8 min)
    python -m benchmarks.chat_workloads [--out DIR] [--turns 12] [--rounds 3] [--dtype D] [--users 32]
        [--workloads turns,shared,users] [--stages 1] [--model ALIAS_OR_GGUF] [-- up flags]

Three workloads, each server measured in turn within every round (the order reversed every other round):
- multi-turn chat: one conversation of --turns turns whose history grows to ~1.9k tokens (a long system prompt,
  user messages of ~120 tokens, scripted assistant replies of ~40 tokens -- the same history for every server, so
  both reuse exactly the previous request's prompt); each turn streams a 16-token reply; time to first token (TTFT)
  per turn. A new conversation (new words) for every server and round.
- shared system prompt: a ~700-token system prompt and --concurrent distinct short questions at once, 32 tokens
  each; wall time of the whole burst, --bursts bursts per round (the very first one also primes the caches, and is
  reported apart; new questions every burst).
- many users: --users conversations at once (each a short system prompt, then --user-turns turns of a ~120-token
  message and a 16-token reply, the scripted assistant replies as above), each user sending the next turn as soon
  as the last answer is in; TTFT per turn and the share of prompt tokens served from the cache (stagemesh's
  `cached_tokens`). A full server must keep every user's history somewhere for the next turn to reuse it.

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

from loadtest.client import sse_events
from services.testing.harness import (
    LLAMA_SERVER,
    add_dtype_arg,
    add_out_arg,
    dtype_label,
    results_dir,
    running_llama_server,
    ups_in_turn,
    write_results,
)
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model

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


async def many_users(url: str, seed: int, users: int, turns: int) -> list[list[dict]]:
    """users conversations at once, each turn sent when the user's last answer is in: [user][turn] results."""
    async def one(user: int, s: aiohttp.ClientSession) -> list[dict]:
        rng = random.Random(seed * 1000 + user)
        messages = [{"role": "system", "content": words(rng, 40)}]
        out = []
        for _ in range(turns):
            messages.append({"role": "user", "content": words(rng, 90)})
            out.append(await stream_chat(s, url, messages, 16))
            messages.append({"role": "assistant", "content": words(rng, 30)})
        return out

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        return list(await asyncio.gather(*(one(u, s) for u in range(users))))


def users_table(runs: dict[str, list[list[list[dict]]]]) -> str:
    """Per turn: mean prompt tokens, each server's mean TTFT and its ratio to llama-server's, and the share of
    prompt tokens stagemesh served from its cache."""
    names, ref = list(runs), "llama-server"
    turns = len(runs[ref][0][0])

    def at(name: str, t: int) -> list[dict]:
        return [conv[t] for rnd in runs[name] for conv in rnd]

    def mean(xs: list[float]) -> float:
        return sum(xs) / max(1, len(xs))

    rows = ["| turn | mean prompt tokens | " + " | ".join(f"{n} TTFT" for n in names) + " | "
            + " | ".join(f"{n} ÷ llama-server | {n} cached" for n in names if n != ref) + " |",
            "| ---: | ---: | " + " | ".join("---:" for _ in names) + " | "
            + " | ".join("---: | ---:" for n in names if n != ref) + " |"]
    for t in range(turns):
        ttft = {n: mean([r["ttft_s"] for r in at(n, t)]) for n in names}
        prompt = mean([r["prompt_tokens"] or 0 for r in at(names[-1], t)])
        cells = []
        for n in names:
            if n != ref:
                cached = sum(r["cached_tokens"] or 0 for r in at(n, t)) / max(1, sum(r["prompt_tokens"] or 0
                                                                                  for r in at(n, t)))
                cells.append(f"{ttft[n] / ttft[ref]:.2f}× | {100 * cached:.0f} %")
        rows.append(f"| {t + 1} | {prompt:.0f} | " + " | ".join(f"{1e3 * ttft[n]:.0f} ms" for n in names) + " | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows)


async def shared_prompt(url: str, system: str, seed: int, concurrent: int) -> dict:
    rng = random.Random(seed)
    questions = [words(rng, 14).rstrip(".") + "?" for _ in range(concurrent)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:  # one connection a request
        t0 = time.perf_counter()
        requests = await asyncio.gather(*(stream_chat(s, url, [{"role": "system", "content": system},
                                                               {"role": "user", "content": q}], 32) for q in questions))
        return {"wall_s": time.perf_counter() - t0, "requests": requests}


def turns_table(chat: dict[str, list[list[dict]]], turns: int) -> str:
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
    return "\n".join(rows)


def shared_table(burst: dict[str, list[dict]]) -> str:
    names = list(burst)
    ref = "llama-server"
    rows = ["| server | first burst (cold) | later bursts, wall time each | mean of later | ÷ llama-server | mean TTFT |",
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
    p.add_argument("--users", type=int, default=32, help="conversations at once in the many-users workload (default 32)")
    p.add_argument("--user-turns", type=int, default=4, help="turns of each many-users conversation (default 4)")
    p.add_argument("--workloads", default="turns,shared,users",
                   help="which to run: turns (multi-turn chat), shared (shared system prompt), users (many users)")
    add_dtype_arg(p, "stagemesh's")
    p.add_argument("--model", default="smollm2", help="alias or GGUF path, served by all of them (default smollm2)")
    p.add_argument("--stages", default="1", help="stagemesh meshes to run beside llama-server (default 1)")
    p.add_argument("--llama-server", default=LLAMA_SERVER, help="path of llama.cpp's llama-server (make llama-server)")
    p.add_argument("extra", nargs="*", help="more `stagemesh up` flags (after --)")
    args = p.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server}: run `make llama-server` first")
    if min(args.rounds, args.turns, args.concurrent, args.users, args.user_turns) < 1:
        sys.exit("--rounds, --turns, --concurrent, --users and --user-turns must be at least 1")
    workloads = set(args.workloads.split(","))
    if not workloads or workloads - {"turns", "shared", "users"}:
        sys.exit(f"--workloads {args.workloads!r}: name some of turns, shared, users, separated by commas")
    system = words(random.Random(7), 640)  # ~700 tokens
    with contextlib.ExitStack() as stack:
        # per slot: the longest conversation (~1.9k tokens) and its reply; a slot per user of the many-users workload
        slots = max(args.concurrent, args.users if "users" in workloads else 0)
        servers = {"llama-server": stack.enter_context(running_llama_server(
            args.model, args.llama_server, slots, 2304 * slots))}
        for stages, url in ups_in_turn(stack, [int(x) for x in args.stages.split(",")], args.model, args.dtype,
                                       args.extra).items():
            servers[f"stagemesh --stages {stages}"] = url
        names = list(servers)
        chat: dict[str, list[list[dict]]] = {n: [] for n in names}
        burst: dict[str, list[dict]] = {n: [] for n in names}
        users: dict[str, list[list[list[dict]]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                if "turns" in workloads:
                    chat[n].append(asyncio.run(multi_turn(servers[n], 100 + r, args.turns)))
                if "shared" in workloads:
                    for b in range(args.bursts):
                        burst[n].append(asyncio.run(shared_prompt(servers[n], system, 200 + 10 * r + b,
                                                                  args.concurrent)))
                if "users" in workloads:
                    users[n].append(asyncio.run(many_users(servers[n], 300 + r, args.users, args.user_turns)))
            print(f"round {r + 1} done", flush=True)
    parts = []
    if "turns" in workloads:
        parts.append(turns_table(chat, args.turns))
    if "shared" in workloads:
        parts.append(shared_table(burst))
    if "users" in workloads:
        parts.append(f"{args.users} users at once, {args.user_turns} turns each (TTFT = mean over users and rounds):"
                     f"\n\n{users_table(users)}")
    md = "\n\n".join(parts)
    model = resolve_model(args.model)
    header = (f"{GgufLoader(model).model_name} ({os.path.basename(model)}), {os.cpu_count()} CPU cores; llama-server "
              f"-np {slots} -cb (prompt cache on); stagemesh up {' '.join(args.extra) or '(defaults)'}, "
              f"{dtype_label(args.dtype)}; "
              f"{args.rounds} rounds, the servers in turn; TTFT = mean over rounds")
    print(header + "\n\n" + md)
    out = results_dir(args.out, "chat")
    write_results(out, "chat", {"settings": header, "multi_turn": chat, "shared_prompt_burst_s": burst,
                                "many_users": users}, header + "\n\n" + md)
    if "turns" in workloads:
        plot(chat, os.path.join(out, "chat.png"))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
