"""A flood of long, distinct prompts against `up` confined to a memory cgroup (v1 memory.limit_in_bytes; a pod's
limit in Kubernetes): every stage's K/V stays within its share, so requests wait or are refused with 429 -- never
is a process killed for memory -- and the service answers again when the flood ends (the third hostile pass: the
K/V of anonymous clients' distinct prompts grew until the OOM killer stopped a stage)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import urllib.request

import aiohttp
import pytest

from services.testing.harness import free_port
from tests.conftest import stagemesh_cmd

CGROUP_V1 = "/sys/fs/cgroup/memory"
LIMIT = int(1.7 * 2**30)  # the processes' baseline (~1.1 GiB: up and 2 stages) and room for a few long prompts' K/V
WORDS = ("river stone light quiet paper north window garden silver market engine winter yellow forest table "
         "signal orange ladder harbor cotton valley thunder mirror pocket candle planet rabbit violin glacier "
         "meadow copper lantern basket feather island jacket kettle lemon marble needle oyster pepper").split()


def _memory_cgroup(name: str, limit: int) -> str | None:
    path = os.path.join(CGROUP_V1, name)
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError:
        return None
    return path


def _join(procs_file: str) -> None:
    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))


def _read(cgroup: str, name: str) -> str:
    with open(os.path.join(cgroup, name)) as f:
        return f.read()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _prompt(i: int, words: int = 1300) -> str:
    rng = random.Random(i)
    return f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummary:"


@pytest.mark.processes
def test_a_flood_of_long_distinct_prompts_under_a_memory_limit_waits_or_is_refused_never_killed(tmp_path):
    cgroup = _memory_cgroup(f"stagemesh-flood-{os.getpid()}", LIMIT)
    if cgroup is None:  # as tests/test_load_memory.py: a machine without cgroup v1 or root cannot confine `up`
        pytest.skip(f"cannot make a memory cgroup under {CGROUP_V1} here (needs root and cgroup v1)")
    port = free_port()
    join = os.path.join(cgroup, "cgroup.procs")
    up = subprocess.Popen(
        stagemesh_cmd("up", "--stages", "2", "--port", str(port), "--compile-decode", "off", "--max-queue", "6",
                      "--log-dir", str(tmp_path)),
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        preexec_fn=lambda: _join(join))  # up and the stages it starts: in the cgroup
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if _get(url + "/v1/mesh")["ready"]:
                    break
            except OSError:
                pass
            assert up.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            asyncio.run(asyncio.sleep(0.5))
        stages = _get(url + "/v1/mesh")["stages"]
        infos = [_get(s["url"] + "/info") for s in stages]
        # each stage's share: weights, cached prefixes and live sequences together within its budget
        for info in infos:
            budget = info["weights"]["memory"]["budget_bytes"]
            assert 0 < info["kv_live_memory_bytes"] <= budget - info["kv_prefix_memory_bytes"], info["weights"]
        one_prompt_kv = 1400 * sum(i["kv_position_bytes"] for i in infos)
        assert sum(i["kv_live_memory_bytes"] for i in infos) < 8 * one_prompt_kv  # the flood does not fit at once

        async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, dict]:
            # the prompts' K/V is the flood (1307 positions each); 16 decoded tokens a request add ~1 % to it (64
            # spent seconds of decoding per wave of running requests to prove the same)
            async with session.post(url + "/v1/completions", json={"prompt": _prompt(i), "max_tokens": 16,
                                                                  "ignore_eos": True}) as r:
                return r.status, await r.json()

        async def flood() -> list[tuple[int, dict]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
                return await asyncio.gather(*(one(s, i) for i in range(24)))

        results = asyncio.run(flood())
        statuses = sorted(status for status, _ in results)
        assert set(statuses) <= {200, 429}, [(s, b) for s, b in results if s not in (200, 429)]
        assert statuses.count(200) >= 8 and statuses.count(429) >= 1, statuses  # queued ones ran; the rest refused
        refused = next(body for status, body in results if status == 429)
        assert refused["error"]["code"] == "queue_full", refused
        # nothing was killed: no OOM kill in the cgroup, no stage restarted, up still running
        assert "oom_kill 0" in _read(cgroup, "memory.oom_control"), _read(cgroup, "memory.oom_control")
        assert up.poll() is None and all(s["restarts"] == 0 for s in _get(url + "/v1/mesh")["stages"])
        assert int(_read(cgroup, "memory.max_usage_in_bytes")) <= LIMIT
        # and the service answers again once the flood is over
        status, body = asyncio.run(_after(url))
        assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body
    finally:
        up.terminate()
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        for _ in range(100):  # the cgroup can go once its processes have
            try:
                os.rmdir(cgroup)
                break
            except OSError:
                asyncio.run(asyncio.sleep(0.2))


async def _after(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": _prompt(1000, 40), "max_tokens": 4}) as r:
            return r.status, await r.json()
