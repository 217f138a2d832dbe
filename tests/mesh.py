"""Test utility: drive groups of sequences through a running mesh with the PipelineClient (the gateway's
scheduler is the product version of this loop; here each group is one micro-batch per step)."""

from __future__ import annotations

import torch

from shared.pipeline_client import PipelineClient
from shared.protocol import ForwardBatch, SeqEntry
from shared.sampling import SamplingParams
from shared.steps import Decode, Prefill


async def generate_group(client: PipelineClient, prompts: dict[str, list[int]], max_tokens: int,
                         params: dict[str, SamplingParams] | None = None, stop_ids: frozenset = frozenset()) -> dict[str, list[int]]:
    """All sequences of the group share each micro-batch: one prefill, then decodes until max_tokens or a stop id."""
    params = params or {}
    out: dict[str, list[int]] = {s: [] for s in prompts}
    seqs = [SeqEntry(s, Prefill(len(ids), 0, len(ids), True), params.get(s, SamplingParams())) for s, ids in prompts.items()]
    tokens = torch.tensor([t for ids in prompts.values() for t in ids])
    live = dict(prompts)
    try:
        while seqs:
            result = await client.forward(ForwardBatch(client.next_mb_id(), seqs, tokens=tokens))
            next_seqs, next_tokens = [], []
            by_id = {s.seq_id: s for s in seqs}
            for sid, tok in zip(result.seq_ids, result.tokens):
                out[sid].append(tok)
                if len(out[sid]) < max_tokens and tok not in stop_ids:
                    pos = len(live[sid]) + len(out[sid]) - 1
                    next_seqs.append(SeqEntry(sid, Decode(pos), by_id[sid].sampling))
                    next_tokens.append(tok)
            seqs, tokens = next_seqs, torch.tensor(next_tokens, dtype=torch.int64)
    finally:
        await client.release(list(prompts))
    return out
