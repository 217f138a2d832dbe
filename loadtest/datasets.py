"""Prompts for load tests: random prompts of exact token lengths, a ShareGPT-format file, or the built-in set."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from shared.errors import StagemeshError

BUILTIN = os.path.join(os.path.dirname(__file__), "prompts.json")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens
    output_len: int  # max_tokens to ask for


def random_requests(tokenizer, n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """Prompts of exactly the sampled token length: random ordinary tokens, decoded, re-encoded and trimmed
    until the text tokenizes to that length. Lengths are uniform in [len * (1 - r), len * (1 + r)]."""
    if not 0 <= range_ratio < 1:
        raise StagemeshError("--range-ratio must be within [0, 1)")
    rng = random.Random(seed)
    special = set(range(32))
    ordinary = [i for i in range(tokenizer.vocab_size) if i not in special]
    out = []
    for _ in range(n):
        want_in = max(1, rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))))
        want_out = max(1, rng.randint(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio))))
        ids = [rng.choice(ordinary) for _ in range(want_in)]
        for _ in range(10):
            text = tokenizer.decode(ids)
            ids2 = tokenizer.encode(text)
            if len(ids2) == want_in:
                break
            ids = (ids2 + [rng.choice(ordinary) for _ in range(want_in)])[:want_in]
        out.append(BenchRequest(text, len(tokenizer.encode(text)), want_out))
    return out


def sharegpt_requests(path: str, tokenizer, n: int, seed: int, output_len: int | None) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's token length as max_tokens (unless --output-len is given)."""
    try:
        data = json.load(open(path, encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StagemeshError(f"cannot read ShareGPT file {path}: {e}") from None
    pairs = []
    for item in data if isinstance(data, list) else []:
        conv = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(c, dict) and "value" in c for c in conv[:2]):
            pairs.append((conv[0]["value"], conv[1]["value"]))
    if not pairs:
        raise StagemeshError(f"{path} has no ShareGPT conversations (a list of {{'conversations': [{{'value': ...}}, ...]}})")
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        plen, rlen = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if plen < 4 or plen > 1024:
            continue
        out.append(BenchRequest(prompt, plen, output_len or max(4, min(rlen, 512))))
        if len(out) == n:
            break
    return out


def builtin_requests(tokenizer, n: int, seed: int, output_len: int) -> list[BenchRequest]:
    prompts = json.load(open(BUILTIN, encoding="utf-8"))
    rng = random.Random(seed)
    return [BenchRequest(p, len(tokenizer.encode(p)), output_len) for p in (rng.choice(prompts) for _ in range(n))]
