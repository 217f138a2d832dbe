"""`--compile-decode auto` (a stage's default) through real processes: `stagemesh up` serves while its stages compile
the decode step in the background, then runs one stream's decode steps compiled on every stage; each stage's /info
says which.
(The compiled step's numbers against llama.cpp: tests/test_numerics.py.)"""

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.testing.harness import children
from services.testing.tiny_gguf import write_tiny_gguf
from shared.kernels import qdot
from tests.test_aoti_decode import SMOLLM2_WIDE

pytestmark = pytest.mark.processes  # every test here starts a real up

# The KV shapes of test_numerics' compiled pipeline (3 slots + the scratch row, 256 positions): a one-sequence graph
# for contexts 2..255 and a batched graph for 2..3 sequences.
SHAPE_FLAGS = ("--kv-slots", "3", "--max-seq-len", "256")


def complete(url: str, max_tokens: int, model: str = "smollm2") -> dict:
    # without n-gram drafts (the greedy text repeats, so they would stand): every step one token, the steps counted
    body = json.dumps({"model": model, "prompt": "The history of the printing press", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "speculation": False}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return json.loads(r.read())


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """SmolLM2's widths, vocabulary and Q4_1 blocks in 4 layers (tests/test_aoti_decode.py): what the compiled graphs
    prove does not depend on the depth, and 2 layers a stage compile in a fraction of SmolLM2's 15."""
    return write_tiny_gguf(str(tmp_path_factory.mktemp("wide") / "wide.gguf"), SMOLLM2_WIDE)


def test_a_two_stage_mesh_serves_while_compiling_then_every_stage_decodes_compiled(up, wide_model):
    """One up of two stages proves both halves: it serves at once while its stages compile (every step of that request
    eager), then each stage runs one stream's decode steps and the streams decoding together on its compiled graphs.
    The stages after the first take their input from the wire: a view of a ZeroMQ frame, not a tensor made under
    inference mode like the first stage's embedding. The graph must take it without recompiling (which would leave
    that stage eager for good)."""
    gw = up("--model", wide_model, "--compile-decode", "auto", *SHAPE_FLAGS, stages=2)
    served = json.loads(gw.get("/v1/models")[1])["data"][0]["id"]

    stages = range(2)
    before = [gw.stage_info(i).compiled_decode for i in stages]
    # no other test asks for this setup: its up has just started, and a cold compilation takes 1-2 minutes (the
    # suite saves no compiled packages: STAGEMESH_AOTI_CACHE=off, tests/conftest.py)
    assert all(b["state"] == "compiling" and b["error"] is None and b["steps"] == 0 for b in before), before
    out = complete(gw.url, model=served, max_tokens=8)  # served at once, while the stages compile
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
    during = [gw.stage_info(i).compiled_decode for i in stages]
    assert all(d["state"] == "compiling" and d["steps"] == 0 for d in during), during  # every step of it ran eager
    ready = gw.wait_compiled()  # a cold compilation takes 1-2 minutes on 2 busy cores
    for info in ready:
        assert info["state"] == "ready" and set(info["compile_seconds"]) == {str(n) for n in info["threads"]}, info
        assert info["contexts"] == [2, 255]  # one graph: every context but the two ends of the 256-position cache
        assert not info["fell_back_to_eager"]
    out = complete(gw.url, model=served, max_tokens=16)
    assert out["usage"]["completion_tokens"] == 16
    infos = [gw.stage_info(i) for i in stages]
    after = [i.compiled_decode for i in infos]
    assert [i["fell_back_to_eager"] for i in after] == [False, False]
    # the first token comes from the prefill; each of the other 15 from a one-sequence decode step, compiled on each
    # stage
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
    # and their prefill-sized calls on the AMX tiles where this CPU grants them, each tensor's kind saying so
    amx = qdot.amx_why_not() or f"on from {qdot.amx_rows()} rows"
    assert [i.weights["amx"] for i in infos] == [amx] * 2
    assert all(("| amx-bf16 from" in str(i.weights["tensors"])) == amx.startswith("on") for i in infos)
    assert [a["threads"] for a in after] == [sorted({share, cores})] * 2
    if share != cores:  # taking turns with the cores: OpenMP threads spin briefly before they sleep
        pids = [p for p in children(gw.proc.pid) if "stage" in open(f"/proc/{p}/cmdline").read()]
        assert len(pids) == 2
        for pid in pids:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert b"GOMP_SPINCOUNT=3000" in f.read().split(b"\0")
    # streams decoding together: micro-batches of 2..3 sequences (the 3 KV slots; here 3 streams over 2 micro-batches
    # in flight make micro-batches of 2) run the batched graph where qdot's attention kernel covers the model (float32
    # on an AVX2 CPU), else eagerly
    batched = [r["batched"] for r in ready]
    covered = [qdot.usable() and i.dtype == "float32" for i in infos]
    for b, c in zip(batched, covered):
        assert b["sizes"] == [2, 3] and not b["fell_back_to_eager"], b
        assert (b["reason"] is None) == c, b
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: complete(gw.url, model=served, max_tokens=24), range(3)))
    assert [o["usage"]["completion_tokens"] for o in outs] == [24] * 3 and all(o["choices"][0]["text"] for o in outs)
    for i, b, c in zip(stages, batched, covered):
        now = gw.stage_info(i).compiled_decode["batched"]
        assert (now["steps"] > b["steps"]) == c, (i, now)
        assert not now["fell_back_to_eager"]


def test_off_and_uncovered_setups_say_why_decode_is_eager(up):
    gw = up("--batch-invariant", "--compile-decode", "auto", *SHAPE_FLAGS)
    info = gw.stage_info(0).compiled_decode
    assert info["state"] == "off" and "batch-invariant" in info["reason"]
    assert complete(gw.url, 4)["usage"]["completion_tokens"] == 4
