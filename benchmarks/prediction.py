"""Speculation at one stream: stagemesh's tokens/s with drafts against its own without (a request's
`"speculation": false`, the path `--speculation off` takes), interleaved request by request on one `stagemesh up`.

- edit: the answer mostly repeats a given text, as an edit does; with n-gram drafts only (no `prediction`: the
  request's own context drafts the text), and with the text as the `prediction` (Predicted Outputs). The edits are
  --workload's: `edits` (a spelling fix, a tense change, a verbatim repeat, ... services/testing/edits.py EDITS) or
  `renames` (a Python file whose one function is renamed, the whole file given back, each request a rename of its
  own: RENAMES);
- chat: distinct questions (loadtest's built-in prompts), each asked once a kind: n-gram drafts that mostly miss.

Every request is greedy, in a cache scope of its own (each prefills in full, and the n-gram pool, keyed by that
scope, carries nothing from one request to the next). Prints each workload's tokens/s per kind, the ratio to no
drafts, the drafted tokens that stood and the tokens one decode pass produced (the gateway's speculation counters
around each request), and whether the answers were the same.

Then --streams chat streams at once (loadtest's built-in questions), rounds with drafts and without in turn: where the
load policy keeps drafts off, what drafting costs a full pipeline.

    python -m benchmarks.prediction --stages 2 --rounds 1 [--workload renames] [--speculation on] [--streams 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from loadtest.datasets import BUILTIN
from services.gateway.engine.drafts import MAX_PREDICTED_TOKENS
from services.gateway.engine.speculator import interpolate
from services.testing.edits import EDITS, RENAMES
from services.testing.harness import (
    LLAMA_SERVER,
    Report,
    add_out_arg,
    running_llama_server,
    running_up,
    scrape_metric,
)
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model
from shared.text.tokenizer import GgufTokenizer

KINDS = {"edit": ("off", "ngram", "predicted"), "chat": ("off", "ngram")}
SOURCES = ("prediction", "context", "pool")


def counters(url: str) -> dict[str, float]:
    """The gateway's speculation counters: drafted and accepted tokens (every source), decode steps and the tokens
    they produced."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {k: sum(scrape_metric(text, f"stagemesh_gateway_speculation_{k}_tokens_total", {"source": s})
                  for s in SOURCES) for k in ("drafted", "accepted")}
    for k in ("steps", "tokens"):
        out[f"decode_{k}"] = scrape_metric(text, f"stagemesh_gateway_speculation_decode_{k}_total")
    return out


def complete(url: str, messages: list[dict], max_tokens: int, kind: str, scope: str,
             prediction: str | None = None) -> dict:
    """One greedy chat completion: its seconds, completion tokens and text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_salt": scope,
            "speculation": kind != "off"}
    if kind == "predicted":
        body["prediction"] = {"type": "content", "content": prediction}
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                                       {"Content-Type": "application/json"}), timeout=600) as r:
        out = json.loads(r.read())
    return {"seconds": time.perf_counter() - t0, "tokens": out["usage"]["completion_tokens"],
            "text": out["choices"][0]["message"]["content"]}


def ask(url: str, messages: list[dict], max_tokens: int, kind: str, scope: str, prediction: str | None = None) -> dict:
    """complete(), alone on the gateway, with what its speculation counters moved by around it."""
    before = counters(url)
    out = complete(url, messages, max_tokens, kind, scope, prediction)
    return {**out, **{k: v - before[k] for k, v in counters(url).items()}}


def concurrent_round(url: str, questions: list[str], max_tokens: int, kind: str, scope: str) -> dict:
    """Every question at once, one stream each (each in a cache scope of its own): the round's tokens over its wall
    time, the texts in question order, and what the speculation counters moved by."""
    before, t0 = counters(url), time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        outs = list(pool.map(lambda iq: complete(url, [{"role": "user", "content": iq[1]}], max_tokens, kind,
                                                 f"{scope}-{iq[0]}"), enumerate(questions)))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(o["tokens"] for o in outs), "texts": [o["text"] for o in outs],
            **{k: v - before[k] for k, v in counters(url).items()}}


def summary(runs: dict[str, list[dict]]) -> dict:
    rate = {k: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for k, v in runs.items()}
    out = {"tokens_per_s": rate, "same_text": {}, "ratio": {}, "median_pair_ratio": {}, "drafted": {}, "stood": {},
           "tokens_per_pass": {}}
    for kind, rs in runs.items():
        out["drafted"][kind] = sum(r["drafted"] for r in rs)
        out["stood"][kind] = sum(r["accepted"] for r in rs)
        out["tokens_per_pass"][kind] = sum(r["decode_tokens"] for r in rs) / max(1, sum(r["decode_steps"] for r in rs))
        if kind != "off":
            out["ratio"][kind] = rate[kind] / rate["off"]
            out["median_pair_ratio"][kind] = statistics.median(
                b["tokens"] / b["seconds"] / (a["tokens"] / a["seconds"]) for a, b in zip(runs["off"], rs))
            out["same_text"][kind] = all(a["text"] == b["text"] for a, b in zip(runs["off"], rs))
    return out


def longest_runs(answer: list[int], text: list[int]) -> list[int]:
    """For each position of the answer, how many tokens from there on occur, in that order, in the text or earlier in
    the answer (a run starting before the position: where prompt lookup would find it)."""
    runs = [0] * len(answer)
    for i in range(len(answer)):
        for seq, starts in ((text, range(len(text))), (answer, range(i))):
            for j in starts:
                n = 0
                while i + n < len(answer) and j + n < len(seq) and answer[i + n] == seq[j + n]:
                    n += 1
                runs[i] = max(runs[i], n)
    return runs


def drafting_bound(answers: list[list[int]], texts: list[list[int]], pass_ms: dict[str, float]) -> float:
    """The most drafts from the request's text and the answer's own earlier tokens could speed decoding up, knowing
    the answers: at each step a drafter drafts exactly the tokens that will stand (a run of the answer found there, at
    most MAX_PREDICTED_TOKENS), each step's pass costing the measured ms of its rows (pass_ms, interpolated); its
    decode time over one token a pass."""
    ms = {int(r): t for r, t in pass_ms.items()}
    cost = {r: interpolate(ms, r) for r in range(1, MAX_PREDICTED_TOKENS + 2)}
    plain = bounded = 0.0
    for answer, text in zip(answers, texts):
        runs, best = longest_runs(answer, text), [0.0] * (len(answer) + 1)
        for i in range(len(answer) - 1, -1, -1):  # best[i]: the least time to decode answer[i:]
            best[i] = min(cost[k + 1] + best[min(len(answer), i + k + 1)]
                          for k in range(min(runs[i], MAX_PREDICTED_TOKENS) + 1))
        plain += len(answer) * cost[1]
        bounded += best[0]
    return plain / bounded if bounded else 1.0


LLAMA_SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def against_llama_server(url: str, binary: str, max_tokens: int, report: Report, model: str = "smollm2",
                         edits: list[tuple[str, str]] = EDITS) -> dict:
    """The edits without a prediction, one stream, on this (1-stage) mesh with n-gram drafts and on llama-server with
    each of its draftless speculation types, interleaved edit by edit: tok/s of each, the mesh's over the best."""
    with contextlib.ExitStack() as stack:
        servers = {"stagemesh": url}
        for spec in LLAMA_SPEC_TYPES:  # idle but for their turn: each answers alone
            servers[f"llama-server {spec}"] = stack.enter_context(running_llama_server(
                model, binary, slots=1, context=4096, extra=("--spec-type", spec)))
        runs = {name: [] for name in servers}
        for system, text in edits:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
            for name, base in servers.items():
                runs[name].append(complete(base, msgs, max_tokens, "ngram", "vs-llama"))
    rate = {name: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for name, rs in runs.items()}
    best = max((n for n in rate if n != "stagemesh"), key=rate.get)
    report.say("edits, one stream, 1 stage with n-gram drafts against llama-server (-t "
               f"{os.cpu_count()}, -np 1) by --spec-type: " + "; ".join(f"{n} {r:.1f} tok/s" for n, r in rate.items())
               + f"; stagemesh / the best ({best}): {rate['stagemesh'] / rate[best]:.2f}x")
    return {"tokens_per_s": rate, "best": best, "ratio": rate["stagemesh"] / rate[best],
            "tokens": {n: [r["tokens"] for r in rs] for n, rs in runs.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="2", help="stage counts to run, comma-separated (default 2)")
    p.add_argument("--model", default="smollm2", help="the model served (a registry name or a .gguf path; default "
                   "smollm2; gemma3-270m keeps to a text it repeats more closely)")
    p.add_argument("--workload", default="edits", choices=("edits", "renames"),
                   help=f"the edits: {len(EDITS)} kinds of edit of a text, or {len(RENAMES)} renames of a function in a "
                        "file, the whole file given back (default edits)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the edits (each edit once per round)")
    p.add_argument("--questions", type=int, default=6, help="distinct chat questions (each asked once a kind)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--streams", type=int, default=32,
                   help="then this many chat streams at once, rounds with drafts and without in turn (0: none)")
    p.add_argument("--stream-rounds", type=int, default=3, help="rounds of each kind at --streams")
    p.add_argument("--llama-server", nargs="?", const=LLAMA_SERVER, default=None,
                   help="also llama.cpp's llama-server (this path; `make llama-server`) on the edits, once per "
                        f"draftless --spec-type ({', '.join(LLAMA_SPEC_TYPES)}), beside the 1-stage mesh's n-grams")
    p.add_argument("--speculation", default="auto", choices=("auto", "on"),
                   help="the gateway's --speculation for the drafting kinds (default auto)")
    add_out_arg(p, "prediction")
    args = p.parse_args()
    report = Report("prediction", args.out)
    edits = RENAMES if args.workload == "renames" else EDITS
    with open(BUILTIN) as f:
        questions = json.load(f)[:args.questions]
    tokenizer = GgufTokenizer.from_gguf(GgufLoader(resolve_model(args.model)))
    results = {}
    for stages in (int(s) for s in args.stages.split(",")):
        with running_up(stages, "--model", resolve_model(args.model), "--speculation", args.speculation) as gw:
            for system, text in edits:  # warm-up: the prompt path, the steps' first calls at each row count
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
                for kind in KINDS["edit"]:
                    ask(gw.url, msgs, 16, kind, f"warm-{kind}", text)
            edit = {k: [] for k in KINDS["edit"]}
            for i in range(args.rounds):
                for system, text in edits:
                    msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
                    for kind in KINDS["edit"]:  # interleaved: the same load on each
                        edit[kind].append(ask(gw.url, msgs, args.max_tokens, kind, f"edit-{i}-{kind}", text))
            chat = {k: [] for k in KINDS["chat"]}
            for q in questions:
                for kind in KINDS["chat"]:
                    chat[kind].append(ask(gw.url, [{"role": "user", "content": q}], args.max_tokens, kind,
                                          f"chat-{kind}"))
            many = {"off": [], "ngram": []}
            if args.streams:
                with open(BUILTIN) as f:
                    every = json.load(f)
                wanted = [every[i % len(every)] for i in range(args.streams)]
                for i in range(args.stream_rounds):
                    for kind in many:
                        many[kind].append(concurrent_round(gw.url, wanted, args.max_tokens, kind, f"many-{i}-{kind}"))
            if args.llama_server and stages == 1:
                results["llama-server"] = against_llama_server(gw.url, args.llama_server, args.max_tokens, report,
                                                               args.model, edits)
            pass_ms = json.loads(gw.get("/v1/mesh")[1])["gateway"]["speculation"]["pass_ms"]
            texts = [tokenizer.encode(f"{system}\n{text}", add_bos=False) for system, text in edits] * args.rounds
            bound = drafting_bound([tokenizer.encode(r["text"], add_bos=False) for r in edit["off"]], texts, pass_ms)
            results[stages] = {"model": args.model, "workload": args.workload, "edit": summary(edit), "drafting_bound": bound, "chat": summary(chat), "speculation": args.speculation,
                               "streams": args.streams, "many": many,
                               "pass_ms": pass_ms}
            for name in KINDS:
                r = results[stages][name]
                off = r["tokens_per_s"]["off"]
                parts = [f"{kind} {r['tokens_per_s'][kind]:.1f} tok/s ({r['ratio'][kind]:.2f}x, median of pairs "
                         f"{r['median_pair_ratio'][kind]:.2f}x; {r['stood'][kind]:.0f} of {r['drafted'][kind]:.0f} "
                         f"drafted tokens stood, {r['tokens_per_pass'][kind]:.2f} tokens a pass; the same answers: "
                         f"{r['same_text'][kind]})" for kind in KINDS[name] if kind != "off"]
                report.say(f"{stages} stage{'s' if stages > 1 else ''}, --speculation {args.speculation}, {name}: no "
                           f"drafts {off:.1f} tok/s; " + "; ".join(parts))
            report.say(f"{stages} stage{'s' if stages > 1 else ''}, edit: the most drafts from the request's text "
                       f"and the answer so far could speed decoding up, drafting exactly what stands in each pass "
                       f"(these answers, the measured pass costs): {bound:.2f}x")
            if args.streams:
                rate = {k: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for k, v in many.items()}
                pairs = statistics.median(b["tokens"] / b["seconds"] / (a["tokens"] / a["seconds"])
                                          for a, b in zip(many["off"], many["ngram"]))
                # without --batch-invariant a greedy text depends on what shared its micro-batches: two rounds
                # without drafts differ too, so the count to compare is against that one's
                differ = sum(x != y for x, y in zip(many["off"][0]["texts"], many["ngram"][0]["texts"]))
                differ_off = sum(x != y for x, y in zip(many["off"][0]["texts"], many["off"][-1]["texts"]))
                drafted = sum(r["drafted"] for r in many["ngram"])
                report.say(f"{stages} stages, {args.streams} chat streams at once: no drafts {rate['off']:.1f} tok/s; "
                           f"ngram {rate['ngram']:.1f} tok/s ({rate['ngram'] / rate['off']:.2f}x, median of pairs "
                           f"{pairs:.2f}x; {drafted:.0f} drafted tokens; texts that differ from the first round without "
                           f"drafts: {differ} of {args.streams}, and in its last round: {differ_off})")
            report.say(f"measured ms of a decode pass by its rows: {results[stages]['pass_ms']}")
    report.write(results)


if __name__ == "__main__":
    main()
