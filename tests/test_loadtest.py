"""stagemesh bench against real servers: its numbers agree with timestamps this test records itself (a TCP proxy
between bench and gateway notes when each SSE event passes), failures are counted with their reason, and the JSON
and PNG reports are written."""

import asyncio
import json
import os
import sys
import time

import pytest
from aiohttp import web

from services.testing.harness import free_port

BENCH = [sys.executable, "-m", "services.cli", "bench"]


@pytest.fixture(scope="module")
def gateway(serve_gateway):  # make serve's setup, shared with test_readme_examples (tests/conftest.py)
    return serve_gateway


class TimestampProxy:
    """Forwards TCP to the gateway and records, per connection, when requests and SSE events pass."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.requests: list[float] = []  # time each POST's first bytes arrived from the client
        self.events: list[tuple[float, str]] = []  # (time, SSE data) from the server

    async def handle(self, reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def client_to_server():
            while data := await reader.read(65536):
                if data.startswith(b"POST"):
                    self.requests.append(time.perf_counter())
                up_w.write(data)
                await up_w.drain()
            up_w.close()

        async def server_to_client():
            buf = b""
            while data := await up_r.read(65536):
                now = time.perf_counter()
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.split(b"data: ", 1)[-1].decode(errors="replace")
                    self.events.append((now, line))
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(client_to_server(), server_to_client(), return_exceptions=True)

    def per_request(self) -> list[dict]:
        """TTFT, E2E and the gaps between text events, per request (requests run one at a time)."""
        out = []
        for i, start in enumerate(self.requests):
            end = self.requests[i + 1] if i + 1 < len(self.requests) else float("inf")
            texts, done = [], None
            for t, data in self.events:
                if not start <= t < end:
                    continue
                if data.strip() == "[DONE]":
                    done = t
                elif data.startswith("{"):
                    msg = json.loads(data)
                    if any(c.get("text") for c in msg.get("choices", [])):
                        texts.append(t)
            out.append({"ttft": texts[0] - start, "e2el": done - start,
                        "itl": [b - a for a, b in zip(texts, texts[1:])]})
        return out


async def run_bench(*args) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*BENCH, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 600)
    return proc.returncode, out.decode()


async def test_reported_latencies_agree_with_independent_timestamps(gateway, tmp_path):
    proxy = TimestampProxy(int(gateway.url.rsplit(":", 1)[1]))
    port = free_port()
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port)
    result, plots = tmp_path / "result.json", tmp_path / "plots"
    try:
        rc, out = await run_bench("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "4", "--warmup", "0",
                                  "--max-concurrency", "1", "--input-len", "24", "--output-len", "12", "--ignore-eos",
                                  "--save-result", str(result), "--save-detailed", "--plot", str(plots), "--quiet")
    finally:
        server.close()
    assert rc == 0, out
    saved = json.loads(result.read_text())
    for key in ("mean_ttft_ms", "p99_itl_ms", "median_tpot_ms", "p90_e2el_ms", "output_throughput", "completed",
                "failed", "request_throughput", "total_token_throughput", "max_output_tokens_per_s"):
        assert key in saved, key
    assert saved["completed"] == 4 and saved["failed"] == 0
    assert saved["output_lens"] == [12] * 4  # ignore_eos: exactly the asked length
    seen = proxy.per_request()
    assert len(seen) == 4
    for i, s in enumerate(seen):
        assert abs(saved["ttfts"][i] - s["ttft"]) < 0.015 + 0.1 * s["ttft"], (saved["ttfts"][i], s["ttft"])
        assert abs(saved["e2els"][i] - s["e2el"]) < 0.015 + 0.05 * s["e2el"], (saved["e2els"][i], s["e2el"])
        ours, theirs = saved["itls"][i], s["itl"]
        assert len(ours) == len(theirs) == 11
        assert abs(sum(ours) / len(ours) - sum(theirs) / len(theirs)) < 0.005
    mean_ttft = sum(s["ttft"] for s in seen) / 4 * 1000
    assert abs(saved["mean_ttft_ms"] - mean_ttft) < 15 + 0.1 * mean_ttft
    for png in ("latency_cdf.png", "timeline.png"):
        assert (plots / png).stat().st_size > 10_000


@pytest.mark.processes
async def test_429_and_mid_stream_close_are_failures_with_reasons(tmp_path):
    calls = {"n": 0}

    async def completions(request):
        calls["n"] += 1
        n = calls["n"]
        if n % 3 == 1:
            return web.json_response({"error": {"message": "queue full", "type": "rate_limit_exceeded"}}, status=429,
                                     headers={"Retry-After": "1"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode())
            await asyncio.sleep(0.01)
        if n % 3 == 2:
            request.transport.close()  # hang up mid-stream
            return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async def health(request):
        return web.json_response({"ok": True})

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    result = tmp_path / "r.json"
    try:
        rc, out = await run_bench("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "6", "--warmup", "0",
                                  "--max-concurrency", "1", "--input-len", "8", "--output-len", "4", "--save-result",
                                  str(result), "--quiet")
    finally:
        await runner.cleanup()
    assert rc == 0, out
    saved = json.loads(result.read_text())
    assert (saved["completed"], saved["failed"]) == (2, 4)
    assert any("HTTP 429" in e and "queue full" in e for e in saved["errors"]), saved["errors"]
    assert any("mid-stream" in e or "ClientPayloadError" in e for e in saved["errors"]), saved["errors"]
    assert "example error" in out


async def test_concurrency_sweep_writes_its_plot(gateway, tmp_path):
    rc, out = await run_bench("--base-url", gateway.url, "--backend", "stagemesh-ws", "--num-prompts", "4",
                              "--sweep-concurrency", "1,4", "--input-len", "16", "--output-len", "8", "--ignore-eos",
                              "--plot", str(tmp_path), "--save-result", str(tmp_path / "sweep.json"), "--quiet")
    assert rc == 0, out
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["sweep_value"] for p in sweep["points"]] == [1, 4]
    assert all(p["completed"] == 4 and p["total_output_tokens"] == 32 for p in sweep["points"])
    assert os.path.getsize(tmp_path / "sweep.png") > 10_000
