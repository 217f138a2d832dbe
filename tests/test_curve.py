"""Only the mesh talks to a stage: CURVE keys per role, one upstream peer per receiver, encrypted hops; slot leases,
reconcile by a new gateway, and stages that die with their launcher. Real stage processes on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import time

import aiohttp
import pytest
import torch
import zmq

from services.process.launch import (
    LocalMesh,
    StageProcess,
    free_ports,
    stage_command,
    start_mesh,
    wait_ready,
)
from services.testing.harness import children, free_port, scrape_metric, start_up
from shared.batch.steps import Decode, Prefill
from shared.errors import StagemeshError
from shared.wire.mesh_keys import KeySet, ephemeral_key_set, sweep_orphan_key_sets, write_key_set
from shared.wire.pipeline_client import PipelineError
from shared.wire.protocol import ForwardBatch, SeqEntry, encode
from tests.conftest import stagemesh_cmd, starts_processes
from tests.delay_proxy import DelayProxy, ProxyThread
from tests.mesh import generate_group

HIDDEN = 576  # SmolLM2's hidden size: what a forged activation for stage 1 must look like


def metric(url: str, name: str, **labels: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    value = scrape_metric(text, name, labels or None)
    return 0.0 if value != value else value  # absent: 0


def kv_used(mesh: LocalMesh) -> list[int]:
    return [s.info().kv_slots_used for s in mesh.stages]


def forged_batches(first_stage: bool, n: int = 5) -> list[list]:
    """Well-formed micro-batches a stage would compute (new sequences: each would take a KV slot)."""
    out = []
    for i in range(n):
        seq = [SeqEntry(f"intruder-{i}", Prefill(4, 0, 4, True))]
        batch = ForwardBatch(1000 + i, seq, tokens=torch.arange(4, dtype=torch.int64)) if first_stage else \
            ForwardBatch(1000 + i, seq, hidden=torch.randn(4, HIDDEN))
        out.append([bytes(f) for f in encode(batch)])
    return out


def push(address: str, messages: list[list], curve: tuple[bytes, bytes, bytes] | None, refused, timeout: float = 15.0,
         ) -> None:
    """Send from a fresh socket (`curve` = (client public, client secret, server public), or None for plaintext) and
    wait until refused() -- the stage counted the handshake it refused -- before closing it. After that nothing can
    arrive: the stage dropped the connection at the handshake."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    if curve:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(address)
    for frames in messages:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # never connected: nothing can leave the socket
    try:
        deadline = time.monotonic() + timeout
        while not refused():
            assert time.monotonic() < deadline, f"{address} never counted the refused handshake"
            time.sleep(0.05)
    finally:
        sock.close(0)
        ctx.term()


def counted(url: str, reason: str):
    """A condition: the stage at url counted one more rejected message for `reason` than it had now."""
    before = metric(url, "stagemesh_stage_rejected_messages_total", reason=reason)
    return lambda: metric(url, "stagemesh_stage_rejected_messages_total", reason=reason) > before


@pytest.fixture(scope="module")
@starts_processes
def mesh(tmp_path_factory):
    m = start_mesh("smollm2", 2, dtype="float32", log_dir=str(tmp_path_factory.mktemp("curve")))
    yield m
    m.stop()


async def _generate(mesh: LocalMesh, smollm2, seq_id: str = "legit", tokens: int = 6) -> list[int]:
    client = mesh.client()
    await client.start()
    try:
        ids = smollm2.tokenizer.encode("The capital of France is")
        return (await asyncio.wait_for(generate_group(client, {seq_id: ids}, tokens), 60))[seq_id]
    finally:
        await client.close()


# ---- keys ----------------------------------------------------------------------------------------------------

def test_key_set_files_modes_and_clear_errors(tmp_path):
    d = str(tmp_path / "keys")
    write_key_set(d, 2)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for role in ("gateway", "stage0", "stage1"):
        assert stat.S_IMODE(os.stat(f"{d}/{role}.key_secret").st_mode) == 0o600
        assert len(KeySet(d).pair(role).public) == 40
    with pytest.raises(StagemeshError, match="already holds a key set"):
        write_key_set(d, 2)
    with pytest.raises(StagemeshError, match="is for 2 stages, the gateway has 3"):
        KeySet(d).check_stages(3, "the gateway")
    with pytest.raises(StagemeshError, match=r"stage index 2 has no keys"):
        KeySet(d).for_stage(2, last=True)
    with pytest.raises(StagemeshError, match=r"does not exist.*stagemesh keys DIR --stages N"):
        KeySet(str(tmp_path / "nowhere"))
    other = str(tmp_path / "other")
    write_key_set(other, 2)
    os.replace(f"{other}/stage1.key", f"{d}/stage1.key")  # a public file from another set
    with pytest.raises(StagemeshError, match=r"stage1.key_secret and stage1.key hold different public keys"):
        KeySet(d).pair("stage1")
    os.chmod(f"{d}/stage0.key_secret", 0o644)
    with pytest.raises(StagemeshError, match=r"stage0.key_secret is readable by every user; chmod 600"):
        KeySet(d).pair("stage0")
    os.remove(f"{d}/gateway.key_secret")
    with pytest.raises(StagemeshError, match=r"gateway.key_secret is missing"):
        KeySet(d).for_gateway()
    with open(f"{other}/stage0.key_secret", "w") as f:
        f.write("not a certificate\n")
    with pytest.raises(StagemeshError, match=r"stage0.key_secret is not a ZeroMQ certificate"):
        KeySet(other).pair("stage0")


@pytest.mark.timing
async def test_hand_over_delivers_only_to_a_holder_of_the_place_secret_key(tmp_path):
    """hand_over (a replacement's probe) sends only once a CURVE handshake with the place's public key completed:
    the real stage 1 receiver (stage 1's secret, stage 0's key let in by ZAP) gets the message; a receiver holding
    another key set's stage 1 pair, and an address where nothing listens, are named and get nothing."""
    from shared.wire.protocol import Resplit
    from shared.wire.transport import ZmqTransport, hand_over

    d, other = str(tmp_path / "keys"), str(tmp_path / "other")
    write_key_set(d, 2)
    write_key_set(other, 2)
    real_port, fake_port, empty_port = free_ports(3)
    real = ZmqTransport(f"tcp://127.0.0.1:{real_port}", None, (Resplit,), keys=KeySet(d).for_stage(1, last=True))
    fake = ZmqTransport(f"tcp://127.0.0.1:{fake_port}", None, (Resplit,), keys=KeySet(other).for_stage(1, last=True))
    sender = KeySet(d).for_stage(0, last=False)  # stage 0 dials stage 1's key: the place's
    split = [(0, 15), (15, 30)]
    probe = Resplit(3, "probe", split, split, route=(1, f"tcp://127.0.0.1:{real_port}", None))
    try:
        t0 = time.perf_counter()
        assert await asyncio.to_thread(hand_over, f"tcp://127.0.0.1:{real_port}", sender, probe) is None
        assert await asyncio.wait_for(real.receive(), 5) == probe
        t1 = time.perf_counter()
        why = await asyncio.to_thread(hand_over, f"tcp://127.0.0.1:{fake_port}", sender, probe)
        t2 = time.perf_counter()
        assert why is not None and "CURVE handshake" in why and "does not hold stage1's secret key" in why, why
        assert t2 - t1 < 0.9  # a failed handshake answers at once, not at the timeout
        why = await asyncio.to_thread(hand_over, f"tcp://127.0.0.1:{empty_port}", sender, probe, 0.5)
        assert why is not None and "no process at" in why and "within 0.5 s" in why, why
        assert 0.5 <= time.perf_counter() - t2 < 1.5
        with pytest.raises(TimeoutError):  # nothing reached the impostor's socket
            await asyncio.wait_for(fake.receive(), 0.3)
        assert t1 - t0 < 2.0
    finally:
        real.close()
        fake.close()


@pytest.mark.processes
def test_cli_keys_then_stage_without_keys_is_a_one_line_error(tmp_path):
    d = str(tmp_path / "k")
    made = subprocess.run(stagemesh_cmd("keys", d, "--stages", "3"), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert sorted(os.listdir(d)) == sorted(["mesh.json"] + [f"{r}.key{s}" for r in ("gateway", "stage0", "stage1",
                                                                                      "stage2") for s in ("", "_secret")])
    env = {k: v for k, v in os.environ.items() if k != "STAGEMESH_KEYS"}
    no_keys = subprocess.run(stagemesh_cmd("stage", "--stage-index", "0", "--num-stages", "2", "--listen",
                                           "tcp://127.0.0.1:1", "--next", "tcp://127.0.0.1:2"),
                             capture_output=True, text=True, timeout=120, env=env)
    assert no_keys.returncode == 2
    assert no_keys.stderr.strip().count("\n") == 0 and "--keys DIR" in no_keys.stderr and "--insecure-plaintext" in no_keys.stderr
    wrong_count = subprocess.run(stagemesh_cmd("stage", "--stage-index", "0", "--num-stages", "2", "--listen",
                                               "tcp://127.0.0.1:1", "--next", "tcp://127.0.0.1:2", "--keys", d),
                                 capture_output=True, text=True, timeout=120, env=env)
    assert wrong_count.returncode == 2 and "is for 3 stages" in wrong_count.stderr, wrong_count.stderr
    # one role's share of the set (what a Kubernetes pod's init container writes), and its clear refusals
    for args, says in [(("--role", "stage7", "--from", d), "'stage7' is not in the key set"),
                       (("--role", "stage1"), "--role needs --from"),
                       (("--stages", "2", "--from", d), "--from goes with --role")]:
        refused = subprocess.run(stagemesh_cmd("keys", str(tmp_path / "own"), *args), capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    own = subprocess.run(stagemesh_cmd("keys", str(tmp_path / "own"), "--role", "stage1", "--from", d),
                         capture_output=True, text=True, timeout=60)
    assert own.returncode == 0, own.stderr
    assert sorted(os.listdir(tmp_path / "own")) == ["gateway.key", "mesh.json", "stage0.key", "stage1.key",
                                                    "stage1.key_secret", "stage2.key"]


# ---- who may talk to a stage -----------------------------------------------------------------------------

async def test_a_process_without_the_keys_cannot_reach_a_stage(mesh, smollm2):
    s0 = mesh.stages[0]
    stage0_public = KeySet(mesh.keys_dir).public("stage0")
    before = metric(s0.url, "stagemesh_stage_microbatches_total")
    push(s0.listen, forged_batches(first_stage=True), None, counted(s0.url, "handshake"))  # plaintext: no CURVE at all
    stranger_public, stranger_secret = zmq.curve_keypair()  # CURVE, knows the stage's public key, not in the set
    push(s0.listen, forged_batches(first_stage=True), (stranger_public, stranger_secret, stage0_public),
         counted(s0.url, "auth"))  # refused, counted
    assert metric(s0.url, "stagemesh_stage_microbatches_total") == before  # nothing arrived, nothing computed
    assert kv_used(mesh) == [0, 0]
    assert len(await _generate(mesh, smollm2)) == 6  # the mesh's own traffic still flows
    assert metric(s0.url, "stagemesh_stage_microbatches_total") > before


async def test_a_valid_key_of_the_wrong_peer_is_refused(mesh, smollm2):
    """The gateway's key is a real mesh key, but stage 1 accepts only stage 0; stage 1's key is not stage 0's peer."""
    keys = KeySet(mesh.keys_dir)
    gateway, stage1 = keys.pair("gateway"), keys.pair("stage1")
    s0, s1 = mesh.stages
    before = [metric(s.url, "stagemesh_stage_microbatches_total") for s in mesh.stages]
    push(s1.listen, forged_batches(first_stage=False), (gateway.public, gateway.secret, keys.public("stage1")),
         counted(s1.url, "auth"))
    push(s0.listen, forged_batches(first_stage=True), (stage1.public, stage1.secret, keys.public("stage0")),
         counted(s0.url, "auth"))
    assert [metric(s.url, "stagemesh_stage_microbatches_total") for s in mesh.stages] == before
    assert kv_used(mesh) == [0, 0]
    assert len(await _generate(mesh, smollm2)) == 6


# ---- what travels between two stages --------------------------------------------------------------------

class _Tap:
    def __init__(self, reader, sink: bytearray):
        self.reader, self.sink = reader, sink

    async def read(self, n: int) -> bytes:
        data = await self.reader.read(n)
        self.sink.extend(data)
        return data


class CapturingProxy(DelayProxy):
    """The delay proxy, keeping every byte that goes from the connecting side to the target."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.captured = bytearray()

    async def _handle(self, reader, writer) -> None:
        await super()._handle(_Tap(reader, self.captured), writer)


def start_proxied_mesh(keys_dir: str | None, log_dir: str) -> tuple[LocalMesh, CapturingProxy, ProxyThread]:
    """Two stages with stage 0 -> stage 1 through a capturing proxy."""
    listen0, listen1, http0, http1, proxy_port, result = free_ports(6)
    proxy = CapturingProxy(("127.0.0.1", proxy_port), ("127.0.0.1", listen1))
    thread = ProxyThread([proxy])
    thread.start()
    hops = [(listen0, f"tcp://127.0.0.1:{proxy_port}", http0), (listen1, f"tcp://127.0.0.1:{result}", http1)]
    stages = []
    for i, (port, next_hop, http) in enumerate(hops):
        cmd = stage_command("smollm2", i, 2, f"tcp://127.0.0.1:{port}", next_hop, f"127.0.0.1:{http}", "float32", 1,
                            [], keys_dir)
        st = StageProcess(i, f"tcp://127.0.0.1:{port}", f"127.0.0.1:{http}", None, cmd, os.path.join(log_dir, f"s{i}.log"))
        st.proc = st.spawn("w")
        stages.append(st)
    mesh = LocalMesh(stages, f"tcp://127.0.0.1:{result}", keys_dir)
    try:
        wait_ready(mesh.stage_urls, 180, [s.proc for s in stages])
    except BaseException:
        mesh.stop()
        thread.stop()
        raise
    return mesh, proxy, thread


SECRET_SEQ = "SECRET-SEQUENCE-4242"


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["curve", "plaintext"])
async def test_captured_traffic_between_stages_holds_no_plaintext(mode, smollm2, tmp_path):
    keys_dir = None
    if mode == "curve":
        keys_dir = str(tmp_path / "keys")
        write_key_set(keys_dir, 2)
    mesh, proxy, thread = start_proxied_mesh(keys_dir, str(tmp_path))
    try:
        out = await _generate(mesh, smollm2, SECRET_SEQ, tokens=4)
        assert len(out) == 4
        captured = bytes(proxy.captured)
        assert len(captured) > 4 * HIDDEN * 4  # the activations did cross the proxy
        markers = [SECRET_SEQ.encode(), b"seqs", b"sampling", b"hidden", b"float32", b"forward"]
        if mode == "curve":
            assert [m for m in markers if m in captured] == []
        else:
            assert [m for m in markers if m in captured] == markers
            log = open(mesh.stages[0].log_path).read()
            assert "WARNING" in log and "--insecure-plaintext" in log  # plaintext is never silent
    finally:
        mesh.stop()
        thread.stop()


# ---- slots: leases and reconcile -------------------------------------------------------------------------

@pytest.mark.processes
async def test_an_abandoned_sequence_loses_its_slot_when_its_lease_expires(smollm2, tmp_path):
    mesh = start_mesh("smollm2", 2, dtype="float32", log_dir=str(tmp_path), extra=["--slot-lease", "1.5"])
    try:
        assert len(await _generate(mesh, smollm2, "live", tokens=12)) == 12  # a live sequence is never expired
        assert [s.info().slots_reclaimed for s in mesh.stages] == [0, 0]
        client = mesh.client()
        await client.start()
        try:
            ids = torch.tensor(smollm2.tokenizer.encode("Abandon me"), dtype=torch.int64)
            n = len(ids)
            await asyncio.wait_for(client.forward(ForwardBatch(client.next_mb_id(), [SeqEntry("gone", Prefill(n, 0, n, True))],
                                                               tokens=ids)), 30)
            assert kv_used(mesh) == [1, 1]  # held, and never released by its owner
            deadline = time.monotonic() + 15
            while kv_used(mesh) != [0, 0] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert kv_used(mesh) == [0, 0]
            assert [s.info().slots_reclaimed for s in mesh.stages] == [1, 1]
            assert [metric(s.url, "stagemesh_stage_slots_reclaimed_total") for s in mesh.stages] == [1, 1]
            with pytest.raises(PipelineError) as e:  # the owner coming back is told, and the gateway replays
                await asyncio.wait_for(client.forward(ForwardBatch(client.next_mb_id(), [SeqEntry("gone", Decode(n))],
                                                                   tokens=torch.tensor([42]))), 30)
            assert e.value.code == "unknown_sequence"
        finally:
            await client.close()
    finally:
        mesh.stop()


def _gateway(mesh: LocalMesh, port: int, log) -> subprocess.Popen:
    return subprocess.Popen(stagemesh_cmd("gateway", "--stages", ",".join(mesh.stage_urls), "--listen",
                                          f"127.0.0.1:{port}", "--result-listen", mesh.result_listen, "--keys",
                                          mesh.keys_dir), stdout=log, stderr=subprocess.STDOUT)


async def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "gateway exited"
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise AssertionError("gateway not ready")


async def test_a_new_gateway_takes_back_the_slots_a_killed_one_held(mesh, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "gw.log", "w")
    first = _gateway(mesh, port, log)
    second = None
    try:
        await _wait_ready(url, first)

        async def stream(i):
            body = {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                async for _ in r.content:
                    pass

        streams = [asyncio.create_task(stream(i)) for i in range(4)]
        deadline = time.monotonic() + 60
        while kv_used(mesh) != [4, 4] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert kv_used(mesh) == [4, 4]
        first.send_signal(signal.SIGKILL)
        first.wait()
        await asyncio.gather(*streams, return_exceptions=True)
        # once the micro-batches the dead gateway left in flight have passed (the stages' counts stand still), nothing
        # released the slots: their owner is gone
        counts, deadline = None, time.monotonic() + 15
        while (now := [s.info().microbatches for s in mesh.stages]) != counts:
            assert time.monotonic() < deadline, "the stages kept computing after the gateway died"
            counts = now
            await asyncio.sleep(0.5)
        assert kv_used(mesh) == [4, 4]
        second = _gateway(mesh, port, log)
        await _wait_ready(url, second)
        deadline = time.monotonic() + 10
        while kv_used(mesh) != [0, 0] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert kv_used(mesh) == [0, 0]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# ---- stages die with their launcher ----------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.processes
def test_up_gives_its_stages_private_keys_and_they_exit_when_up_is_killed(tmp_path):
    gw = start_up(2, "float32", str(tmp_path))
    stages = [p for p in children(gw.proc.pid) if "stage" in open(f"/proc/{p}/cmdline").read()]
    try:
        assert len(stages) == 2
        argv = open(f"/proc/{stages[0]}/cmdline").read().split("\0")
        keys_dir = argv[argv.index("--keys") + 1]  # ephemeral keys, made by up itself
        assert stat.S_IMODE(os.stat(keys_dir).st_mode) == 0o700 and "--insecure-plaintext" not in argv
        assert json.load(open(os.path.join(keys_dir, "mesh.json"))) == {"stages": 2}
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in stages) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in stages if _alive(p)] == []
        # a SIGKILLed up cannot delete its keys; the next launch on this machine does, before making its own
        assert os.path.isdir(keys_dir) and os.path.basename(keys_dir).startswith(f"stagemesh-keys-{gw.proc.pid}-")
        mine = ephemeral_key_set(1)
        try:
            assert not os.path.exists(keys_dir)
            assert sweep_orphan_key_sets(os.path.dirname(mine)) == [] and os.path.isdir(mine)  # a living owner's stays
        finally:
            shutil.rmtree(mine)
    finally:
        for p in stages:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
