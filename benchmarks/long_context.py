"""The context a mesh serves by default (issue 70 items 1 and 5): `stagemesh up --model M` with no --max-seq-len and no
--kv-dtype, asked one prompt of --tokens tokens. Prints what /v1/models and each stage's /info say (the context, why,
the K/V dtype and bytes a position), the answer's prompt tokens, its time to the first token and total, and the K/V
the stages hold once it is answered against what float32 K/V would have held.

    python -m benchmarks.long_context --model gemma3-270m --tokens 20000 [--stages 2]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from services.testing.harness import Report, add_out_arg, running_up
from shared.runtime.model_files import ModelFiles, resolve_model


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def long_prompt(files: ModelFiles, tokens: int) -> tuple[str, int]:
    """A text of about `tokens` tokens (numbered lines, each a fact about its number) and a question whose answer is
    in its first line: what a model that attended to the whole context can answer."""
    head = "Line 1: the secret word is heliotrope.\n"
    lines, n = [head], 1
    text = head
    while len(files.tokenizer.encode(text)) < tokens - 40:
        chunk = "".join(f"Line {n + i}: {n + i} is {'even' if (n + i) % 2 == 0 else 'odd'} and its square is "
                        f"{(n + i) ** 2}.\n" for i in range(1, 200))
        n += 199
        lines.append(chunk)
        text = "".join(lines)
    ids = files.tokenizer.encode(text)[:tokens - 40]
    text = files.tokenizer.decode(ids) + "\nQuestion: what is the secret word in line 1? Answer: the secret word is"
    return text, len(files.tokenizer.encode(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--stages", type=int, default=2)
    add_out_arg(p, "long-context")
    args = p.parse_args()
    report = Report("long-context", args.out)
    files = ModelFiles.open(args.model)
    prompt, counted = long_prompt(files, args.tokens)
    with running_up(args.stages, "--model", resolve_model(args.model), "--compile-decode", "off",
                    compiled=False) as gw:
        model = get(gw.url + "/v1/models")["data"][0]
        stages = [s for p in get(gw.url + "/v1/mesh")["pipelines"] for s in p["stages"]]
        infos = [get(s["url"] + "/info") for s in stages]
        report.say(f"{args.model}: trained context {files.config.context_length}; /v1/models max_model_len "
                   f"{model.get('max_model_len')}")
        for i, info in enumerate(infos):
            report.say(f"  stage {i} ({info['layers'][0]}:{info['layers'][1]}): context {info['kv_max_seq_len']} "
                       f"({info['context']['why']}), K/V {info['kv_dtype']}, {info['kv_position_bytes']} bytes a "
                       f"position")
        body = {"model": model["id"], "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first = None
        text, usage = [], None
        req = urllib.request.Request(gw.url + "/v1/completions", json.dumps(
            {**body, "stream_options": {"include_usage": True}}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    if first is None and chunk["choices"][0].get("text"):
                        first = time.perf_counter() - t0
                    text.append(chunk["choices"][0].get("text", ""))
                usage = chunk.get("usage") or usage
        total = time.perf_counter() - t0
        after = [get(s["url"] + "/info") for s in stages]
    held = sum(i["kv_resident_bytes"] for i in after)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}
    as_float32 = sum(i["kv_position_bytes"] * 4 // itemsize[i["kv_dtype"]] for i in after) * usage["prompt_tokens"]
    report.say(f"prompt: {usage['prompt_tokens']} tokens (counted here {counted}); answer {''.join(text)!r}; "
               f"first token after {first:.1f} s, done after {total:.1f} s")
    report.say(f"K/V held after it: {held / 2**20:.0f} MiB over {len(after)} stages (float32 K/V of its positions: "
               f"{as_float32 / 2**20:.0f} MiB)")
    report.write({"model": args.model, "context_length": files.config.context_length,
                  "max_model_len": model.get("max_model_len"), "stages": [
                      {k: i[k] for k in ("layers", "kv_max_seq_len", "context", "kv_dtype", "kv_position_bytes",
                                         "kv_resident_bytes")} for i in after],
                  "prompt_tokens": usage["prompt_tokens"], "answer": "".join(text), "ttft_s": first,
                  "total_s": total})


if __name__ == "__main__":
    main()
