"""Predicted Outputs on an edit workload: the same greedy requests with and without `prediction` (the text the
answer is expected to repeat), interleaved in rounds on one `stagemesh up`, at one stream; prints each one's
tokens/s, the ratio, the drafted tokens that stood and the tokens each decode pass produced.

    python -m benchmarks.prediction --stages 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

from services.testing.harness import Report, add_out_arg, running_up

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


def ask(url: str, system: str, text: str, max_tokens: int, predicted: bool) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0}
    if predicted:
        body["prediction"] = {"type": "content", "content": text}
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                                       {"Content-Type": "application/json"}), timeout=600) as r:
        out = json.loads(r.read())
    usage = out["usage"]
    details = usage.get("completion_tokens_details") or {}
    return {"seconds": time.perf_counter() - t0, "tokens": usage["completion_tokens"],
            "accepted": details.get("accepted_prediction_tokens", 0),
            "rejected": details.get("rejected_prediction_tokens", 0), "text": out["choices"][0]["message"]["content"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="1,2", help="stage counts to run, comma-separated (default 1,2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    add_out_arg(p, "prediction")
    args = p.parse_args()
    report = Report("prediction", args.out)
    results = {}
    for stages in (int(s) for s in args.stages.split(",")):
        with running_up(stages) as gw:
            for system, text in EDITS:  # warm-up: the prompt path, the compiled steps' first calls
                ask(gw.url, system, text, 8, False)
                ask(gw.url, system, text, 8, True)
            runs = {"plain": [], "predicted": []}
            for _ in range(args.rounds):
                for system, text in EDITS:
                    for kind in ("plain", "predicted"):  # interleaved: the same load on both
                        runs[kind].append(ask(gw.url, system, text, args.max_tokens, kind == "predicted"))
            same = all(a["text"] == b["text"] for a, b in zip(runs["plain"], runs["predicted"]))
            rate = {k: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for k, v in runs.items()}
            ratios = [b["tokens"] / b["seconds"] / (a["tokens"] / a["seconds"])
                      for a, b in zip(runs["plain"], runs["predicted"])]
            tokens = sum(r["tokens"] for r in runs["predicted"])
            stood = sum(r["accepted"] for r in runs["predicted"])
            drafted = stood + sum(r["rejected"] for r in runs["predicted"])
            per_pass = tokens / max(1, tokens - stood)  # each pass gives one token, and the drafted ones that stood
            results[stages] = {"tokens_per_s": rate, "ratio": rate["predicted"] / rate["plain"],
                               "median_pair_ratio": statistics.median(ratios), "drafted": drafted, "stood": stood,
                               "tokens_per_pass": per_pass, "same_text": same}
            report.say(f"{stages} stage{'s' if stages > 1 else ''}: {rate['plain']:.1f} tok/s without a prediction, "
                       f"{rate['predicted']:.1f} with ({rate['predicted'] / rate['plain']:.2f}x; median of pairs "
                       f"{statistics.median(ratios):.2f}x); {stood} of {drafted} drafted tokens stood, "
                       f"{per_pass:.2f} tokens a pass; the same answers: {same}")
    report.write(results)


if __name__ == "__main__":
    main()
