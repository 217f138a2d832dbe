"""A stage dies mid-stream: `stagemesh up` restarts it, the gateway replays the sequence from its token history,
and the client receives the whole answer, the same as an undisturbed run."""

import asyncio
import os
import signal

import aiohttp

from loadtest.client import sse_events
from services.launch import start_up

BODY = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 48, "temperature": 0,
        "ignore_eos": True, "stream": True}


async def stream(url: str, on_token=None) -> tuple[str, list[dict]]:
    text, chunks = [], []
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200
        async for chunk in sse_events(r):
            chunks.append(chunk)
            assert "error" not in chunk, chunk
            text += [c["text"] for c in chunk["choices"]]
            if on_token:
                await on_token(len(chunks))
    return "".join(text), chunks


async def test_killing_a_stage_mid_stream_loses_nothing(tmp_path):
    gw = start_up(2, "float32", str(tmp_path))
    try:
        reference, _ = await stream(gw.url)
        victim = gw.stage_info(1)
        killed = {}

        async def kill_once(n):
            if n == 10 and not killed:
                pid = int(os.popen(f"ss -ltnpH 'sport = :{gw.stage_urls()[1].rsplit(':', 1)[1]}'").read()
                          .split("pid=")[1].split(",")[0])
                os.kill(pid, signal.SIGKILL)
                killed["pid"] = pid

        text, chunks = await asyncio.wait_for(stream(gw.url, kill_once), 180)
        assert killed, "the stage was never killed"
        assert text == reference  # every token, none twice, none lost
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert gw.stage_info(1)["incarnation"] != victim["incarnation"]  # it really restarted
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
    finally:
        gw.stop()
