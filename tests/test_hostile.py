"""Hostile input to a stage's ZMQ input: counted under its reason, dropped, and the stage keeps serving."""

import asyncio
import os
import pickle
import urllib.request

import msgpack
import numpy as np
import pytest
import torch
import zmq

from services.process.launch import start_mesh
from shared.batch.sampling import SamplingParams
from shared.runtime.generation import generate_tokens
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.mesh_keys import KeySet
from shared.wire.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION
from tests.conftest import starts_processes
from tests.mesh import generate_group


class _Exploit:
    """Unpickling this runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _forward_header(**over):
    h = {"v": PROTOCOL_VERSION, "kind": "forward", "mb": 1,
         "seqs": [{"id": "a", "step": {"t": "prefill", "n": 4, "start": 0, "total": 4, "final": True},
                   "sampling": {}}],
         "tensors": [{"name": "tokens", "dtype": "int64", "shape": [4], "frame": 1}]}
    h.update(over)
    return h


def _pack(h):
    return msgpack.packb(h, use_bin_type=True)


TOKENS = np.arange(4, dtype=np.int64).tobytes()


def hostile_messages(marker: str) -> list[tuple[str, list[bytes]]]:
    """(expected reason, frames) for every kind of bad message."""
    rng = np.random.default_rng(0)
    good_step = _forward_header()["seqs"][0]["step"]
    cases = [
        ("msgpack", [pickle.dumps(_Exploit(marker))]),
        ("msgpack", [pickle.dumps(_Exploit(marker), protocol=0)]),
        ("msgpack", [b"\xc1"]),  # never-used msgpack byte
        ("msgpack", [_pack(_forward_header())[:-7], TOKENS]),  # truncated header
        ("msgpack", [_pack([1, 2, 3]), TOKENS]),  # not a map
        ("msgpack", [b"\xdd\xff\xff\xff\xff"]),  # array claiming 4 billion items
        ("oversize", [b"\x00" * (MAX_HEADER_BYTES + 1)]),
        ("version", [_pack(_forward_header(v=99)), TOKENS]),
        ("version", [_pack({k: v for k, v in _forward_header().items() if k != "v"}), TOKENS]),
        ("kind", [_pack(_forward_header(kind="exec")), TOKENS]),
        ("kind", [_pack({"v": PROTOCOL_VERSION, "kind": "result", "mb": 1, "seq_ids": [], "tokens": [], "logprobs": [],
                         "tensors": []})]),  # valid message, wrong direction
        ("dtype", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "object", "shape": [4], "frame": 1}])), TOKENS]),
        ("dtype", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "pickle", "shape": [4], "frame": 1}])),
                   pickle.dumps(_Exploit(marker))]),
        ("length", [_pack(_forward_header()), TOKENS[:-8]]),  # 3 tokens of bytes for shape [4]
        ("length", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "int64", "shape": [5], "frame": 1}])), TOKENS]),
        ("shape", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "int64", "shape": [-4], "frame": 1}])), TOKENS]),
        ("shape", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "int64", "shape": [2, 2], "frame": 1}])), TOKENS]),
        ("shape", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "int32", "shape": [8], "frame": 1}])), TOKENS]),
        ("frames", [_pack(_forward_header())]),  # descriptor without its frame
        ("frames", [_pack(_forward_header()), TOKENS, TOKENS]),
        ("frames", [_pack(_forward_header(tensors=[{"name": "tokens", "dtype": "int64", "shape": [4], "frame": 7}])), TOKENS]),
        ("schema", [_pack(_forward_header(seqs=[])), TOKENS]),
        ("schema", [_pack(_forward_header(seqs="everything")), TOKENS]),
        ("schema", [_pack(_forward_header(seqs=[{"id": "a", "step": {"t": "rewind"}, "sampling": {}}])), TOKENS]),
        ("schema", [_pack(_forward_header(seqs=[{"id": "a", "step": good_step, "sampling": {"temperature": -1}}])), TOKENS]),
        ("schema", [_pack(_forward_header(seqs=[{"id": "a", "step": good_step, "sampling": {"__class__": 1}}])), TOKENS]),
        ("schema", [_pack(_forward_header(seqs=[{"id": "x" * 500, "step": good_step, "sampling": {}}])), TOKENS]),
        ("schema", [_pack(_forward_header(seqs=[{"id": "a", "step": {**good_step, "n": 3}, "sampling": {}}])), TOKENS]),
        ("schema", [_pack(_forward_header(mb=-1)), TOKENS]),
        ("schema", [_pack(_forward_header(tp="00-" + "0" * 32 + "-00f067aa0ba902b7-01")), TOKENS]),  # zero trace id
        ("schema", [_pack(_forward_header(seqs=[{"id": "a", "step": good_step, "sampling": {}, "tp": "0" * 10_000}])),
                    TOKENS]),
        ("schema", [_pack({"v": PROTOCOL_VERSION, "kind": "release", "seq_ids": [1, 2]})]),
    ]
    out = []
    for _i in range(1000):  # random garbage of random sizes and frame counts
        frames = [rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))]
        try:
            msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
            continue  # random bytes that happen to be valid msgpack scalars are counted below via a fixed case
        except Exception:
            out.append(("msgpack", frames))
    return out + cases * 4


@pytest.fixture(scope="module")
@starts_processes
def mesh(tmp_path_factory):
    m = start_mesh("smollm2", 2, dtype="float32", log_dir=str(tmp_path_factory.mktemp("hostile")))
    yield m
    m.stop()


def _rejected(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "stagemesh_stage_rejected_messages_total"}


async def test_hostile_messages_are_counted_dropped_and_harmless(mesh, smollm2, tmp_path):
    marker = str(tmp_path / "pickle-ran")
    messages = hostile_messages(marker)
    assert len(messages) >= 1000
    expected: dict[str, int] = {}
    for reason, _ in messages:
        expected[reason] = expected.get(reason, 0) + 1
    assert len(expected) >= 8  # every reason is exercised

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)  # as the stage's own upstream peer (the gateway's keys): validation is the next wall
    keys = KeySet(mesh.keys_dir).for_gateway()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.next_server, keys.send.public, keys.send.secret
    sock.connect(mesh.first_stage)
    for _, frames in messages:
        sock.send_multipart(frames)
    sock.close(linger=5000)
    ctx.term()

    deadline = asyncio.get_running_loop().time() + 60
    while True:
        counts = _rejected(mesh.stages[0].url)
        if sum(counts.values()) >= len(messages) or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    assert {k: int(v) for k, v in counts.items() if v} == expected  # every message accounted for, by reason
    assert not os.path.exists(marker)  # the pickle never ran
    assert all(s.proc.poll() is None for s in mesh.stages)  # nothing crashed

    client = mesh.client()
    await client.start()
    try:
        ids = smollm2.tokenizer.encode("The capital of France is")
        out = await asyncio.wait_for(generate_group(client, {"ok": ids}, 8), 60)
    finally:
        await client.close()
    local = LocalPipeline.load(smollm2.loader, None, torch.float32, kv_slots=1)
    assert out["ok"] == list(generate_tokens(local, ids, SamplingParams(), 8))
