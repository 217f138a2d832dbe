"""The gateway end to end: real `stagemesh up` processes, real clients (aiohttp, the official openai SDK)."""

import asyncio
import json

import aiohttp
import pytest

from loadtest.client import sse_events
from tests.conftest import stagemesh_runs, starts_processes

QUESTIONS = ["What is 2+2?", "Name a primary color.", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
@starts_processes
def reference():
    """`stagemesh generate --chat --dtype float32 --temperature 0` per question (one interpreter, in turn)."""
    runs = stagemesh_runs(*(["generate", "--chat", "--prompt", q, "--max-tokens", str(MAX_TOKENS), "--dtype",
                             "float32", "--temperature", "0", "--json"] for q in QUESTIONS))
    assert all(r["code"] == 0 for r in runs), [r["stderr"] for r in runs]
    return {q: json.loads(r["stdout"])["text"] for q, r in zip(QUESTIONS, runs)}


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}stages")
def gateway(request, up):
    return up(stages=request.param, dtype="float32")


def chat_body(q, **kw):
    return {"model": "smollm2", "messages": [{"role": "user", "content": q}], "temperature": 0,
            "max_tokens": MAX_TOKENS, **kw}


async def sse_text(session, url, body) -> tuple[str, list[dict]]:
    chunks = []
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        chunks = [c async for c in sse_events(r)]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    return text, chunks


async def ws_generate(ws, rid, **body) -> tuple[str, dict]:
    await ws.send_json({"type": "generate", "id": rid, **body})
    text = []
    while True:
        ev = await ws.receive_json(timeout=120)
        assert ev["id"] == rid, ev
        if ev["type"] == "token":
            text.append(ev["text"])
        elif ev["type"] == "done":
            return "".join(text), ev
        else:
            raise AssertionError(ev)


async def test_greedy_output_equals_generate_over_every_api(gateway, reference):
    async with aiohttp.ClientSession() as s:
        for q in QUESTIONS:
            async with s.post(gateway.url + "/v1/chat/completions", json=chat_body(q)) as r:
                body = await r.json()
                assert r.status == 200, body
            assert body["choices"][0]["message"]["content"] == reference[q]
            streamed, _ = await sse_text(s, gateway.url + "/v1/chat/completions", chat_body(q, stream=True))
            assert streamed == reference[q]
            async with s.ws_connect(gateway.url + "/v1/stream") as ws:
                text, done = await ws_generate(ws, "r1", messages=[{"role": "user", "content": q}], temperature=0,
                                               max_tokens=MAX_TOKENS)
            assert text == reference[q]
            assert done["usage"]["completion_tokens"] <= MAX_TOKENS and done["timings"]["ttft_ms"] > 0


async def test_seconds_of_backlog_on_metrics_follow_the_running_requests(up):
    """/metrics of a real gateway: stagemesh_gateway_backlog_tokens is what the running requests may still generate
    (at most their max_tokens), _backlog_seconds that over the measured throughput, both 0 once they ended."""
    from services.testing.harness import scrape_metric

    gw = up(stages=1, dtype="float32")
    streams, max_tokens = 4, 48
    names = ("stagemesh_gateway_backlog_tokens", "stagemesh_gateway_backlog_seconds",
             "stagemesh_gateway_throughput_tokens_per_second")
    async with aiohttp.ClientSession() as s:
        async def scrape() -> tuple[float, ...]:
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
            return tuple(scrape_metric(text, n) for n in names)

        async def one(i: int) -> None:
            body = {"model": "smollm2", "prompt": f"List {i}: apples, pears,", "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content:
                    pass

        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        seen = []
        while not all(t.done() for t in tasks):
            seen.append(await scrape())
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks)
        after = await scrape()
    busy = [x for x in seen if x[0] > 0]
    assert busy and all(tokens <= streams * max_tokens for tokens, _, _ in busy), seen
    measured = [(tokens, secs, tps) for tokens, secs, tps in busy if tps > 0]
    assert measured, seen  # a throughput was measured while they ran ...
    assert all(secs == pytest.approx(tokens / tps, rel=0.05) for tokens, secs, tps in measured), measured  # ... and used
    assert after[0] == 0 and after[1] == 0 and after[2] > 0, after
