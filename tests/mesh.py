"""Test utility: drive groups of sequences through a running mesh with the one generation driver
(shared.runtime.generation.drive over a PipelineClient); each group is one micro-batch per step."""

from __future__ import annotations

from shared.batch.sampling import SamplingParams
from shared.runtime.generation import SequenceState, run_group_on_mesh
from shared.wire.pipeline_client import PipelineClient


async def generate_group(client: PipelineClient, prompts: dict[str, list[int]], max_tokens: int,
                         params: dict[str, SamplingParams] | None = None, stop_ids: frozenset = frozenset()) -> dict[str, list[int]]:
    """All sequences of the group share each micro-batch: one prefill, then decodes until max_tokens or a stop id."""
    params = params or {}
    states = [SequenceState(s, ids, params.get(s, SamplingParams()), max_tokens, stop_ids) for s, ids in prompts.items()]
    await run_group_on_mesh(client, states, prefill_chunk=max(len(ids) for ids in prompts.values()))
    return {s.seq_id: s.output_ids for s in states}
