"""`--compile-decode auto` (a stage's default) through real processes: `stagemesh up` serves while its stage compiles
the decode step in the background, then runs one stream's decode steps compiled; the stage's /info says which.
(The compiled step's numbers against llama.cpp: tests/test_numerics.py.)"""

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.testing.harness import children
from shared.kernels import qdot

pytestmark = pytest.mark.processes  # every test here starts a real up

# The KV shapes of test_numerics' compiled pipeline (3 slots + the scratch row, 256 positions): one compilation
# serves both tests, the second from inductor's on-disk cache.
SHAPE_FLAGS = ("--kv-slots", "3", "--max-seq-len", "256")


def complete(url: str, max_tokens: int) -> dict:
    # without n-gram drafts (the greedy text repeats, so they would stand): every step one token, the steps counted
    body = json.dumps({"model": "smollm2", "prompt": "The history of the printing press", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "speculation": False}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return json.loads(r.read())


@pytest.fixture(scope="module")
def gateway(up):
    return up("--compile-decode", "auto", *SHAPE_FLAGS)


def test_up_serves_while_the_stage_compiles_then_decodes_compiled(gateway):
    before = gateway.stage_info(0).compiled_decode
    # no other test asks for this setup: its up has just started, and a cold compilation takes 1-2 minutes (the
    # suite saves no compiled packages: STAGEMESH_AOTI_CACHE=off, tests/conftest.py)
    assert before["state"] == "compiling" and before["error"] is None and before["steps"] == 0, before
    out = complete(gateway.url, 8)  # served at once, while the stage compiles
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
    after = gateway.stage_info(0).compiled_decode
    assert after["state"] == "compiling" and after["steps"] == 0, after  # every step of that request ran eager
    deadline = time.monotonic() + 900  # a cold compilation takes 1-2 minutes on 2 busy cores
    while gateway.stage_info(0).compiled_decode["state"] == "compiling" and time.monotonic() < deadline:
        time.sleep(1)
    info = gateway.stage_info(0).compiled_decode
    assert info["state"] == "ready" and set(info["compile_seconds"]) == {str(n) for n in info["threads"]}
    assert info["contexts"] == [2, 255]  # one graph: every context but the two ends of the 256-position cache
    assert not info["fell_back_to_eager"]
    out = complete(gateway.url, 16)
    assert out["usage"]["completion_tokens"] == 16
    # the first token comes from the prefill; each of the other 15 from a one-sequence decode step, now compiled
    assert gateway.stage_info(0).compiled_decode["steps"] - info["steps"] == 15
    # streams decoding together: micro-batches of 2..3 sequences (the 3 KV slots) run the batched graph where
    # qdot's attention kernel covers the model (float32 on an AVX2 CPU), else eagerly
    batched = info["batched"]
    assert batched["sizes"] == [2, 3] and not batched["fell_back_to_eager"]
    covered = qdot.usable() and gateway.stage_info(0).dtype == "float32"
    assert (batched["reason"] is None) == covered, batched
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: complete(gateway.url, 24), range(3)))
    assert [o["usage"]["completion_tokens"] for o in outs] == [24] * 3 and all(o["choices"][0]["text"] for o in outs)
    after = gateway.stage_info(0).compiled_decode["batched"]
    assert (after["steps"] > batched["steps"]) == covered, after
    assert not after["fell_back_to_eager"]


def test_off_and_uncovered_setups_say_why_decode_is_eager(up):
    gw = up("--batch-invariant", "--compile-decode", "auto", *SHAPE_FLAGS)
    info = gw.stage_info(0).compiled_decode
    assert info["state"] == "off" and "batch-invariant" in info["reason"]
    assert complete(gw.url, 4)["usage"]["completion_tokens"] == 4


def test_every_stage_of_a_two_stage_mesh_decodes_compiled(up):
    # The stages after the first take their input from the wire: a view of a ZeroMQ frame, not a tensor made under
    # inference mode like the first stage's embedding. The graph must take it without recompiling (which would
    # leave that stage eager for good).
    gw = up("--compile-decode", "auto", *SHAPE_FLAGS, stages=2)
    ready = gw.wait_compiled()
    assert [i["state"] for i in ready] == ["ready", "ready"]
    out = complete(gw.url, 16)
    assert out["usage"]["completion_tokens"] == 16
    infos = [gw.stage_info(i) for i in range(2)]
    after = [i.compiled_decode for i in infos]
    assert [i["fell_back_to_eager"] for i in after] == [False, False]
    # 15 one-sequence decode steps after the prefill, compiled on each stage
    assert [a["steps"] - r["steps"] for a, r in zip(after, ready)] == [15, 15]
    # the two stages share this host: each has half the cores, and all of them for a micro-batch alone in the
    # pipeline (one stream's always is), with compiled graphs for both counts
    cores = os.cpu_count()
    share = max(1, cores // 2)
    assert [(i.threads, i.threads_alone) for i in infos] == [(share, cores)] * 2
    # SmolLM2's Q4_1 blocks run on the integer-dot kernels inside the graphs, where this CPU takes them (AVX2)
    integer_dot = qdot.why_not() or "on"
    assert [i.weights["integer_dot"] for i in infos] == [integer_dot] * 2
    assert all(("q4_1-dot-q8" in str(i.weights["tensors"])) == (integer_dot == "on") for i in infos)
    assert [a["threads"] for a in after] == [sorted({share, cores})] * 2
    if share != cores:  # taking turns with the cores: OpenMP threads spin briefly before they sleep
        stages = [p for p in children(gw.proc.pid) if "stage" in open(f"/proc/{p}/cmdline").read()]
        assert len(stages) == 2
        for pid in stages:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert b"GOMP_SPINCOUNT=3000" in f.read().split(b"\0")
