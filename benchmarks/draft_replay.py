"""Drafting policies replayed offline on known answers: the gateway's own Speculator (services/gateway/engine/
speculator.py) drafts for each request step by step as it would live, each draft checked against the answer (what
stood is its longest prefix the answer has next, then one token more, as a verify step gives), every pass costing
the measured ms of its rows. So a change to the policy is measured in seconds, not in a live run's minutes and noise;
the live figures are benchmarks/prediction.py's.

Workloads:
- edits: benchmarks.prediction's edits, their greedy answers recorded from `stagemesh up --stages 1` (speculation off),
  the prompt and the prediction (the text as the user sent it) tokenized as that script's drafting bound does;
- renames: Python files whose one function is renamed everywhere it appears; the answer is the renamed file (as a
  model that does it right would write it), the prediction the file as sent;
- renames as answered: the same requests, their greedy answers recorded as the edits' are (what the model writes).

Kinds: `ngram` (no prediction: the request's context and the pool draft) and `predicted` (with the prediction); the
speed-up of each over no drafts. Requests run in order with one pool per kind, as the live benchmark's cache scopes do.

    python -m benchmarks.draft_replay [--pass-ms JSON] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import urllib.request

from services.gateway.engine.request import Request
from services.gateway.engine.speculator import DRAFT_ROWS, Speculator, interpolate
from services.testing.edits import EDITS, RENAMES, renames
from services.testing.harness import add_out_arg, results_dir, running_up, write_results
from shared.batch.sampling import SamplingParams
from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model
from shared.text.tokenizer import GgufTokenizer

# ms of a decode pass by its rows: SmolLM2 on 2 stages, the 2-core VM (benchmarks/results/2026-11-29-speculation-smollm2)
PASS_MS = {1: 8.469, 2: 10.195, 3: 11.075, 4: 10.897, 5: 11.778, 6: 12.61, 7: 12.753, 8: 14.458, 9: 14.83, 13: 24.738,
           15: 30.857}


def recorded_edits(max_tokens: int, edits: list[tuple[str, str]] = EDITS, model: str = "smollm2") \
        -> list[tuple[str, str, str]]:
    """(the request, the text, its greedy answer) for each of `edits` (benchmarks.prediction's), from a 1-stage up of
    `model`."""
    def answer(url: str, system: str, text: str) -> str:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0, "speculation": False}
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                                           {"Content-Type": "application/json"}), timeout=600) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]

    with running_up(1, "--model", resolve_model(model)) as gw:
        return [(system, text, answer(gw.url, system, text)) for system, text in edits]


def replay(cases: list[dict], kind: str, pass_ms: dict[int, float]) -> dict:
    """Every case's answer decoded with the Speculator drafting (`kind`): the speed-up over one token a pass."""
    spec = Speculator("auto")
    for rows in range(1, DRAFT_ROWS + 2):
        spec.costs.observe(rows, interpolate(pass_ms, rows) / 1e3)
    drafted = stood_all = 0
    with_drafts = plain = 0.0
    for i, case in enumerate(cases):
        answer = case["answer"]
        req = Request(seq_id=f"r{i}", prompt_ids=list(case["prompt"]), params=SamplingParams(temperature=0),
                      prediction_ids=list(case["prediction"]) if kind == "predicted" else None, cache_tenant=kind)
        req.output_ids = answer[:1]  # the first token comes from the prefill
        while len(req.output_ids) < len(answer):
            n = len(req.output_ids)
            draft = spec.draft(req, DRAFT_ROWS - 1, ngrams=True, batch_rows=1)
            stood = 0
            while stood < len(draft) and n + stood < len(answer) and draft[stood] == answer[n + stood]:
                stood += 1
            with_drafts += interpolate(pass_ms, 1 + len(draft))
            req.output_ids += answer[n:n + stood + 1]
            spec.verified(req, decoded=True, drafted=len(draft), stood=stood)
            drafted, stood_all = drafted + len(draft), stood_all + stood
        plain += (len(answer) - 1) * interpolate(pass_ms, 1)
    return {"speedup": round(plain / with_drafts, 3), "drafted": drafted, "stood": stood_all}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arg(p, "draft-replay")
    p.add_argument("--pass-ms", default=None, help="JSON {rows: ms} of a decode pass (default: SmolLM2 on 2 stages)")
    p.add_argument("--max-tokens", type=int, default=200, help="the recorded edit answers' length at most")
    p.add_argument("--model", default="smollm2", help="the model whose answers are recorded (default smollm2)")
    args = p.parse_args()
    pass_ms = {int(k): float(v) for k, v in json.loads(args.pass_ms).items()} if args.pass_ms else PASS_MS
    tok = GgufTokenizer.from_gguf(GgufLoader(resolve_model(args.model)))

    def cases(triples) -> list[dict]:
        return [{"prompt": tok.encode(f"{q}\n{text}", add_bos=False), "prediction": tok.encode(text, add_bos=False),
                 "answer": tok.encode(answer, add_bos=False)} for q, text, answer in triples]

    answered = recorded_edits(args.max_tokens, EDITS + RENAMES, args.model)  # one `up` answers both
    workloads = {"edits": cases(answered[:len(EDITS)]), "renames": cases(renames()),
                 "renames as answered": cases(answered[len(EDITS):])}
    results = {name: {kind: replay(cs, kind, pass_ms) for kind in ("ngram", "predicted")}
               for name, cs in workloads.items()}
    rows = ["| workload | kind | × no drafts | drafted tokens that stood |", "| --- | --- | ---: | ---: |"]
    for name, by_kind in results.items():
        for kind, r in by_kind.items():
            rows.append(f"| {name} | {kind} | {r['speedup']:.2f}× | {r['stood']} of {r['drafted']} |")
    md = f"Offline replay, pass ms by rows {pass_ms}\n\n" + "\n".join(rows)
    print(md)
    out = results_dir(args.out, "draft-replay")
    write_results(out, "draft_replay", {"pass_ms": pass_ms, "results": results}, md)
    print(f"results in {out}")


if __name__ == "__main__":
    main()
