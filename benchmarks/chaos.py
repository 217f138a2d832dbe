"""Chaos: 16 greedy streams run continuously against `stagemesh up` while a random stage is SIGKILLed every
--kill-every seconds for --duration seconds. `up` restarts a dead stage and the gateway replays what it was serving,
so every request must complete (the failure count is expected to be 0). Each text is also compared with its
undisturbed run. With --batch-invariant (passed to `up`) every text must equal it, so a mismatch is a failure;
without it a replayed greedy stream may legitimately differ in its tail (the batch it ran in changed), so mismatches
are only reported.

Then three targeted faults (issue 31), each on the same `up`:
- leavers: streams run, a stage is SIGKILLed, the clients leave while the gateway waits to replay them; once the
  stage is back, every stage's KV slots must be free again within seconds (not at the slot lease's end).
- two-deaths: streams run while one stage, then another, is SIGKILLed (each restarted by `up`) inside the same
  requests; every stream must complete, and with --batch-invariant equal its undisturbed run.
- wrong-keys: one stage's key files are replaced by another key set's and the stage is SIGKILLed, so `up` restarts
  it with the wrong keys (a rotation that reached one host first); the gateway must report not ready, naming that
  stage, within seconds of the stage answering; with the keys back it must serve again.

And resplit (issue 55: the live re-split under faults): greedy streams run while a live re-split moves the first
boundary, and a stage is SIGKILLed with one of its phases in hand (services/testing/resplit_faults.py: the prepare,
the K/V move with stage 0's parcels sent or not, the commit with stage 0 committed); every stream must finish with its
undisturbed text (under --batch-invariant), the mesh settle in one split that the stages and the gateway's route
agree on (the old one unless the commit was sent), every KV slot free, and a re-split afterwards be done. Then, on a
mesh and gateway of its own, the gateway is SIGKILLed while a re-split is held before its commit (the K/V moved) and
started again: the resumable streams resume with their undisturbed texts, and the mesh moves again.

And, on a mesh of its own (issue 55: this wave's features under faults), survive: seeded resumable streams (the
durable request log) with n-gram drafts on (--speculation on), under --batch-invariant always; a stage is SIGKILLed
a third of the way in (restarted; the gateway replays), the gateway itself two thirds of the way in (started again on
its state directory; it re-adopts the requests), and every client resumes by its Last-Event-ID: every text must
equal its undisturbed run, chunk by chunk.

    python -m benchmarks.chaos [--stages 2] [--duration 180] [--kill-every 20] [--max-tokens 48] [--dtype D]
        [--batch-invariant] [--scenarios kills,leavers,two-deaths,wrong-keys,survive,resplit] [--out results.json]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

import aiohttp

from loadtest.client import send_sse
from services.testing.harness import (
    RunningGateway,
    add_dtype_arg,
    children,
    dtype_label,
    free_port,
    running_up,
)
from services.testing.resplit_faults import (
    HOLD_ENV,
    hold_everywhere,
    mesh_pipeline,
    resplit_with_a_kill,
    settled,
)
from services.testing.resumable import Deployment, Events, body, compare, resume, stream, undisturbed
from shared.wire.mesh_keys import write_key_set

SCENARIOS = ("kills", "leavers", "two-deaths", "wrong-keys", "survive", "resplit")

STREAMS = 16
PROMPTS = [f"Write a few sentences about topic number {i}: " + t for i, t in enumerate(
    ["rivers", "mountains", "bread", "trains", "owls", "chess", "rain", "copper", "tea", "maps", "bells", "salt",
     "kites", "glass", "moss", "clocks"])]


async def one(session, url: str, i: int, max_tokens: int):
    return await send_sse(session, url, "openai", "smollm2", PROMPTS[i], 0, max_tokens, ignore_eos=True,
                          temperature=0.0)


async def reference(url: str, max_tokens: int, streams: int = STREAMS) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        results = await asyncio.gather(*(one(s, url, i, max_tokens) for i in range(streams)))
    bad = [r.error for r in results if not r.success]
    if bad:
        raise SystemExit(f"the undisturbed run failed: {bad[0]}")
    return [r.text for r in results]


async def chaos(url: str, up_pid: int, ref: list[str], duration: float, kill_every: float, max_tokens: int) -> dict:
    stats = {"completed": 0, "failed": 0, "differs": 0, "kills": 0, "errors": []}
    end = time.monotonic() + duration

    async def stream_loop(s, i: int) -> None:
        while time.monotonic() < end:
            r = await one(s, url, i, max_tokens)
            if not r.success:
                stats["failed"] += 1
                stats["errors"].append(r.error[:200])
                continue
            stats["completed"] += 1
            stats["differs"] += r.text != ref[i]

    async def killer() -> None:
        rng = random.Random(0)
        while time.monotonic() + kill_every < end:
            await asyncio.sleep(kill_every)
            stages = children(up_pid)
            if stages:
                victim = rng.choice(stages)
                os.kill(victim, signal.SIGKILL)
                stats["kills"] += 1
                print(f"  t={duration - (end - time.monotonic()):.0f}s: SIGKILL stage pid {victim}", flush=True)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        await asyncio.gather(killer(), *(stream_loop(s, i) for i in range(STREAMS)))
    return stats


# ---- targeted faults ----------------------------------------------------------------------------------------------

async def until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `cond` held (polled every 0.1 s off the loop); SystemExit naming `what` after `timeout`."""
    t0 = time.monotonic()
    while not await asyncio.to_thread(cond):
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"chaos: {what} (after {timeout:g} s)")
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def _metric(gw: RunningGateway, name: str, **labels: str) -> float:
    value = gw.metric(name, **labels)
    return 0.0 if value != value else value


def _ready(gw: RunningGateway) -> bool:
    try:
        return gw.get("/ready")[0] == 200
    except OSError:
        return False


def _problem(gw: RunningGateway) -> str:
    try:
        status, body = gw.get("/ready")
    except OSError:
        return ""
    return "" if status == 200 else (json.loads(body).get("problem") or "")


def _kv_used(gw: RunningGateway, n: int) -> list[int | None]:
    out = []
    for i in range(n):
        try:
            out.append(gw.stage_info(i).kv_slots_used)
        except (OSError, ValueError, KeyError):
            out.append(None)
    return out


async def _kill(gw: RunningGateway, index: int) -> None:
    """SIGKILL stage `index` and wait until the gateway has noticed and `up` has it ready again."""
    failovers = _metric(gw, "stagemesh_gateway_pipeline_failovers_total")
    os.kill(gw.stage_pids()[index], signal.SIGKILL)
    await until(lambda: _metric(gw, "stagemesh_gateway_pipeline_failovers_total") > failovers, 60,
                f"the gateway never noticed stage {index}'s death")
    await until(lambda: _ready(gw), 300, f"the gateway never became ready after stage {index} restarted")


async def leavers(gw: RunningGateway, stages: int, max_tokens: int) -> dict:
    """Clients leave during an outage; seconds from the gateway's readiness to every stage's slots free."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        tasks = [asyncio.create_task(one(s, gw.url, i, max_tokens)) for i in range(8)]
        await until(lambda: min(u or 0 for u in _kv_used(gw, stages)) >= 8, 120, "the streams never took their slots")
        failovers = _metric(gw, "stagemesh_gateway_pipeline_failovers_total")
        os.kill(gw.stage_pids()[stages - 1], signal.SIGKILL)
        await until(lambda: _metric(gw, "stagemesh_gateway_pipeline_failovers_total") > failovers, 60,
                    "the gateway never noticed the death")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    held = [u for u in _kv_used(gw, stages) if u is not None]  # the survivors still hold the leavers' slots
    await until(lambda: _ready(gw), 300, "the gateway never became ready again")
    freed_s = await until(lambda: _kv_used(gw, stages) == [0] * stages, 60, "slots still held after recovery")
    return {"clients": 8, "slots_held_by_survivors_during_outage": held, "slots_zero_after_ready_s": round(freed_s, 2),
            "ok": freed_s < 10}


async def two_deaths(gw: RunningGateway, stages: int, max_tokens: int, ref: list[str], streams: int) -> dict:
    """Two stage deaths inside the same requests: every stream completes; texts compared with the undisturbed run."""
    replayed = _metric(gw, "stagemesh_gateway_replayed_sequences_total")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        tasks = [asyncio.create_task(one(s, gw.url, i, max_tokens)) for i in range(streams)]
        await until(lambda: min(u or 0 for u in _kv_used(gw, stages)) >= streams, 120, "the streams never started")
        victims = [stages - 1, 0]
        for victim in victims:
            await _kill(gw, victim)
        mid_stream = not any(t.done() for t in tasks)  # both deaths fell inside every request
        results = await asyncio.gather(*tasks)
    failed = [r.error[:200] for r in results if not r.success]
    differs = sum(r.success and r.text != want for r, want in zip(results, ref))
    return {"streams": streams, "deaths": victims, "both_deaths_mid_stream": mid_stream, "failed": len(failed),
            "errors": failed[:3], "differs": differs,
            "replayed": _metric(gw, "stagemesh_gateway_replayed_sequences_total") - replayed}


async def wrong_keys(gw: RunningGateway, stages: int) -> dict:
    """Stage `stages - 1` restarted by `up` with another key set: seconds to not ready, naming it; then the keys back."""
    index = stages - 1
    argv = open(f"/proc/{gw.stage_pids()[index]}/cmdline").read().split("\0")
    keys_dir = argv[argv.index("--keys") + 1]
    role = f"stage{index}"
    saved = tempfile.mkdtemp(prefix="stagemesh-chaos-keys-")
    other = os.path.join(saved, "other")
    write_key_set(other, stages)
    for suffix in (".key", ".key_secret"):
        shutil.copy2(os.path.join(keys_dir, role + suffix), os.path.join(saved, role + suffix))
    try:
        for suffix in (".key", ".key_secret"):
            shutil.copy2(os.path.join(other, role + suffix), os.path.join(keys_dir, role + suffix))
        before = gw.stage_info(index).incarnation
        t_kill = time.monotonic()
        os.kill(gw.stage_pids()[index], signal.SIGKILL)
        await until(lambda: _incarnation(gw, index) not in (None, before), 300, "up never restarted the stage")
        t_up = time.monotonic()
        await until(lambda: f"stage {index}" in _problem(gw) and "key" in _problem(gw), 60,
                    "the gateway never named the stage with the wrong keys")
        named_s, problem = time.monotonic() - t_up, _problem(gw)
        total_s = time.monotonic() - t_kill
    finally:
        for suffix in (".key", ".key_secret"):
            shutil.copy2(os.path.join(saved, role + suffix), os.path.join(keys_dir, role + suffix))
        shutil.rmtree(saved, ignore_errors=True)
    os.kill(gw.stage_pids()[index], signal.SIGKILL)
    back_s = await until(lambda: _ready(gw), 300, "the gateway never became ready with the keys back")
    return {"stage": index, "not_ready_after_stage_answered_s": round(named_s, 2), "from_kill_s": round(total_s, 2),
            "problem": problem, "ready_again_s": round(back_s, 2), "ok": named_s < 10}


async def survive(stages: int, streams: int, max_tokens: int) -> dict:
    """The survive scenario (the module's docstring), on a mesh and gateway of its own."""
    work = tempfile.mkdtemp(prefix="stagemesh-chaos-survive-")
    dep = Deployment("gateway", stages, os.path.join(work, "state"), work, free_port(),
                     gateway_flags=["--speculation", "on"])
    try:
        await asyncio.to_thread(dep.start)
        ref = await undisturbed(dep.gw.url, streams, max_tokens)
        seen: list[Events] = [[] for _ in range(streams)]

        async def read(fraction: float) -> None:
            while sum(len(e) for e in seen) < streams * max_tokens * fraction:
                await asyncio.sleep(0.05)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            tasks = [asyncio.create_task(stream(s, dep.gw.url, body(i, max_tokens, True, f"c-{i}"), seen[i]))
                     for i in range(streams)]
            await read(1 / 3)
            await asyncio.to_thread(dep.kill_stage, stages - 1)
            print(f"  survive: SIGKILLed stage {stages - 1} after {sum(map(len, seen))} events", flush=True)
            await read(2 / 3)
            failovers = _metric(dep.gw, "stagemesh_gateway_pipeline_failovers_total")
            drafted = sum(dep.gw.metric("stagemesh_gateway_speculation_drafted_tokens_total", source=source)
                          for source in ("context", "pool"))
            await asyncio.to_thread(dep.kill)
            print(f"  survive: SIGKILLed the gateway after {sum(map(len, seen))} events", flush=True)
            await asyncio.gather(*tasks)
        gw = await asyncio.to_thread(dep.start)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            statuses = await asyncio.gather(*(resume(s, gw.url, seen[i][0][1]["id"], seen[i]) for i in range(streams)))
        return {**compare(seen, ref), "resume_statuses": sorted(set(statuses)), "failovers_before_gateway_kill":
                failovers, "drafted_tokens_before_gateway_kill": drafted, "max_tokens": max_tokens}
    finally:
        await asyncio.to_thread(dep.stop)


RESPLIT_CASES = [("prepare", -1), ("move", -1), ("move", 0), ("commit", -1), ("commit", 0)]  # (phase, victim stage)


def _moved(route: str, by: int) -> str:
    """`route` (a split's boundaries) with its first boundary moved by `by` layers."""
    first, *rest = route.split(",")
    return ",".join([str(int(first) + by), *rest])


async def resplit_kills(gw: RunningGateway, stages: int, streams: int, max_tokens: int) -> dict:
    """The resplit scenario's stage kills (the module's docstring) on `up` (held: STAGEMESH_RESPLIT_HOLD)."""
    ref = await reference(gw.url, max_tokens, streams)
    cases = []
    for n, (phase, victim) in enumerate(RESPLIT_CASES):
        victim %= stages
        before = (await settled(gw, stages))["route"]
        split = _moved(before, 3 if n % 2 == 0 else -3)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            tasks = [asyncio.create_task(one(s, gw.url, i, max_tokens)) for i in range(streams)]
            await until(lambda: min(u or 0 for u in _kv_used(gw, stages)) >= streams, 120, "the streams never started")
            killed = await resplit_with_a_kill(gw, split, phase, victim)
            mid_stream = not any(t.done() for t in tasks)
            results = await asyncio.gather(*tasks)
        state = await settled(gw, stages)
        want = split if phase == "commit" else before
        case = {"phase": phase, "victim": victim, "split_before": before, "split_asked": split,
                "resplit_status": killed["status"], "answer": killed["answer"][:200], "kill_mid_stream": mid_stream,
                "failed": sum(not r.success for r in results), "errors": [r.error[:200] for r in results
                                                                         if not r.success][:2],
                "differs": sum(r.success and r.text != want_text for r, want_text in zip(results, ref)),
                **state, "ends_in_expected_split": state["route"] == want}
        cases.append(case)
        print(f"  resplit: stage {victim} killed in the {phase} ({before} -> {split}): answered {killed['status']}, "
              f"{case['failed']} failed, {case['differs']} differ; mesh ends in {state['route']} (stages "
              f"{state['stage_layers']}, agree: {state['agree']}), KV slots {state['kv_slots_used']}", flush=True)
    after = (await settled(gw, stages))["route"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        async with s.post(gw.url + "/v1/mesh/resplit", json={"split": _moved(after, 2)}) as r:
            again = {"status": r.status, "answer": (await r.text())[:300]}
    again.update(await settled(gw, stages))
    texts = await reference(gw.url, max_tokens, streams)
    again["differs"] = sum(t != want_text for t, want_text in zip(texts, ref))
    return {"streams": streams, "max_tokens": max_tokens, "cases": cases, "resplit_after": again,
            "resplits": {o: _metric(gw, "stagemesh_gateway_resplits_total", outcome=o, trigger="asked")
                         for o in ("done", "refused", "failed", "recommitted")}}


async def resplit_gateway_kill(stages: int, streams: int, max_tokens: int) -> dict:
    """The resplit scenario's gateway kill (the module's docstring), on a mesh and gateway of its own."""
    work = tempfile.mkdtemp(prefix="stagemesh-chaos-resplit-")
    dep = Deployment("gateway", stages, os.path.join(work, "state"), work, free_port())
    try:
        await asyncio.to_thread(dep.start)
        ref = await undisturbed(dep.gw.url, streams, max_tokens)
        before = (await settled(dep.gw, stages))["route"]
        seen: list[Events] = [[] for _ in range(streams)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            tasks = [asyncio.create_task(stream(s, dep.gw.url, body(i, max_tokens, True, f"r-{i}"), seen[i]))
                     for i in range(streams)]
            while sum(len(e) for e in seen) < streams * max_tokens / 4:
                await asyncio.sleep(0.05)
            post = asyncio.create_task(s.post(dep.gw.url + "/v1/mesh/resplit", json={"split": _moved(before, 3)}))
            t0 = time.monotonic()
            while mesh_pipeline(dep.gw).get("resplit_phase") != "commit (held)":
                if time.monotonic() - t0 > 120:
                    raise SystemExit("chaos: the re-split never reached its commit")
                await asyncio.sleep(0.02)
            at = sum(map(len, seen))
            await asyncio.to_thread(dep.kill)
            print(f"  resplit: SIGKILLed the gateway held before a re-split's commit after {at} events", flush=True)
            await asyncio.gather(*tasks, return_exceptions=True)
            post.cancel()
            await asyncio.gather(post, return_exceptions=True)
        gw = await asyncio.to_thread(dep.start)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            statuses = await asyncio.gather(*(resume(s, gw.url, seen[i][0][1]["id"], seen[i]) for i in range(streams)))
        state = await settled(gw, stages)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            async with s.post(gw.url + "/v1/mesh/resplit", json={"split": _moved(state["route"], -2)}) as r:
                again = {"status": r.status, "answer": (await r.text())[:300]}
        again.update(await settled(gw, stages))
        return {**compare(seen, ref), "resume_statuses": sorted(set(statuses)), "events_before_kill": at,
                "split_before": before, **state, "resplit_after": again}
    finally:
        await asyncio.to_thread(dep.stop)


def _incarnation(gw: RunningGateway, index: int) -> str | None:
    """The stage's incarnation id, or None while it does not answer."""
    try:
        return gw.stage_info(index).incarnation
    except (OSError, ValueError, KeyError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of chaos (default 180)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between SIGKILLs (default 20)")
    ap.add_argument("--max-tokens", type=int, default=48)
    add_dtype_arg(ap)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="run the stages batch-invariant: every text must then equal its undisturbed run")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--death-tokens", type=int, default=160,
                    help="max_tokens of the two-deaths streams: long enough that both deaths fall inside them")
    ap.add_argument("--death-streams", type=int, default=4, help="streams of the two-deaths scenario (default 4)")
    ap.add_argument("--survive-streams", type=int, default=8, help="streams of the survive scenario (default 8)")
    ap.add_argument("--resplit-streams", type=int, default=8, help="greedy streams of the resplit scenario (default 8)")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = ap.parse_args()
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        ap.error(f"--scenarios must name some of {', '.join(SCENARIOS)}")
    extra = ["--batch-invariant"] if args.batch_invariant else []
    results: dict = {"stages": args.stages, "dtype": dtype_label(args.dtype), "batch_invariant": args.batch_invariant}
    logs = tempfile.mkdtemp(prefix="stagemesh-chaos-")  # kept: the stage logs of a failed run are the evidence
    if "resplit" in scenarios:  # re-splits hold before each phase (only the resplit scenario re-splits)
        os.environ[HOLD_ENV] = hold_everywhere()
    if "survive" in scenarios:
        results["survive"] = r = asyncio.run(survive(args.stages, args.survive_streams, args.death_tokens))
        r["ok"] = r["identical"] == r["streams"] and not r["gaps_or_duplicates"] and r["resume_statuses"] == [200]
        print(f"survive: {r['streams']} resumable streams, drafts on ({r['drafted_tokens_before_gateway_kill']:.0f} "
              f"drafted), a stage then the gateway SIGKILLed ({r['failovers_before_gateway_kill']:.0f} failover): "
              f"{r['identical']}/{r['streams']} with the undisturbed text, {r['gaps_or_duplicates']} with a gap or "
              f"duplicate", flush=True)
    if "resplit" in scenarios:
        results["resplit_gateway"] = r = asyncio.run(resplit_gateway_kill(args.stages, args.survive_streams,
                                                                          args.death_tokens))
        again = r["resplit_after"]
        r["ok"] = (r["identical"] == r["streams"] and not r["gaps_or_duplicates"] and r["resume_statuses"] == [200]
                   and r["agree"] and again["status"] == 200 and again["agree"])
        print(f"resplit, gateway killed before a commit: {r['identical']}/{r['streams']} resumed streams with the "
              f"undisturbed text, {r['gaps_or_duplicates']} with a gap or duplicate; mesh in {r['route']} (agree: "
              f"{r['agree']}); a re-split after: {again['status']}", flush=True)
    with (running_up(args.stages, *extra, dtype=args.dtype, log_dir=logs) if set(scenarios) - {"survive"}
          else contextlib.nullcontext()) as gw:
        if "kills" in scenarios:
            ref = asyncio.run(reference(gw.url, args.max_tokens))
            print(f"undisturbed run done; chaos for {args.duration:.0f} s, a SIGKILL every {args.kill_every:.0f} s",
                  flush=True)
            stats = asyncio.run(chaos(gw.url, gw.proc.pid, ref, args.duration, args.kill_every, args.max_tokens))
            stats["errors"] = stats["errors"][:5]
            stats.update(duration_s=args.duration, kill_every_s=args.kill_every, max_tokens=args.max_tokens)
            results["kills"] = stats
            expectation = "expected 0" if args.batch_invariant else "allowed without --batch-invariant"
            print(f"{stats['kills']} stage kills, {stats['completed']} requests completed, {stats['failed']} failed "
                  f"(expected 0); {stats['differs']} completed texts differ from their undisturbed run "
                  f"({expectation})", flush=True)
        if "leavers" in scenarios:
            results["leavers"] = r = asyncio.run(leavers(gw, args.stages, 400))
            print(f"leavers: {r['clients']} clients left during an outage; slots free {r['slots_zero_after_ready_s']} s "
                  f"after the gateway was ready again", flush=True)
        if "two-deaths" in scenarios:
            ref = asyncio.run(reference(gw.url, args.death_tokens, args.death_streams))
            results["two_deaths"] = r = asyncio.run(two_deaths(gw, args.stages, args.death_tokens, ref,
                                                               args.death_streams))
            print(f"two deaths: {r['streams']} streams, {r['failed']} failed, {r['differs']} differ from their "
                  f"undisturbed run, {r['replayed']:.0f} replays, both deaths mid-stream: {r['both_deaths_mid_stream']}",
                  flush=True)
        if "resplit" in scenarios:
            results["resplit"] = r = asyncio.run(resplit_kills(gw, args.stages, args.resplit_streams,
                                                               args.death_tokens))
            again = r["resplit_after"]
            r["ok"] = (all(c["failed"] == 0 and c["agree"] and c["ends_in_expected_split"]
                           and c["kv_slots_used"] == [0] * args.stages
                           and (c["differs"] == 0 or not args.batch_invariant) for c in r["cases"])
                       and again["status"] == 200 and again["agree"]
                       and (again["differs"] == 0 or not args.batch_invariant))
            print(f"resplit: {len(r['cases'])} stage kills inside re-splits, {sum(c['failed'] for c in r['cases'])} "
                  f"failed, {sum(c['differs'] for c in r['cases'])} differ, every time one split: "
                  f"{all(c['agree'] and c['ends_in_expected_split'] for c in r['cases'])}; a re-split after: "
                  f"{again['status']}, outcomes {r['resplits']}", flush=True)
        if "wrong-keys" in scenarios:
            results["wrong_keys"] = r = asyncio.run(wrong_keys(gw, args.stages))
            print(f"wrong keys: not ready {r['not_ready_after_stage_answered_s']} s after stage {r['stage']} answered "
                  f"({r['from_kill_s']} s from its kill): {r['problem']}", flush=True)
    failed = (results.get("kills", {}).get("failed") or results.get("two_deaths", {}).get("failed")
              or (args.batch_invariant and (results.get("kills", {}).get("differs")
                                            or results.get("two_deaths", {}).get("differs")))
              or not results.get("leavers", {}).get("ok", True) or not results.get("wrong_keys", {}).get("ok", True)
              or not results.get("survive", {}).get("ok", True) or not results.get("resplit", {}).get("ok", True)
              or not results.get("resplit_gateway", {}).get("ok", True))
    results["passed"] = not failed
    if args.json:
        print(json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    for e in results.get("kills", {}).get("errors", []) + results.get("two_deaths", {}).get("errors", []):
        print("  error:", e)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
