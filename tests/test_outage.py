"""Faults and insiders against one gateway over a 2-stage mesh (issue 31): clients leaving during an outage, slots held
by someone the gateway does not know, a stage restarted with another key set, two stage deaths in one request, an
authenticated peer sending what it should not, and a stage whose /info is malformed. Real stage processes and a real
`stagemesh gateway` process on loopback, SmolLM2 in float32."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import aiohttp
import pytest
import torch
import zmq

from loadtest.client import sse_events
from services.process.launch import LocalMesh, free_ports, start_mesh, wait_ready
from services.testing.harness import RunningGateway
from shared.batch.steps import Decode, Prefill
from shared.wire.mesh_keys import KeySet, write_key_set
from shared.wire.protocol import BatchError, BatchResult, ForwardBatch, ReleaseSeqs, SeqEntry, encode
from tests.conftest import stagemesh_cmd, starts_processes
from tests.test_curve import push

KV_SLOTS = 4
POLL_S = 0.5  # the gateway's --stage-poll (2 s by default): each malformed /info, restart or lost hop is seen in one
STALL_S = 3  # the gateway's --stall-timeout: well above any micro-batch here and 2.5 s above the poll that notices a
# dead stage first (a death is a failover, never a stall), short enough for a test: each of the lost-hop test's 3
# replays waits it out twice


class InfoProxy:
    """An HTTP proxy in front of one stage's endpoint (a thread): forwards every GET, except that /info answers
    `info_body` while it is set -- a stage whose /info is malformed, without touching the stage."""

    def __init__(self, target: str):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                status, body = proxy.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.target = target
        self.info_body: bytes | None = None
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str) -> tuple[int, bytes]:
        if path == "/info" and self.info_body is not None:
            return 200, self.info_body
        try:
            with urllib.request.urlopen(self.target + path, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError as e:
            return 502, f'{{"error": "{type(e).__name__}"}}'.encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Outage:
    """The module's mesh, the proxy in front of stage 1's HTTP, and the gateway (a RunningGateway)."""

    def __init__(self, mesh: LocalMesh, proxy: InfoProxy, gw: RunningGateway):
        self.mesh, self.proxy, self.gw = mesh, proxy, gw

    def kv_used(self) -> list[int]:
        return [s.info().kv_slots_used for s in self.mesh.stages]

    def metric(self, name: str, **labels: str) -> float:
        value = self.gw.metric(name, **labels)
        return 0.0 if value != value else value

    def restart(self, index: int, args: list[str] | None = None) -> None:
        """Kill stage `index` (if it runs) and start it again (with `args` as its command line when given)."""
        stage = self.mesh.stages[index]
        if stage.proc.poll() is None:
            stage.proc.kill()
            stage.proc.wait()
        if args is not None:
            stage.args = args
        self.mesh.restart_dead()

    def ready(self) -> tuple[int, str]:
        return self.gw.get("/ready")


@pytest.fixture(scope="module")
@starts_processes
def outage(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("outage"))
    mesh = start_mesh("smollm2", 2, dtype="float32", log_dir=log_dir, extra=["--kv-slots", str(KV_SLOTS)])
    proxy = InfoProxy(mesh.stages[1].url)
    port, = free_ports(1)
    log_path = os.path.join(log_dir, "gateway.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(stagemesh_cmd("gateway", "--model", "smollm2", "--stages",
                                              f"{mesh.stages[0].url},{proxy.url}", "--listen", f"127.0.0.1:{port}",
                                              "--result-listen", mesh.result_listen, "--keys", mesh.keys_dir,
                                              "--stall-timeout", str(STALL_S), "--stage-poll", str(POLL_S)),
                                stdout=log, stderr=subprocess.STDOUT)
    gw = RunningGateway(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_until(lambda: _ready(gw), 120, "the gateway never became ready")
        yield Outage(mesh, proxy, gw)
    finally:
        gw.stop()
        proxy.close()
        mesh.stop()


@pytest.fixture
def clean(outage):
    """The module's mesh as each test wants it: both stages up, the gateway ready and no slot held. A test that
    failed half-way leaves no stranger's slot or dead stage to the next one."""
    outage.mesh.restart_dead()
    outage.proxy.info_body = None
    wait_until(lambda: _ready(outage.gw), 120, "the gateway is not ready before the test")
    wait_until(lambda: outage.metric("stagemesh_gateway_running_sequences") == 0, 30, "requests still running")
    if outage.kv_used() != [0, 0]:
        push_as_gateway(outage.mesh, [ReleaseSeqs([], everything=True)])
        wait_until(lambda: outage.kv_used() == [0, 0], 10, "slots still held before the test")
    return outage


def stage_metric(stage, name: str, **labels: str) -> float:
    from services.testing.harness import scrape_metric

    with urllib.request.urlopen(f"{stage.url}/metrics", timeout=5) as r:
        value = scrape_metric(r.read().decode(), name, labels or None)
    return 0.0 if value != value else value


def _ready(gw: RunningGateway) -> bool:
    assert gw.proc.poll() is None, open(gw.log_path).read()[-3000:]
    try:
        return gw.get("/ready")[0] == 200
    except OSError:
        return False


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `cond` (every 0.2 s) until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (after {timeout:g} s)")
        time.sleep(0.2)


async def async_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (after {timeout:g} s)")
        await asyncio.sleep(0.2)


async def stream(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: {"tokens": completion tokens, "finish": finish_reason, "error": error or None}."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"tokens": 0, "finish": None, "error": None}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {**out, "error": f"HTTP {r.status}: {await r.text()}"}
        async for chunk in sse_events(r):
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                out["finish"] = c["finish_reason"] or out["finish"]
    return out


def push_as_gateway(mesh: LocalMesh, messages: list) -> None:
    """Send messages into stage 0 from a fresh socket holding the gateway's keys (an insider, or a second gateway);
    returns once they have left the socket. What stage 1 answers goes to the real gateway's result socket."""
    keys = KeySet(mesh.keys_dir).for_gateway()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.next_server, keys.send.public, keys.send.secret
    sock.connect(mesh.first_stage)
    for msg in messages:
        sock.send_multipart(encode(msg))
    sock.close(linger=10_000)
    ctx.term()


# micro-batch ids far beyond any the gateway's client hands out, so a forged result never matches one in flight
FOREIGN_MB = 1 << 40


def squatters(n: int, tokens: list[int]) -> list[ForwardBatch]:
    """Micro-batches that start n sequences the gateway does not know of (each takes a KV slot on every stage)."""
    k = len(tokens)
    return [ForwardBatch(FOREIGN_MB + i, [SeqEntry(f"squatter-{i}", Prefill(k, 0, k, True))],
                         tokens=torch.tensor(tokens, dtype=torch.int64)) for i in range(n)]


# ---- High 1: slots -------------------------------------------------------------------------------------------------

async def test_slots_held_by_strangers_requeue_new_requests_and_never_fail_running_ones(clean, smollm2):
    """Two requests run; two sequences the gateway does not know of fill the other two slots; two more requests are
    admitted (the gateway counts 4 slots) and stage 0 answers kv_full: the new ones wait in the queue, the running
    ones go on, and once the strangers' slots are freed every request completes."""
    url = clean.gw.url
    errors_before = clean.metric("stagemesh_gateway_requests_total", outcome="error")
    # 200 tokens: ~10 s, several times the few seconds until the strangers' slots are freed (asserted below)
    running = [asyncio.create_task(stream(url, f"Tell a long story about ship {i}.", 200)) for i in range(2)]
    await async_until(lambda: clean.kv_used() == [2, 2], 60, "the two running requests never took their slots")
    strangers = squatters(2, smollm2.tokenizer.encode("Someone else's prompt"))
    await asyncio.to_thread(push_as_gateway, clean.mesh, strangers)
    await async_until(lambda: clean.kv_used() == [4, 4], 30, "the strangers never took the other two slots")
    stage0 = clean.mesh.stages[0]
    refused = stage_metric(stage0, "stagemesh_stage_microbatch_errors_total")
    late = [asyncio.create_task(stream(url, f"Name three rivers, take {i}.", 12)) for i in range(2)]
    await async_until(lambda: stage_metric(stage0, "stagemesh_stage_microbatch_errors_total") > refused, 30,
                      "stage 0 never answered kv_full")
    await asyncio.to_thread(push_as_gateway, clean.mesh, [ReleaseSeqs([s.seqs[0].seq_id for s in strangers])])
    assert not any(t.done() for t in running), [t.result() for t in running if t.done()]  # they ran through it all
    results = await asyncio.wait_for(asyncio.gather(*running, *late), 180)
    for r, want in zip(results, [200, 200, 12, 12]):
        assert r["error"] is None and r["finish"] == "length" and r["tokens"] == want, r
    assert clean.metric("stagemesh_gateway_requests_total", outcome="error") == errors_before
    assert clean.metric("stagemesh_gateway_kv_full_requeued_sequences_total") >= 1  # they really were refused once
    await async_until(lambda: clean.kv_used() == [0, 0], 10, "slots still held after every request finished")


async def test_clients_leaving_during_an_outage_leave_no_slot_held(clean):
    """Four streams run; stage 1 is killed; once the gateway has reset them for replay the clients leave; stage 1
    comes back: the slots the survivor (stage 0) held for them are released within seconds, not at the lease's end,
    and all four slots serve new requests."""
    url = clean.gw.url
    failovers = clean.metric("stagemesh_gateway_pipeline_failovers_total")
    cancelled = clean.metric("stagemesh_gateway_requests_total", outcome="cancelled")
    streams = [asyncio.create_task(stream(url, f"Describe city number {i} in detail.", 400)) for i in range(4)]
    await async_until(lambda: clean.kv_used() == [4, 4], 60, "the four streams never took their slots")
    victim = clean.mesh.stages[1].proc
    victim.kill()
    victim.wait()
    await async_until(lambda: clean.metric("stagemesh_gateway_pipeline_failovers_total") > failovers, 30,
                      "the gateway never noticed the dead stage")
    for t in streams:
        t.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    await async_until(lambda: clean.metric("stagemesh_gateway_requests_total", outcome="cancelled") >= cancelled + 4,
                      10, "the gateway never saw the clients leave")
    assert clean.mesh.stages[0].info().kv_slots_used == 4  # the survivor still holds them
    clean.mesh.restart_dead()
    await async_until(lambda: _ready(clean.gw), 120, "the gateway never became ready again")
    await async_until(lambda: clean.kv_used() == [0, 0], 10, "the survivor kept the leavers' slots")
    results = await asyncio.wait_for(asyncio.gather(*(stream(url, f"Count to {i + 3}.", 6) for i in range(4))), 120)
    assert all(r["error"] is None and r["tokens"] == 6 for r in results), results


# ---- High 2: a stage with another key set ------------------------------------------------------------------------

def _problem(o: Outage) -> str:
    status, body = o.ready()
    return "" if status == 200 else json.loads(body)["problem"] or ""


async def test_a_stage_with_another_key_set_makes_the_pipeline_not_ready_naming_the_hop(clean, smollm2, tmp_path):
    """Stage 1 restarts with another key set: every handshake on its hops fails. The gateway says so within seconds,
    naming the hop -- first from the keys each /info reports, then, with stage 1's /info lying (the right keys, the
    old incarnation), from stage 0's failed dials alone -- and refuses requests instead of letting them hang."""
    other = str(tmp_path / "other-keys")
    write_key_set(other, 2)
    stage0, stage1 = clean.mesh.stages
    good_args = list(stage1.args)
    good_info = stage1.info()
    try:
        clean.restart(1, [other if a == clean.mesh.keys_dir else a for a in good_args])
        await asyncio.to_thread(wait_ready, [stage1.url], 120, [stage1.proc])
        await async_until(lambda: "hop stage 0 -> stage 1: stage 1 holds another key set" in _problem(clean), 15,
                          "the gateway never named the hop to the stage with another key set")
        refused = await stream(clean.gw.url, "Say hello.", 4)
        assert refused["error"] and "HTTP 503" in refused["error"] and "stage 1" in refused["error"], refused
        clean.proxy.info_body = json.dumps(good_info.to_json()).encode()  # /info claims the mesh's keys
        await async_until(lambda: "hop stage 0 -> stage 1:" in _problem(clean)
                          and "handshakes failed" in _problem(clean), 15,
                          "the gateway never noticed stage 0's failed handshakes")
        assert stage0.info().handshakes_failed["out"] > 0
        assert stage_metric(stage1, "stagemesh_stage_rejected_messages_total", reason="handshake") > 0
    finally:
        clean.proxy.info_body = None
        clean.restart(1, good_args)
    await asyncio.to_thread(wait_ready, [stage1.url], 120, [stage1.proc])
    await async_until(lambda: _ready(clean.gw), 30, "the gateway never became ready with the mesh's keys back")
    result = await stream(clean.gw.url, "Say hello.", 4)
    assert result["error"] is None and result["tokens"] == 4, result


class Decoy:
    """A PULL socket holding stage 1's server keys (a thread): what a mis-set --next or a stale DNS entry reaches.
    Its handshakes succeed, so nothing fails but the micro-batches themselves, which it swallows and counts."""

    def __init__(self, keys_dir: str):
        pair = KeySet(keys_dir).pair("stage1")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.curve_server, self.sock.curve_publickey, self.sock.curve_secretkey = True, pair.public, pair.secret
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.swallowed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
                self.swallowed += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.parametrize("prompts", [[("Explain tides to a child.", 30), ("List prime numbers below fifty, "
                                                                        "with a remark about each one.", 9)]])
async def test_micro_batches_lost_past_a_healthy_looking_stage_make_the_pipeline_not_ready_naming_the_hop(
        clean, prompts):
    """Stage 0 restarts with its next hop at a decoy holding stage 1's keys: every handshake succeeds and every
    /info is right, yet each micro-batch vanishes. Within the stall bound (plus a poll) the gateway says so, naming
    the hop (stage 0 passed the micro-batch on, stage 1 never took it in); the requests are replayed while their
    replays last and then end with an error that names the hop -- never a hang to their deadline. With stage 0's
    next hop right again, a request completes."""
    stage0 = clean.mesh.stages[0]
    good_args = list(stage0.args)
    decoy = Decoy(clean.mesh.keys_dir)
    i = good_args.index("--next")
    try:
        clean.restart(0, good_args[:i + 1] + [decoy.address] + good_args[i + 2:])
        await asyncio.to_thread(wait_ready, [stage0.url], 120, [stage0.proc])
        await async_until(lambda: _ready(clean.gw), 30, "the gateway never took the restarted stage 0")
        t0 = time.monotonic()
        streams = [asyncio.create_task(stream(clean.gw.url, p, n)) for p, n in prompts]
        await async_until(lambda: "hop stage 0 -> stage 1" in _problem(clean), STALL_S + 10,
                          "the gateway never named the hop that loses micro-batches")
        assert "never took it in" in _problem(clean), _problem(clean)
        assert time.monotonic() - t0 < STALL_S + 10
        assert decoy.swallowed > 0  # the micro-batches really left stage 0
        results = await asyncio.wait_for(asyncio.gather(*streams), 12 * (STALL_S + 4))
        for r in results:
            assert r["tokens"] == 0 and "hop stage 0 -> stage 1" in str(r["error"]), r
    finally:
        clean.restart(0, good_args)
        decoy.close()
    await asyncio.to_thread(wait_ready, [stage0.url], 120, [stage0.proc])
    await async_until(lambda: _ready(clean.gw), 30, "the gateway never became ready with stage 0 right again")
    result = await stream(clean.gw.url, "Say hello.", 4)
    assert result["error"] is None and result["tokens"] == 4, result


# ---- Medium 4: two deaths in one request ------------------------------------------------------------------------

async def test_two_stage_deaths_in_one_request_cost_two_replays_and_every_stream_completes(clean):
    """Stage 1, then stage 0, is killed and restarted while three streams run (each death is noticed: the stage
    unreachable and then its new incarnation, or only the new incarnation when the stage is back before the gateway's
    next poll -- SmolLM2's stage 0 reloads in ~0.3 s from the page cache). Replays are counted when sent, so two
    deaths cost two of the three a request may have, and every stream completes."""
    url = clean.gw.url
    replayed = clean.metric("stagemesh_gateway_replayed_sequences_total")
    # 120 tokens: the streams are paused while a stage is down; each death lands mid-stream (asserted below)
    streams = [asyncio.create_task(stream(url, f"Write a long letter to friend number {i}.", 120)) for i in range(3)]
    await async_until(lambda: clean.kv_used() == [3, 3], 60, "the three streams never took their slots")
    for victim in (1, 0):
        failovers = clean.metric("stagemesh_gateway_pipeline_failovers_total")
        clean.restart(victim)  # SIGKILL, then the same command again
        await async_until(lambda f=failovers: clean.metric("stagemesh_gateway_pipeline_failovers_total") >= f + 1,
                          120, f"the gateway never saw stage {victim} die and come back")
        await async_until(lambda: _ready(clean.gw), 60, "the gateway never became ready again")
        assert not any(t.done() for t in streams), [t.result() for t in streams if t.done()]  # both deaths mid-stream
    results = await asyncio.wait_for(asyncio.gather(*streams), 300)
    assert all(r["error"] is None and r["tokens"] == 120 for r in results), results
    assert clean.metric("stagemesh_gateway_replayed_sequences_total") - replayed == 6  # 3 sequences x 2 deaths


# ---- Medium 6: an authenticated peer ------------------------------------------------------------------------------

def _forward(mb: int, seq_id: str, tokens: list[int]) -> ForwardBatch:
    k = len(tokens)
    return ForwardBatch(mb, [SeqEntry(seq_id, Prefill(k, 0, k, True))], tokens=torch.tensor(tokens, dtype=torch.int64))


async def test_an_insider_cannot_crash_a_stage_or_end_requests(clean, smollm2):
    """The gateway's key holder sends token ids outside the vocabulary (stage 0 once died of an IndexError), decodes of
    sequences nobody started, and well-formed work under micro-batch ids the gateway never sent, while a request runs:
    each is answered as an error of its own micro-batch, every answer the gateway did not ask for is dropped and
    counted, no failover happens, and the running request completes."""
    vocab = smollm2.config.vocab_size
    good = smollm2.tokenizer.encode("An ordinary prompt")
    hostile = [_forward(FOREIGN_MB + i, f"bad-{i}", ids) for i, ids in enumerate([
        [vocab], [-1], good + [vocab + 12345], [1 << 40], [-(1 << 40), 5], [0, vocab - 1, vocab]])]
    strays = [_forward(FOREIGN_MB + 100, "stray", good)]  # valid work, but no micro-batch of the gateway's
    strays.append(ForwardBatch(FOREIGN_MB + 101, [SeqEntry("nobody", Decode(7))], tokens=torch.tensor([42])))
    stage0 = clean.mesh.stages[0]
    errors = stage_metric(stage0, "stagemesh_stage_microbatch_errors_total")
    unexpected = clean.metric("stagemesh_gateway_unexpected_results_total")
    failovers = clean.metric("stagemesh_gateway_pipeline_failovers_total")
    running = asyncio.create_task(stream(clean.gw.url, "Tell me about lighthouses.", 48))
    await async_until(lambda: clean.kv_used() == [1, 1], 60, "the request never started")
    await asyncio.to_thread(push_as_gateway, clean.mesh, hostile + strays + [ReleaseSeqs(["stray"])])
    await async_until(lambda: clean.metric("stagemesh_gateway_unexpected_results_total") >= unexpected + 8, 30,
                      "the gateway never received the answers to the insider's micro-batches")
    assert all(s.proc.poll() is None for s in clean.mesh.stages)  # nothing crashed
    assert stage_metric(stage0, "stagemesh_stage_microbatch_errors_total") == errors + len(hostile) + 1  # + nobody
    result = await asyncio.wait_for(running, 120)
    assert result["error"] is None and result["tokens"] == 48, result
    assert clean.metric("stagemesh_gateway_pipeline_failovers_total") == failovers
    await async_until(lambda: clean.kv_used() == [0, 0], 10, "a slot is still held")


# ---- Medium 7: a malformed /info --------------------------------------------------------------------------------

# each malformed /info and what the gateway's problem must say is wrong with it
MALFORMED_INFO = [(b"[1, 2, 3]", "a JSON list, not an object"), (b'"ready"', "a JSON str, not an object"),
                  (b"null", "a JSON NoneType, not an object"), (b"{not json", "not JSON"),
                  (b"{}", "field 'model' is missing"), (b"\xff\xfe", "not JSON"),
                  (b'{"fingerprint": 7, "layers": [0, 30]}', "field 'model' is missing")]
INFO_CHANGES = [({"layers": "0:30"}, "'layers' must be a list of 2 integers"),
                ({"layers": [0, "30"]}, "'layers' must be a non-negative integer"),
                ({"kv_slots": "4"}, "'kv_slots' must be a non-negative integer"),
                ({"kv_max_seq_len": None}, "'kv_max_seq_len' must be a non-negative integer"),
                ({"kv_slots": 0}, "'kv_slots' and 'kv_max_seq_len' must be at least 1"),
                ({"incarnation": ["x"]}, "'incarnation' must be a string"),
                ({"keys": {"public": 5}}, "'keys' must be null or an object of public keys"),
                ({"handshakes_failed": {"out": "many"}}, "'handshakes_failed' must be a non-negative integer"),
                ({"layers": [9, 3]}, "'layers' must be [start, stop) within 30 layers"),
                ({"busy_seconds": -1.0}, "'busy_seconds' must be a non-negative number"),
                ({"recent_mb_in": list(range(2000))}, "'recent_mb_in' must be a list of integers")]


async def test_a_malformed_info_is_a_problem_named_and_the_poller_lives_on(clean):
    """Stage 1's /info answers nonsense of several shapes, one after another: each makes the pipeline not ready with
    a problem naming stage 1 and what is wrong (each body's own words, so the poll that read it, not an earlier
    one, made the problem: the bodies follow one another with no good /info between them unless two in a row would
    say the same, one gateway poll each instead of two); only a living poller can notice each next body, and the
    right /info back makes it ready again; a request completes."""
    good = clean.mesh.stages[1].info().to_json()
    missing = {k: v for k, v in good.items() if k != "kv_slots"}
    bodies = MALFORMED_INFO + [(json.dumps(missing).encode(), "field 'kv_slots' is missing")] + [
        (json.dumps({**good, **change}).encode(), says) for change, says in INFO_CHANGES]
    try:
        said = None
        for body, says in bodies:
            if says == said:  # the same words as the body before: ready in between, so this one is a fresh problem
                clean.proxy.info_body = None
                await async_until(lambda: _ready(clean.gw), 15, f"the poller did not survive /info {body[-80:]!r}")
            clean.proxy.info_body = body
            await async_until(lambda s=says: s in _problem(clean), 15,
                              f"the gateway never refused /info {body[-80:]!r} saying {says!r}: {_problem(clean)!r}")
            problem = _problem(clean)
            assert "stage 1 is not usable" in problem and "malformed" in problem and says in problem, problem
            said = says
        clean.proxy.info_body = None
        await async_until(lambda: _ready(clean.gw), 15, f"the poller did not survive /info {body[-80:]!r}")
    finally:
        clean.proxy.info_body = None
    result = await stream(clean.gw.url, "Say hello.", 4)
    assert result["error"] is None and result["tokens"] == 4, result


# ---- Medium 5: trace is an operator's tool --------------------------------------------------------------------------

TRACE_BODIES = [{"prompt": "Say hello.", "trace": True},
                {"messages": [{"role": "user", "content": "Hi"}], "trace": True, "stream": True}]


async def test_trace_is_refused_unless_the_gateway_allows_it(clean):
    """This gateway was started without --allow-trace: a request asking for a trace (a completion, a streamed chat)
    is refused (403, naming the flag) before it reaches a stage, and `stagemesh trace` against it says what to do
    (one run: its command line is the same whatever a request asked); the gateway serves on."""
    for body in TRACE_BODIES:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with aiohttp.ClientSession() as s, s.post(clean.gw.url + path, json=body) as r:
            assert r.status == 403, await r.text()
            error = (await r.json())["error"]
        assert error["code"] == "trace_disabled" and "--allow-trace" in error["message"] and error["param"] == "trace", \
            (body, error)
    proc = await asyncio.to_thread(subprocess.run, stagemesh_cmd("trace", "--baseline", clean.gw.url, "--target",
                                                                 clean.gw.url, "--prompt", "Hi", "--steps", "1"),
                                   capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "HTTP 403" in proc.stderr and "--allow-trace" in proc.stderr, proc.stderr
    result = await stream(clean.gw.url, "Say hello.", 4)  # the gateway serves on
    assert result["error"] is None and result["tokens"] == 4, result


# ---- Low 10: refusals counted, forged errors named ------------------------------------------------------------------

def push_from(address: str, messages: list, curve: tuple[bytes, bytes, bytes] | None, arrived) -> None:
    """test_curve's push of these protocol messages, its socket held open until arrived() -- the receiver counted the
    refused handshake, or what the messages did."""
    push(address, [encode(msg) for msg in messages], curve, arrived, timeout=45)  # a loaded machine: slow to count


def forge_until(address: str, forged: Callable[[], list], curve: tuple[bytes, bytes, bytes], counted,
                over: Callable[[], bool], timeout: float = 45.0) -> None:
    """From one CURVE socket, send forged() every 0.2 s until counted() (the gateway acted on one of them); the
    request they aim at must still be running (not over()) the whole while."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(address)
    try:
        deadline = time.monotonic() + timeout
        while not counted():
            assert not over(), "the request ended before a forged answer met one of its micro-batches in flight"
            assert time.monotonic() < deadline, f"{address} never acted on the forged answers"
            for msg in forged():
                try:
                    sock.send_multipart(encode(msg), flags=zmq.NOBLOCK)
                except zmq.Again:
                    break  # not connected yet, or its queue full: the next round tries again
            time.sleep(0.2)
    finally:
        sock.close(0)
        ctx.term()


async def test_refusals_are_counted_and_forged_errors_are_named(clean, smollm2, tmp_path):
    """Strangers at the gateway's result port -- plaintext, and a CURVE key of another mesh -- and a plaintext one at
    stage 0 are refused and counted (gateway: handshakes and result-port rejects; stage: handshakes). A holder of the
    last stage's key forges unknown_sequence for the micro-batch ids the gateway uses: the failover it causes is
    counted and logged as what it was, not as a restart, and the running request is replayed and completes."""
    gw, mesh = clean.gw, clean.mesh
    before = {"in": clean.metric("stagemesh_gateway_handshakes_failed_total", direction="in"),
              "auth": clean.metric("stagemesh_gateway_result_port_rejected_messages_total", reason="auth"),
              "stage": stage_metric(mesh.stages[0], "stagemesh_stage_handshakes_failed_total", direction="in")}
    gateway_public = KeySet(mesh.keys_dir).public("gateway")
    other = str(tmp_path / "other")
    write_key_set(other, 2)
    stranger = KeySet(other).pair("stage1")
    ids = smollm2.tokenizer.encode("forged")
    junk = [BatchResult(7, ["x"], [1], [0.0])]
    await asyncio.to_thread(push_from, mesh.result_listen, junk, None, lambda: clean.metric(
        "stagemesh_gateway_handshakes_failed_total", direction="in") > before["in"])
    await asyncio.to_thread(push_from, mesh.result_listen, junk, (stranger.public, stranger.secret, gateway_public),
                            lambda: clean.metric("stagemesh_gateway_result_port_rejected_messages_total",
                                                 reason="auth") > before["auth"])
    await asyncio.to_thread(push_from, mesh.first_stage, [_forward(FOREIGN_MB, "plain", ids)], None, lambda: stage_metric(
        mesh.stages[0], "stagemesh_stage_handshakes_failed_total", direction="in") > before["stage"])

    forged_before = clean.metric("stagemesh_gateway_unknown_sequence_failovers_total")
    running = asyncio.create_task(stream(gw.url, "Write about the sea, at length.", 150))  # in flight for seconds
    await async_until(lambda: clean.kv_used() == [1, 1], 60, "the request never started")
    last = KeySet(mesh.keys_dir).pair("stage1")

    def forged() -> list[BatchError]:
        """unknown_sequence for the ids about the one in flight now (ids count up from 1 with the gateway's
        micro-batches); sent again until one lands on a micro-batch in flight, however slow the machine is."""
        sent = int(clean.metric("stagemesh_gateway_microbatches_total"))
        return [BatchError(mb, "stage[forged]", "unknown_sequence", "forged by an insider", [])
                for mb in range(max(1, sent - 5), sent + 50)]

    await asyncio.to_thread(forge_until, mesh.result_listen, forged, (last.public, last.secret, gateway_public),
                            lambda: clean.metric("stagemesh_gateway_unknown_sequence_failovers_total") > forged_before,
                            running.done)
    result = await asyncio.wait_for(running, 180)
    assert result["error"] is None and result["tokens"] == 150, result
    log = open(gw.log_path).read()
    assert "answered unknown_sequence" in log and "forged" in log
    assert "pipeline lost (a stage restarted)" not in log
