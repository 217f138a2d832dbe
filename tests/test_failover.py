"""A stage dies mid-stream: `stagemesh up` restarts it, the gateway replays the sequence from its token history,
and the client receives the whole answer, the same as an undisturbed run."""

import asyncio
import os
import signal

import aiohttp
import pytest

from loadtest.client import sse_events
from services.testing.harness import start_up

pytestmark = pytest.mark.processes  # every test here starts a real up

BODY = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 48, "temperature": 0,
        "ignore_eos": True, "stream": True}


async def stream(url: str, on_token=None, body: dict = BODY) -> tuple[str, list[dict]]:
    text, chunks = [], []
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for chunk in sse_events(r):
            chunks.append(chunk)
            assert "error" not in chunk, chunk
            text += [c["text"] for c in chunk["choices"]]
            if on_token:
                await on_token(len(chunks))
    return "".join(text), chunks


POLL = ("--stage-poll", "0.5")  # the gateway reads its stages' /info every 0.5 s (2 s by default): a kill is seen sooner


def kill_stage(gw, index: int) -> int:
    """SIGKILL the process listening on stage `index`'s HTTP port; returns its pid."""
    port = gw.stage_urls()[index].rsplit(":", 1)[1]
    pid = int(os.popen(f"ss -ltnpH 'sport = :{port}'").read().split("pid=")[1].split(",")[0])
    os.kill(pid, signal.SIGKILL)
    return pid


async def test_killing_a_stage_mid_stream_loses_nothing(tmp_path):
    gw = start_up(2, "float32", str(tmp_path), *POLL)
    try:
        reference, _ = await stream(gw.url)
        victim = gw.stage_info(1)
        killed = {}

        async def kill_once(n):
            if n == 10 and not killed:
                killed["pid"] = kill_stage(gw, 1)

        text, chunks = await asyncio.wait_for(stream(gw.url, kill_once), 180)
        assert killed, "the stage was never killed"
        assert text == reference  # every token, none twice, none lost
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert gw.stage_info(1).incarnation != victim.incarnation  # it really restarted
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
    finally:
        gw.stop()


PROMPTS = ["Write a long story about a lighthouse keeper.", "List ten facts about the moon.",
           "Explain how a bicycle works.", "Describe a busy market in the morning.",
           "Tell me about the history of tea.", "Write a poem about winter rain."]


# never complete within max_tokens: the constrained streams run as long as the others
FACTS = {"type": "json_schema", "json_schema": {"name": "facts", "schema": {
    "type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string"}, "minItems": 50}},
    "required": ["facts"]}}}
SYSTEM = "You are a storyteller. Answer in full sentences, with concrete details and no lists.\n\n"


async def test_batch_invariant_replay_reproduces_every_concurrent_stream(tmp_path):
    """The default weights (int4/bf16) with --batch-invariant: six greedy streams share micro-batches; stage 0 is
    killed mid-stream, every sequence is replayed (re-prefilled from its token history) into different company,
    and every text still equals its undisturbed run token for token -- also the two whose output a JSON schema
    constrains (the killed one among them: its grammar's state lives in the gateway, beside its tokens)."""
    gw = start_up(2, "bfloat16", str(tmp_path), "--batch-invariant", *POLL)
    try:
        # a shared system prompt: the disturbed run starts every stream from the reference run's cached prefix, so it
        # also shows a cache hit sampling what a full prefill does -- and the replay, on a restarted stage that
        # keeps nothing, prefilling it all again to the same text
        bodies = [{**BODY, "prompt": SYSTEM + p, "max_tokens": 40} for p in PROMPTS]
        for k in (0, 3):  # two constrained by a grammar (whose state lives in the gateway: the replay keeps it)
            bodies[k] |= {"response_format": FACTS, "ignore_eos": False}
        reference = await asyncio.gather(*(stream(gw.url, body=b) for b in bodies))
        assert len({text for text, _ in reference}) == len(PROMPTS)  # six different texts, not one repeated
        assert all(reference[k][0].startswith('{"facts": ["') for k in (0, 3))
        killed = {}

        async def kill_once(n):
            if n == 12 and not killed:
                killed["pid"] = kill_stage(gw, 0)

        disturbed = await asyncio.wait_for(asyncio.gather(
            stream(gw.url, kill_once, bodies[0]), *(stream(gw.url, body=b) for b in bodies[1:])), 240)
        assert killed, "the stage was never killed"
        assert gw.metric("stagemesh_gateway_replayed_sequences_total") > 0  # sequences really were replayed
        assert gw.metric("stagemesh_gateway_prefix_cache_hits_total") >= len(PROMPTS)  # ... and started from the cache
        for (want, _), (got, _) in zip(reference, disturbed):
            assert got == want
    finally:
        gw.stop()
