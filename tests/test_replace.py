"""A stage process at addresses of its own takes another's place in a running pipeline (issue 58, item 4):
POST /v1/mesh/replace {"stage": I, "url": ...} (services/gateway/engine/core.py Engine.replace_stage). The stage before
place I (the gateway for place 0) is told by a reroute message to send to the newcomer, the message's return over
the new route shows it carries, and the running requests replay. Real processes on loopback: a 2-stage mesh with
CURVE and --batch-invariant, a gateway, and newcomers started with a stage's own flags at new ports -- the way a
stage on another machine would be started."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.conftest import stagemesh_cmd

STREAMS = 4
MAX_TOKENS = 96
PROMPT = "Note {i}: when the ferry left the harbour the captain"


async def _streams(url: str, on_token=None) -> list[str]:
    from services.testing.harness import seeded_streams

    return await seeded_streams(url, PROMPT, 700, STREAMS, MAX_TOKENS, on_token)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Mesh:
    """The module's stages, gateway and the newcomers started for it."""

    def __init__(self, mesh, gw, log_dir: str):
        self.mesh, self.gw, self.log_dir = mesh, gw, log_dir
        self.newcomers = []
        # the undisturbed run's texts (_streams) on the stages the module started, kept by the first test that
        # computes them: until a replacement is done every test finds that same mesh, so every later one reuses them
        self.reference: list[str] | None = None

    def newcomer(self, like: int, *extra: str):
        """A stage process started with stage `like`'s own flags (range, keys, next hop) at new ports, `extra` flags
        last (argparse: the last of a flag given twice wins), ready."""
        from services.process.launch import StageProcess, free_ports, wait_ready

        listen_port, http_port = free_ports(2)
        args = [*self.mesh.stages[like].args, *extra]
        args[args.index("--listen") + 1] = f"tcp://127.0.0.1:{listen_port}"
        args[args.index("--http") + 1] = f"127.0.0.1:{http_port}"
        n = len(self.newcomers)
        stage = StageProcess(like, f"tcp://127.0.0.1:{listen_port}", f"127.0.0.1:{http_port}", None, args,
                             os.path.join(self.log_dir, f"newcomer{n}.log"), self.mesh.stages[like].env)
        stage.proc = stage.spawn("w")
        self.newcomers.append(stage)
        wait_ready([stage.url], 120, procs=[stage.proc], log_paths=[stage.log_path])
        return stage

    def stage_urls(self) -> list[str]:
        return json.loads(self.gw.get("/ready")[1])["stages"]


@pytest.fixture(scope="module")
def replaceable(tmp_path_factory):
    from services.testing.harness import mesh_and_gateway

    log_dir = str(tmp_path_factory.mktemp("replace"))
    with mesh_and_gateway(2, log_dir, stage_flags=["--batch-invariant"]) as (mesh, gw):
        m = Mesh(mesh, gw, log_dir)
        try:
            yield m
        finally:
            for s in m.newcomers:
                if s.proc.poll() is None:
                    s.proc.kill()


@pytest.mark.processes
def test_a_process_that_does_not_fit_the_place_is_refused_and_the_pipeline_serves_on(replaceable):
    m = replaceable
    stage1_like = m.newcomer(1)
    bf16 = m.newcomer(1, "--dtype", "bfloat16")
    before = m.stage_urls()
    cases = [
        ({"stage": 0, "url": stage1_like.url}, 400, "start it with --layers 0:"),  # another place's range
        ({"stage": 1, "url": "http://127.0.0.1:9"}, 400, "does not answer"),  # nothing there
        ({"stage": 1, "url": bf16.url}, 400, "computes in bfloat16"),
        ({"stage": 1, "url": before[0]}, 400, "already serves stage 0"),
        ({"stage": 2, "url": stage1_like.url}, 400, "stages 0..1"),
        ({"stage": "1", "url": stage1_like.url}, 400, "stage must be the index"),
        ({"stage": 1, "url": "tcp://127.0.0.1:5551"}, 400, "url must be the new stage process's HTTP address"),
        ({"stage": 1, "url": stage1_like.url, "keys": "x"}, 400, "unknown field 'keys'"),
    ]
    for body, status, says in cases:
        got, answer = _post(m.gw.url + "/v1/mesh/replace", body)
        assert got == status and says in answer["error"]["message"], (body, got, answer)
    assert m.stage_urls() == before
    assert m.gw.get("/ready")[0] == 200
    assert m.gw.metric("stagemesh_gateway_stage_replacements_total", outcome="done") == 0
    for s in (stage1_like, bf16):
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(30)


class Mirror:
    """A tiny HTTP server in this process answering /info with `info` (a copy of a real stage's, edited), or as
    `handler` does: what an operator key could point /v1/mesh/replace at."""

    def __init__(self, info: dict | None = None, handler=None):
        self.info, self.handler = info, handler
        self.runner = None
        self.url = ""

    async def __aenter__(self):
        from aiohttp import web

        from services.process.launch import free_ports

        app = web.Application()

        async def info(request: web.Request) -> web.Response:
            return web.json_response(self.info)

        app.router.add_get("/info", self.handler or info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port, = free_ports(1)
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@pytest.mark.timing
@pytest.mark.processes
async def test_a_copy_of_a_stage_info_is_refused_in_about_a_second_and_nothing_pauses(replaceable, tmp_path):
    """Issue 69 item 4: /info is copyable (public keys included), the place's secret key is not. A mirror of stage
    1's /info is refused 400 whatever its listen says: the same incarnation (a verbatim copy), stage 1's own address,
    an address where nothing listens, a process holding another key set's stage 1 pair -- the last two by the probe,
    a CURVE handshake with stage 1's public key that only its secret can complete, each in about a second. Meanwhile
    streams go on with no gap much longer than an undisturbed run's, and with its texts, and /ready stays 200."""
    from services.process.launch import free_ports
    from shared.wire.mesh_keys import KeySet, write_key_set
    from shared.wire.protocol import Resplit
    from shared.wire.transport import ZmqTransport

    m = replaceable
    reference_times: list[float] = []
    reference = await _streams(m.gw.url, lambda least: reference_times.append(time.perf_counter()))
    m.reference = reference
    before = m.stage_urls()
    with urllib.request.urlopen(before[1] + "/info", timeout=5) as r:
        real = json.loads(r.read())
    write_key_set(str(tmp_path / "other"), 2)
    empty_port, impostor_port = free_ports(2)
    impostor = ZmqTransport(f"tcp://127.0.0.1:{impostor_port}", None, (Resplit,),
                            keys=KeySet(str(tmp_path / "other")).for_stage(1, last=True))
    fresh = {**real, "incarnation": "0123456789ab"}
    cases = [
        (real, "names stage 1's incarnation", 1.0),
        ({**fresh, "listen": real["listen"]}, "is where stage 1 receives", 1.0),
        # a probe: its hand-over's wait (a failed handshake answers at once, silence after PROBE_S) and its trip
        # through the serving mesh (a step or two of a loaded stage's queue); the old reroute waited 30 s
        ({**fresh, "listen": f"tcp://127.0.0.1:{empty_port}"}, "completed a handshake within 1 s", 3.0),
        ({**fresh, "listen": f"tcp://127.0.0.1:{impostor_port}"}, "does not hold stage1's secret key", 3.0),
    ]
    loop = asyncio.get_running_loop()
    started, answers, chunk_times = loop.create_future(), [], []

    def on_token(least: int) -> None:
        chunk_times.append(time.perf_counter())
        if least >= 8 and not started.done():
            started.set_result(None)

    async def replace_with_mirrors() -> None:
        await started
        for info, says, within in cases:
            async with Mirror(info) as mirror:
                t0 = time.perf_counter()
                status, answer = await asyncio.to_thread(_post, m.gw.url + "/v1/mesh/replace",
                                                         {"stage": 1, "url": mirror.url})
                answers.append((status, answer, time.perf_counter() - t0, says, within))
                assert m.gw.get("/ready")[0] == 200

    try:
        texts, _ = await asyncio.wait_for(asyncio.gather(_streams(m.gw.url, on_token), replace_with_mirrors()), 300)
        with pytest.raises(TimeoutError):  # nothing the probe carried reached the impostor
            await asyncio.wait_for(impostor.receive(), 0.2)
    finally:
        impostor.close()
    for status, answer, took, says, within in answers:
        message = answer["error"]["message"]
        assert status == 400 and says in message and took < within, (status, message, took)
    assert "nothing was paused" in answers[-1][1]["error"]["message"]
    assert texts == reference
    def worst_gap(times: list[float]) -> float:
        return max(b - a for a, b in zip(times, times[1:]))

    # the old reroute wait froze every stream for 30 s; a shared CPU makes an undisturbed run's gaps vary by ~1 s
    assert worst_gap(chunk_times) < worst_gap(reference_times) + 1.5, (worst_gap(chunk_times),
                                                                      worst_gap(reference_times))
    assert m.stage_urls() == before and m.gw.get("/ready")[0] == 200
    assert m.gw.metric("stagemesh_gateway_stage_replacements_total", outcome="done") == 0
    assert m.gw.metric("stagemesh_gateway_stage_replacements_total", outcome="refused") == 2  # the probes' two


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.processes
async def test_replace_follows_no_redirect_and_reads_at_most_a_few_mib_of_an_info(replaceable):
    """Issue 69 item 5: an /info that redirects (here to the real stage 1's, which a follower would read) is refused
    naming the redirect; one that never ends, or declares 3 GiB, is refused naming the cap without the gateway's
    memory growing by more than a few MiB -- the gateway and the CLI's reader (read_info) alike."""
    from aiohttp import web

    from shared.wire.stage_info import MAX_INFO_BYTES, InfoError, read_info

    m = replaceable
    before = m.stage_urls()
    sent = [0]

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(before[1] + "/info")

    async def endless(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse()
        await r.prepare(request)
        chunk = b" " * (1 << 20)
        with contextlib.suppress(ConnectionError):
            for _ in range(2048):  # 2 GiB at most, as fast as the reader takes it
                await r.write(chunk)
                sent[0] += len(chunk)
        return r

    async def declared(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Length": str(3 << 30)})
        with contextlib.suppress(ConnectionError):
            await r.prepare(request)
            await r.write(b"{")
        return r

    rss = _rss_bytes(m.gw.proc.pid)
    cap = f"larger than {MAX_INFO_BYTES >> 20} MiB"
    cases = [(redirect, f"answered 302, a redirect to {before[1]}/info: not followed"), (endless, cap),
             (declared, cap)]
    for handler, says in cases:
        async with Mirror(handler=handler) as mirror:
            t0 = time.perf_counter()
            status, answer = await asyncio.to_thread(_post, m.gw.url + "/v1/mesh/replace",
                                                     {"stage": 1, "url": mirror.url})
            took = time.perf_counter() - t0
            assert status == 400 and says in answer["error"]["message"] and took < 2.5, (status, answer, took)
            with pytest.raises(InfoError) as refused:
                await asyncio.to_thread(read_info, mirror.url, 5)
            assert says in str(refused.value), refused.value
    assert MAX_INFO_BYTES < sent[0] < 64 * MAX_INFO_BYTES  # it was read from, and stopped soon after the cap
    assert _rss_bytes(m.gw.proc.pid) - rss < 32 << 20
    assert m.stage_urls() == before and m.gw.get("/ready")[0] == 200


@pytest.mark.timing
@pytest.mark.processes
async def test_a_newcomer_takes_a_leaving_stage_place_then_a_dead_ones_and_no_text_changes(replaceable):
    """Stage 1 leaves by plan: a newcomer takes its place mid-stream (POST replace), then the old process stops.
    Then stage 0 dies mid-stream and a newcomer takes its place (`stagemesh rebalance --replace`; the gateway itself
    sends to it) -- a newcomer started with the dead stage's own flags, whose --next is the stage 1 that left: the
    reroute points it at the stage now serving place 1. Every stream ends with the undisturbed run's text, nothing
    fails, and each newcomer computes from then on."""
    m = replaceable
    gw = m.gw
    assert gw.metric("stagemesh_gateway_stage_replacements_total", outcome="done") == 0  # the module's own stages
    if m.reference is None:
        m.reference = await _streams(gw.url)
    reference = m.reference
    loop = asyncio.get_running_loop()

    # stage 1 leaves by plan
    newcomer = m.newcomer(1)
    leaving = m.mesh.stages[1]
    replaced = loop.create_future()

    def replace_midway(least: int) -> None:
        if least >= MAX_TOKENS // 3 and not replaced.done():
            replaced.set_result(None)
            asyncio.ensure_future(replace_then_stop())

    async def replace_then_stop() -> None:
        status, answer = await asyncio.to_thread(_post, gw.url + "/v1/mesh/replace", {"stage": 1, "url": newcomer.url})
        outcome.set_result((status, answer))
        leaving.proc.send_signal(signal.SIGTERM)

    outcome = loop.create_future()
    texts = await asyncio.wait_for(_streams(gw.url, replace_midway), 600)
    status, answer = await asyncio.wait_for(outcome, 60)
    assert status == 200 and answer["stage"] == 1 and answer["url"] == newcomer.url, answer
    assert answer["listen"] == newcomer.listen and answer["leaving_answered"], answer
    assert texts == reference
    assert m.stage_urls()[1] == newcomer.url
    leaving.proc.wait(30)
    assert newcomer.info().microbatches > 0

    # stage 0 dies; a newcomer takes its place
    newcomer0 = m.newcomer(0)
    dead = m.mesh.stages[0]
    killed = loop.create_future()

    def kill_midway(least: int) -> None:
        if least >= MAX_TOKENS // 3 and not killed.done():
            os.kill(dead.proc.pid, signal.SIGKILL)
            killed.set_result(None)
            asyncio.ensure_future(replace_dead())

    async def replace_dead() -> None:  # by the command an operator runs
        await asyncio.sleep(0.5)
        proc = await asyncio.create_subprocess_exec(
            *stagemesh_cmd("rebalance", gw.url, "--replace", f"0={newcomer0.url}", "--json"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        outcome0.set_result((200 if proc.returncode == 0 else err.decode(), json.loads(out) if out else {}))

    outcome0 = loop.create_future()
    texts = await asyncio.wait_for(_streams(gw.url, kill_midway), 600)
    status, answer = await asyncio.wait_for(outcome0, 60)
    assert status == 200 and answer["stage"] == 0 and not answer["leaving_answered"], answer
    assert texts == reference
    assert m.stage_urls() == [newcomer0.url, newcomer.url]
    assert newcomer0.info().microbatches > 0
    assert gw.metric("stagemesh_gateway_stage_replacements_total", outcome="done") == 2
    shown = json.loads(gw.get("/v1/mesh")[1])["pipelines"][0]["replacements"]
    assert [(r["stage"], r["url"], r["outcome"]) for r in shown if r["outcome"] == "done"] == [
        (1, newcomer.url, "done"), (0, newcomer0.url, "done")], shown
    status = subprocess.run(stagemesh_cmd("status", gw.url), capture_output=True, text=True, timeout=60)
    assert f"stage 0 replaced by {newcomer0.url}" in status.stdout, status.stdout + status.stderr
    assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
    assert await _streams(gw.url) == reference  # and it serves on
