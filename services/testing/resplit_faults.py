"""A live re-split with a stage SIGKILLed in one of its phases, and the check that the mesh ended in one split, for
the chaos benchmark (benchmarks.chaos, scenario resplit) and its test (tests/test_resplit.py).

The gateway (`up`) runs with STAGEMESH_RESPLIT_HOLD naming the phases to hold before (services/gateway/engine/core.py
Engine._hold): while /v1/mesh shows "<phase> (held)" -- the pipeline drained when the phase is move or commit -- the
victim is frozen (SIGSTOP), so the phase's message reaches it and waits; once /v1/mesh shows the phase sent, the
victim is SIGKILLed with the message in hand. Which stage is the victim decides where the phase stopped: in the
move, stage 0's K/V parcels already sent (victim 1) or not (victim 0); in the commit, stage 0 committed and stage 1
not (victim 1) or no stage committed (victim 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from services.testing.harness import RunningGateway

HOLD_S = 1.0  # each held phase's hold: long enough to freeze the victim between polls (every 20 ms; the pipeline
# is drained while a move or commit is held, so the gateway answers at once)
HOLD_ENV = "STAGEMESH_RESPLIT_HOLD"
PHASES = ("prepare", "move", "commit")


def hold_everywhere() -> str:
    """The STAGEMESH_RESPLIT_HOLD value that holds before every phase a stage can be killed in."""
    return ",".join(f"{phase}:{HOLD_S:g}" for phase in PHASES)


def mesh_pipeline(gw: RunningGateway) -> dict:
    return json.loads(gw.get("/v1/mesh")[1])["pipelines"][0]


async def _phase_is(gw: RunningGateway, want: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(mesh_pipeline, gw)).get("resplit_phase") != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"the re-split never showed phase {want!r} in /v1/mesh within {timeout:g} s")
        await asyncio.sleep(0.02)


async def resplit_with_a_kill(gw: RunningGateway, split: str, phase: str, victim: int) -> dict:
    """POST /v1/mesh/resplit {split} and SIGKILL stage `victim` with `phase`'s message in hand (the module's
    docstring). Returns the POST's status and answer, and the victim's pid."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        post = asyncio.create_task(s.post(gw.url + "/v1/mesh/resplit", json={"split": split}))
        try:
            await _phase_is(gw, f"{phase} (held)", 120)
            pid = gw.stage_pids()[victim]
            os.kill(pid, signal.SIGSTOP)
            try:
                await _phase_is(gw, phase, 2 * HOLD_S + 5)
            finally:
                os.kill(pid, signal.SIGKILL)
            r = await post
            answer = await r.text()
        finally:
            post.cancel()
    return {"split": split, "phase": phase, "victim": victim, "status": r.status, "answer": answer[:400], "pid": pid}


def one_split(gw: RunningGateway, stages: int) -> dict:
    """The mesh's state once it settled: the gateway's route (/v1/mesh's split), each stage's layers (its /info),
    whether they agree and cover every layer once, and each stage's KV slots in use."""
    infos = [gw.stage_info(i) for i in range(stages)]
    layers = [list(i.layers) for i in infos]
    route = mesh_pipeline(gw)["split"]
    bounds = [b for r in layers[:-1] for b in r[1:]]
    covered = layers[0][0] == 0 and layers[-1][1] == infos[0].num_layers and all(
        a[1] == b[0] for a, b in zip(layers, layers[1:]))
    return {"route": route, "stage_layers": layers, "agree": route == ",".join(map(str, bounds)) and covered,
            "kv_slots_used": [i.kv_slots_used for i in infos]}


async def settled(gw: RunningGateway, stages: int, timeout: float = 300) -> dict:
    """Wait until the gateway is ready, no re-split (nor a commit sent again) runs, and no KV slot is held; then
    one_split. AssertionError naming the last state after `timeout`."""
    deadline, state = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            ready = (await asyncio.to_thread(gw.get, "/ready"))[0] == 200
            pipe = await asyncio.to_thread(mesh_pipeline, gw)
            state = await asyncio.to_thread(one_split, gw, stages)
        except (OSError, ValueError, KeyError):
            ready = False
        if ready and pipe.get("resplit_phase") is None and state["kv_slots_used"] == [0] * stages:
            return state
        await asyncio.sleep(0.25)
    raise AssertionError(f"the mesh did not settle within {timeout:g} s: {state}")
