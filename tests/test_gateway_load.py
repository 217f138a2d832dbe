"""Gateway behaviour under concurrency, disconnects and bad input (one 2-stage deployment, float32)."""

import asyncio
import json

import aiohttp
import pytest

from loadtest.client import sse_events
from services.testing.harness import scrape_metric

PROMPTS = [f"Count from 1 to {n}:" for n in range(3, 19)]  # 16 prompts of different lengths
LENGTHS = [8 + i for i in range(16)]  # and different output lengths (8 to 23 tokens: each stream ends at its own step)


@pytest.fixture(scope="module")
def gateway(up):
    # its own setup (no other module asks for --kv-slots 24): the counters and the in-flight maximum read below are
    # this module's alone
    return up("--kv-slots", "24", stages=2, dtype="float32")


async def stream_completion(session, url, prompt, max_tokens, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    text = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in sse_events(r):
            text.extend(c["text"] for c in chunk["choices"])
    return "".join(text)


async def test_openai_sdk_streams_a_chat_completion_with_usage(gateway, smollm2):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused")
    models = await client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert models.data[0].capabilities == ["completion", "chat"]
    # no --max-seq-len: the model's trained context (the file's context_length, 8192), which memory holds here
    assert models.data[0].max_model_len == smollm2.config.context_length == 8192
    stream = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True})
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(text).strip()
    assert usage is not None and usage.completion_tokens >= 1 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    full = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=16, temperature=0)
    assert full.choices[0].message.content == "".join(text)
    await client.close()


async def test_16_concurrent_streams_complete_correctly_with_several_microbatches_in_flight(gateway):
    async with aiohttp.ClientSession() as s:
        alone = [await stream_completion(s, gateway.url, p, n) for p, n in zip(PROMPTS, LENGTHS)]
        before_max = gateway.metric("stagemesh_gateway_microbatches_in_flight_max")
        together = await asyncio.gather(*(stream_completion(s, gateway.url, p, n) for p, n in zip(PROMPTS, LENGTHS)))
    assert together == alone
    assert all(t.strip() for t in together)
    assert before_max <= 1  # one request at a time never fills the pipeline...
    assert gateway.metric("stagemesh_gateway_microbatches_in_flight_max") > 1  # ...16 at once did


async def test_disconnected_clients_free_everything_within_2s(gateway):
    async def sse_then_drop(i):
        async with aiohttp.ClientSession() as s:
            async with s.post(gateway.url + "/v1/completions",
                              json={"prompt": f"Tell a long story number {i}.", "max_tokens": 400, "stream": True,
                                    "ignore_eos": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):  # streaming has begun: leave mid-stream
                        break
        # leaving the session closes the connection mid-stream

    async def ws_then_drop(i):
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(gateway.url + "/v1/stream")
            await ws.send_json({"type": "generate", "id": f"w{i}", "prompt": f"Write an essay {i}.", "max_tokens": 400,
                                "ignore_eos": True})  # cannot end on its own before the client drops
            for _ in range(3):
                await ws.receive_json(timeout=60)
            await ws.close()

    await asyncio.gather(*(sse_then_drop(i) for i in range(5)), *(ws_then_drop(i) for i in range(5)))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < 2.0:
        used = [gateway.stage_info(i).kv_slots_used for i in range(2)]
        if gateway.metric("stagemesh_gateway_running_sequences") == 0 and used == [0, 0]:
            break
        await asyncio.sleep(0.1)
    assert gateway.metric("stagemesh_gateway_running_sequences") == 0
    assert [gateway.stage_info(i).kv_slots_used for i in range(2)] == [0, 0]
    assert gateway.metric("stagemesh_gateway_requests_total", outcome="cancelled") == 10


BAD_HTTP = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "non-empty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400, "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "'n'"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', 400, "stop"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "\xff\xfe broken"}', 400, "UTF-8"),
    ("/v1/completions", b'{"prompt": "' + b"word " * 9000 + b'"}', 400, "context"),  # past SmolLM2's 8192
    ("/v1/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, "exceeds"),
    ("/v1/nothing", b"{}", 404, "Not Found"),
]


async def test_bad_input_is_refused_at_the_edge_and_others_are_unaffected(gateway):
    stage0_tokens = lambda: gateway_stage_counter(gateway, 0)  # noqa: E731
    before = stage0_tokens()
    async with aiohttp.ClientSession() as s:
        good = asyncio.create_task(stream_completion(s, gateway.url, PROMPTS[0], LENGTHS[0]))
        await asyncio.sleep(0)
        for path, body, status, needle in BAD_HTTP:
            async with s.post(gateway.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                payload = await r.json()
                assert r.status == status, (path, body[:60], payload)
                assert needle in payload["error"]["message"], payload
                assert set(payload["error"]) >= {"message", "type", "code"}
        async with s.ws_connect(gateway.url + "/v1/stream") as ws:
            for msg, code in [("{bad json", "invalid_json"), ('{"type": "explode", "id": "a"}', "unknown_type"),
                              ('{"type": "generate", "id": "b", "prompt": 7}', "invalid_request"),
                              ('{"type": "generate", "id": "c", "messages": []}', "invalid_request"),
                              ('{"type": "generate", "id": "d", "prompt": "x", "max_tokens": -1}', "invalid_request"),
                              ('{"type": "cancel", "id": "nope"}', "unknown_id"), ("[]", "invalid_request")]:
                await ws.send_str(msg)
                ev = await ws.receive_json(timeout=10)
                assert ev["type"] == "error" and ev["code"] == code, (msg, ev)
            await ws.send_bytes(b"\x00\x01")
            closed = await ws.receive(timeout=10)
            assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and ws.close_code == 1003
        async with s.ws_connect(gateway.url + "/v1/stream", max_msg_size=0) as ws:
            await ws.send_str(json.dumps({"type": "generate", "id": "big", "prompt": "x" * (2 << 20)}))
            await ws.receive(timeout=10)
            assert ws.close_code == 1009  # message too big
        good_text = await good
    alone = None
    async with aiohttp.ClientSession() as s:
        alone = await stream_completion(s, gateway.url, PROMPTS[0], LENGTHS[0])
    assert good_text == alone  # the well-behaved client got its full, correct answer
    # nothing but the two good requests reached a stage: their tokens and no more
    spent = stage0_tokens() - before
    prompt_len = len(gateway_tokenize(PROMPTS[0]))
    assert spent == 2 * (prompt_len + LENGTHS[0] - 1)


def gateway_stage_counter(gw, i) -> float:
    import urllib.request

    text = urllib.request.urlopen(gw.stage_urls()[i] + "/metrics", timeout=5).read().decode()
    value = scrape_metric(text, "stagemesh_stage_tokens_total")
    assert value == value, "no token counter"  # NaN when absent
    return value


def gateway_tokenize(text):
    from shared.runtime.model_files import ModelFiles

    return ModelFiles.open("smollm2").tokenizer.encode(text)
