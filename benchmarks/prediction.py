"""Speculation at one stream: stagemesh's tokens/s with drafts against its own without (a request's
`"speculation": false`, the path `--speculation off` takes), interleaved request by request on one `stagemesh up`.

- edit: the answer mostly repeats a given text, as an edit does; with n-gram drafts only (no `prediction`: the
  request's own context drafts the text), and with the text as the `prediction` (Predicted Outputs);
- chat: distinct questions (loadtest's built-in prompts), each asked once a kind: n-gram drafts that mostly miss.

Every request is greedy, in a cache scope of its own (each prefills in full, and the n-gram pool, keyed by that
scope, carries nothing from one request to the next). Prints each workload's tokens/s per kind, the ratio to no
drafts, the drafted tokens that stood and the tokens one decode pass produced (the gateway's speculation counters
around each request), and whether the answers were the same.

    python -m benchmarks.prediction --stages 2 --rounds 1 [--speculation on]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

from loadtest.datasets import BUILTIN
from services.testing.harness import Report, add_out_arg, running_up, scrape_metric

# (what the user asks, the text it is about): the answer mostly repeats the text, as an edit does
EDITS = [
    ("Repeat the user's text word for word.",
     "The river flows through the old town, past the mill and the church, and under the stone bridge where children "
     "fish on summer evenings. In winter the water freezes at the edges, and the ducks gather near the warm outlet of "
     "the bakery. Every spring the town holds a market on the river bank, with bread, cheese, honey and flowers."),
    ("Repeat the user's code exactly.",
     "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\n"
     "def spread(values):\n    low, high = min(values), max(values)\n    return high - low\n"),
    ("Repeat the user's list, one item per line.",
     "apples\npears\nplums\ncherries\napricots\nquinces\nmedlars\ngooseberries\nredcurrants\nblackcurrants\n"),
]
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


def ask(url: str, messages: list[dict], max_tokens: int, kind: str, scope: str, prediction: str | None = None) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_salt": scope,
            "speculation": kind != "off"}
    if kind == "predicted":
        body["prediction"] = {"type": "content", "content": prediction}
    before = counters(url)
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                                       {"Content-Type": "application/json"}), timeout=600) as r:
        out = json.loads(r.read())
    seconds = time.perf_counter() - t0
    moved = {k: v - before[k] for k, v in counters(url).items()}
    return {"seconds": seconds, "tokens": out["usage"]["completion_tokens"], **moved,
            "text": out["choices"][0]["message"]["content"]}


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="2", help="stage counts to run, comma-separated (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the edits (each of the 3 edits per round)")
    p.add_argument("--questions", type=int, default=6, help="distinct chat questions (each asked once a kind)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--speculation", default="auto", choices=("auto", "on"),
                   help="the gateway's --speculation for the drafting kinds (default auto)")
    add_out_arg(p, "prediction")
    args = p.parse_args()
    report = Report("prediction", args.out)
    with open(BUILTIN) as f:
        questions = json.load(f)[:args.questions]
    results = {}
    for stages in (int(s) for s in args.stages.split(",")):
        with running_up(stages, "--speculation", args.speculation) as gw:
            for system, text in EDITS:  # warm-up: the prompt path, the steps' first calls at each row count
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
                for kind in KINDS["edit"]:
                    ask(gw.url, msgs, 16, kind, f"warm-{kind}", text)
            edit = {k: [] for k in KINDS["edit"]}
            for i in range(args.rounds):
                for system, text in EDITS:
                    msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
                    for kind in KINDS["edit"]:  # interleaved: the same load on each
                        edit[kind].append(ask(gw.url, msgs, args.max_tokens, kind, f"edit-{i}-{kind}", text))
            chat = {k: [] for k in KINDS["chat"]}
            for q in questions:
                for kind in KINDS["chat"]:
                    chat[kind].append(ask(gw.url, [{"role": "user", "content": q}], args.max_tokens, kind,
                                          f"chat-{kind}"))
            results[stages] = {"edit": summary(edit), "chat": summary(chat), "speculation": args.speculation,
                               "pass_ms": json.loads(gw.get("/v1/mesh")[1])["gateway"]["speculation"]["pass_ms"]}
            for name in KINDS:
                r = results[stages][name]
                off = r["tokens_per_s"]["off"]
                parts = [f"{kind} {r['tokens_per_s'][kind]:.1f} tok/s ({r['ratio'][kind]:.2f}x, median of pairs "
                         f"{r['median_pair_ratio'][kind]:.2f}x; {r['stood'][kind]:.0f} of {r['drafted'][kind]:.0f} "
                         f"drafted tokens stood, {r['tokens_per_pass'][kind]:.2f} tokens a pass; the same answers: "
                         f"{r['same_text'][kind]})" for kind in KINDS[name] if kind != "off"]
                report.say(f"{stages} stage{'s' if stages > 1 else ''}, --speculation {args.speculation}, {name}: no "
                           f"drafts {off:.1f} tok/s; " + "; ".join(parts))
            report.say(f"measured ms of a decode pass by its rows: {results[stages]['pass_ms']}")
    report.write(results)


if __name__ == "__main__":
    main()
