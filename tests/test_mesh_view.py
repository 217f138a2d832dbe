"""The mesh view against a live `stagemesh up --stages 2`: the JSON snapshot and its event stream, `stagemesh status`
(ready -> 0; a stage stopped -> 1, naming it), and the page's #mesh view in headless Chromium under load and while a
stage is SIGKILLed and comes back (screenshots in test-output/)."""

import asyncio
import base64
import json
import os
import signal
import subprocess
import time

import aiohttp
import pytest

from loadtest.client import send_sse
from services.testing.harness import start_up
from tests.conftest import stagemesh_cmd, starts_processes
from tests.stage_infos import make_info
from tests.test_browser import DevTools, page_ws_url


@pytest.fixture(scope="module")
@starts_processes
def gateway(tmp_path_factory):
    gw = start_up(2, "bfloat16", str(tmp_path_factory.mktemp("gwmesh")), "--auto-rebalance", "off",  # its split drawn
                  "--stage-poll", "0.5")  # a stopped or killed stage seen within half a second
    yield gw
    gw.stop()


def mesh(gw) -> dict:
    status, body = gw.get("/v1/mesh")
    assert status == 200, body
    return json.loads(body)


def stage_pid(gw, i: int) -> int:
    port = gw.stage_urls()[i].rsplit(":", 1)[1]
    return int(os.popen(f"ss -ltnpH 'sport = :{port}'").read().split("pid=")[1].split(",")[0])


async def load(url: str, streams: int, max_tokens: int) -> list:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        return await asyncio.gather(*(send_sse(s, url, "openai", "smollm2", f"Tell me a long story number {i}.", 0,
                                               max_tokens, ignore_eos=True, temperature=0.7) for i in range(streams)))


def wait_for(pred, timeout: float, what: str, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def status(gw) -> subprocess.CompletedProcess:
    return subprocess.run(stagemesh_cmd("status", gw.url), capture_output=True, text=True, timeout=60)


async def test_snapshot_describes_each_stage_and_the_stream_delivers_snapshots(gateway):
    results = await load(gateway.url, 6, 96)  # seconds of load: the once-a-second snapshots see requests running
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    # snapshots are built once a second: wait for one taken after the load finished
    snap = wait_for(lambda: (s := mesh(gateway)) and all(st.get("compute_ms") for st in s["stages"])
                    and s["gateway"]["generated_tokens"] >= 6 * 96 and s, 10,
                    "a snapshot after the load, with compute times of both stages")
    assert snap["ready"] and snap["problem"] is None
    assert [st["layers"] for st in snap["stages"]] == [[0, 17], [17, 30]]
    for st in snap["stages"]:
        assert st["state"] == "ready" and st["kv_slots"] == 32 and st["listen"].startswith("tcp://")
        assert 0 <= st["kv_slots_used"] <= 32 and st["prefixes_evicted"] == 0  # /info's fields, its names
        assert 0 < st["busy_fraction"] <= 1 and 0 < st["compute_ms"] < 10_000
        assert st["hop_in_ms"] is not None and 0 <= st["hop_in_ms"] < 1000  # every micro-batch header carries "sent"
        assert st["hop_next_ms"] is not None and 0 <= st["hop_next_ms"] < 1000
    g = snap["gateway"]
    assert g["generated_tokens"] >= 6 * 96 and g["ttft_ms"] > 0 and g["failovers"] == 0
    assert any(v for v in snap["series"]["tokens_per_s"] if v)  # the chart saw the load
    assert max(snap["series"]["running"]) >= 1
    async with aiohttp.ClientSession() as s, s.get(gateway.url + "/v1/mesh/stream") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = []
        while len(events) < 3:
            line = (await asyncio.wait_for(r.content.readline(), 5)).decode()
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    times = [e["time"] for e in events]
    assert times == sorted(times) and len(set(times)) == 3  # a fresh snapshot each tick
    assert all(len(e["stages"]) == 2 for e in events)


def test_status_exits_zero_when_ready_and_names_a_stopped_stage(gateway):
    ok = status(gateway)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ready" in ok.stdout and "17:30" in ok.stdout
    as_json = subprocess.run(stagemesh_cmd("status", gateway.url, "--json"), capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["ready"] is True
    pid = stage_pid(gateway, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        bad = wait_for(lambda: (r := status(gateway)).returncode != 0 and r, 30, "status to notice the stopped stage")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "stage 1" in bad.stderr and "lost" in bad.stderr and "stage 0" not in bad.stderr
    assert "NOT READY" in bad.stdout
    wait_for(lambda: status(gateway).returncode == 0, 30, "the stage to be ready again after SIGCONT")
    unreachable = subprocess.run(stagemesh_cmd("status", "http://127.0.0.1:9"), capture_output=True, text=True,
                                 timeout=60)
    assert unreachable.returncode == 2 and "cannot reach the gateway" in unreachable.stderr


FIRST_TOKENS = 192  # each of the first load's 8 streams


async def test_mesh_page_under_load_and_through_a_stage_restart(gateway, chromium, output_dir):  # noqa: F811
    before = mesh(gateway)["gateway"]
    restarts_before = mesh(gateway)["stages"][1]["restarts"]
    shots = {}
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await dt.call("Page.enable")
            await dt.call("Emulation.setDeviceMetricsOverride", width=1200, height=720, deviceScaleFactor=1, mobile=False)
            await dt.call("Page.navigate", url=gateway.url + "/#mesh")

            async def until(expr, timeout, what):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if await dt.js(expr):
                        return
                    await asyncio.sleep(0.2)
                raise AssertionError(f"the page never showed {what}: {await dt.js('JSON.stringify(meshSnapshot)')}")

            async def shot(name):
                data = (await dt.call("Page.captureScreenshot", format="png"))["data"]
                path = os.path.join(output_dir, name)
                with open(path, "wb") as f:
                    f.write(base64.b64decode(data))
                shots[name] = path

            await until("document.getElementById('mesh-verdict').textContent === 'ready' && "
                        "!!document.getElementById('stage-1')", 20, "a ready mesh")
            assert await dt.js("getComputedStyle(document.getElementById('app')).display") == "none"  # chat hidden

            # under load: both stages busy, tokens/s and running sequences charted
            first = asyncio.create_task(load(gateway.url, 8, FIRST_TOKENS))  # ~8 s: several /info polls see it
            await until("meshSnapshot.gateway.running > 0 && meshSnapshot.stages.every(s => s.busy_fraction > 0.05) "
                        "&& meshSnapshot.gateway.tokens_per_s > 0", 60, "both stages busy under load")
            await asyncio.sleep(1.5)
            busy_text = await dt.js("document.querySelector('#stage-0').textContent")
            path_len = await dt.js("document.querySelector('#chart-tokens_per_s path').getAttribute('d').length")
            await shot("mesh-under-load.png")
            assert "busy (last 10 s)" in busy_text and "%" in busy_text and "compute per micro-batch" in busy_text
            assert path_len > 10  # the tokens/s chart has a drawn line
            assert all(r.success for r in await first)

            # a stage SIGKILLed mid-load: shown lost, then back (stagemesh up restarts it), replays counted
            # 96 tokens a stream: stopped after its first ~2, each has ~90 left to replay and finish
            second = asyncio.create_task(load(gateway.url, 8, 96))
            await until("meshSnapshot.gateway.running >= 8 && meshSnapshot.gateway.generated_tokens > "
                        f"{before['generated_tokens'] + 8 * FIRST_TOKENS + 16}", 60, "the second load running")
            # stopped first, so it stays lost until the page has shown it (killed at once, `up` could have it back
            # between two of the page's snapshots), then killed
            victim = stage_pid(gateway, 1)
            os.kill(victim, signal.SIGSTOP)
            try:
                await until("document.getElementById('stage-1').dataset.state === 'lost'", 30, "stage 1 lost")
                await shot("mesh-stage-lost.png")
                lost_text = await dt.js("document.getElementById('mesh-verdict').textContent")
            finally:
                os.kill(victim, signal.SIGKILL)
            await until("document.getElementById('stage-1').dataset.state !== 'lost' && "
                        "meshSnapshot.gateway.replayed_sequences > 0 && meshSnapshot.ready", 120, "stage 1 back")
            await shot("mesh-stage-back.png")
            back = await dt.js("JSON.stringify(meshSnapshot)")
            replayed_text = await dt.js("document.getElementById('gw-replayed').textContent")
            results = await second
    snap = json.loads(back)
    assert lost_text.startswith("NOT READY") and "stage 1" in lost_text
    assert snap["stages"][1]["restarts"] == restarts_before + 1
    assert snap["gateway"]["failovers"] > before["failovers"]
    assert snap["gateway"]["replayed_sequences"] > before["replayed_sequences"]
    assert replayed_text == f"replayed sequences {snap['gateway']['replayed_sequences']}"
    assert all(r.success for r in results), [r.error for r in results if not r.success]  # the clients saw a pause
    for path in shots.values():
        assert os.path.getsize(path) > 10_000


async def test_the_chat_page_counts_the_context_the_model_was_trained_for(gateway, chromium):  # noqa: F811
    """This `up` gives no context flag: the chat page's counter reads the model file's trained context (its GGUF
    context_length, 8192 for SmolLM2), which the stages serve where their memory holds it (issue 70 item 5)."""
    from shared.files.gguf_loader import GgufLoader
    from shared.files.model_registry import resolve_model

    trained = int(GgufLoader(resolve_model("smollm2")).arch_get("context_length"))
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(await page_ws_url(s, chromium), max_msg_size=0) as ws:
            dt = DevTools(ws)
            await dt.call("Page.enable")
            await dt.call("Page.navigate", url=gateway.url + "/")
            shown = None
            for _ in range(100):  # the counter is filled in once the page has read /v1/mesh
                shown = await dt.js("document.getElementById('ctx') && document.getElementById('ctx').textContent")
                if shown and shown.split("/")[-1].strip() not in ("", "0"):
                    break
                await asyncio.sleep(0.1)
    assert trained == 8192 and shown == f"context 0 / {trained}", shown


def test_the_snapshot_carries_the_stage_kv_fields_and_status_shows_them():
    """The mesh view's stage entry carries /info's KV fields under StageInfo's names, and `stagemesh status` reads
    them."""
    from rich.console import Console

    from services.cli.status import render
    from services.gateway.api.mesh_view import MeshView

    view = MeshView(gateway=None)
    info = make_info(clock_s=1.0, kv_slots=8, kv_slots_used=3, kv_max_seq_len=256, kv_slots_cached=2,
                     prefixes_evicted=1, kv_cached_bytes=12 * 2**20, kv_prefix_memory_bytes=4096 * 2**20,
                     kv_shared_bytes=300 * 2**20)
    view._take_polls("p0", [info])
    st = view._stage("p0", 0, "http://s0:8101", replaying=0)
    assert (st["kv_slots_used"], st["kv_slots"], st["kv_slots_cached"], st["prefixes_evicted"]) == (3, 8, 2, 1)
    console = Console(record=True, width=200)
    console.print(render({"ready": True, "stages": [st], "gateway": {}, "pipelines": []}))
    assert "3/8 (2 cached, 12 of 4096 MiB, 300 MiB shared)" in console.export_text()


def test_status_fits_80_columns_and_keeps_every_figure():
    """`stagemesh status` in an 80-column terminal: no line wider, no cell cut; the addresses and cached prefixes
    go on lines of their own, in words."""
    from rich.console import Console

    from services.cli.status import render
    from services.gateway.api.mesh_view import MeshView

    view = MeshView(gateway=None)
    infos = [make_info(clock_s=1.0, kv_slots=32, kv_slots_used=17, kv_max_seq_len=2048, kv_slots_cached=19,
                       kv_cached_bytes=169 * 2**20, kv_prefix_memory_bytes=4896 * 2**20, kv_shared_bytes=18 * 2**20,
                       layers=(15 * i, 15 * i + 15)) for i in range(2)]
    view._take_polls("p0", infos)
    stages = [view._stage("p0", i, f"http://127.0.0.1:4123{i}", replaying=0) for i in range(2)]
    for st in stages:
        st.update(listen="tcp://127.0.0.1:41299", busy_fraction=0.734, compute_ms=12.34, hop_next_ms=0.456)
    snap = {"ready": True, "stages": stages, "pipelines": [],
            "gateway": {"queue": 3, "running": 17, "inflight": 2, "max_inflight": 2, "tokens_per_s": 271.5,
                        "ttft_ms": 812.0, "failovers": 0, "replayed_sequences": 0,
                        "prefix_cache": {"prefixes": 19, "cached_tokens": 4096, "hits": 40, "lookups": 64,
                                         "hit_rate": 0.625, "reused_tokens": 30000, "evicted": 2, "misses": 24}}}
    console = Console(record=True, width=80)
    console.print(render(snap, console.width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for needed in ("0:15", "15:30", "73.4%", "12.3 ms", "0.46 ms", "17/32", "271.5 tok/s", "TTFT 812 ms",
                   "stage 1: http://127.0.0.1:41231 · tcp://127.0.0.1:41299\n  cached prefixes: 19 cached, 169 of "
                   "4896 MiB, 18 MiB shared", "hits 40/64 (62%)", "\nready"):
        assert needed in text, (needed, text)
