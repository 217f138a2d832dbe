"""Streams that survive (issue 57), on one mesh of --stages stages under --batch-invariant, each phase against the texts
of --streams seeded streams run undisturbed first:

- disconnects: every client drops its connection twice at random points, the second time right after a resume,
  before reading any event (the case where a client that keeps no cursor loses its place), and resumes by its
  Last-Event-ID;
- a gateway SIGKILL mid-stream (--kill gateway: the gateway process alone, the stages live on and keep the K/V;
  --kill up: `stagemesh up`, its stages die with it), restarted on the same state directory and port; every client
  reconnects with its Last-Event-ID;
- the request log's cost: output tokens/s of resumable (logged) streams against the same streams not logged,
  alternated --rounds times on the restarted gateway.

Reports texts identical to the undisturbed run (expected all), streams with a gap or a duplicate event (expected
none), and for the restart the time from the new gateway's readiness to each stream's first resumed event.

    python -m benchmarks.restart [--streams 32] [--stages 2] [--max-tokens 48] [--kill gateway|up|both]
                                 [--rounds 2] [--out DIR]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp

from services.process.launch import LocalMesh, start_mesh
from services.testing.harness import Report, RunningGateway, add_out_arg, free_port, start_up

PROMPT = "Tell me a story about the number {i}."
Events = list[tuple[str | None, object]]  # (event id, data: a chunk's JSON or "[DONE]")


def body(i: int, max_tokens: int, resumable: bool, salt: str) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT.format(i=i)}], "max_tokens": max_tokens, "seed": 1000 + i,
            "temperature": 0.9, "ignore_eos": True, "stream": True, "resumable": resumable, "cache_salt": salt}


async def read_sse(resp, events: Events, first: list | None = None, limit: int | None = None) -> None:
    """Append (event id, data) to `events` as they come, until [DONE], the connection's end, or `limit` events read
    in this call (then returns, the connection left for the caller to drop); `first` gets the time.monotonic() of
    the first one."""
    current, read = None, 0
    async for raw in resp.content:
        if first is not None and not first and raw.startswith(b"data: "):
            first.append(time.monotonic())
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            current = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((current, data if data == "[DONE]" else json.loads(data)))
            current, read = None, read + 1
            if data == "[DONE]" or (limit is not None and read >= limit):
                return


def text(events: Events) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in events
                   if isinstance(d, dict) and d.get("choices"))


def last_id(events: Events) -> str | None:
    return next((eid for eid, _ in reversed(events) if eid), None)


def chunks(events: Events) -> list[tuple[int, str]]:
    """(event offset, its chunk's choices) in the order read: what a reader sees, less the ids and times that
    differ between runs. One event may send several chunks (same offset) or none (text held back)."""
    return [(int(eid.split(":")[1]), json.dumps(d.get("choices"), sort_keys=True)) for eid, d in events
            if eid and isinstance(d, dict)]


async def stream(s, url: str, b: dict, events: Events) -> None:
    try:
        async with s.post(url + "/v1/chat/completions", json=b) as r:
            await read_sse(r, events)
    except (TimeoutError, aiohttp.ClientError):
        pass  # the gateway died under it: the client keeps what it read


async def resume(s, url: str, rid: str, events: Events, limit: int | None = None, first: list | None = None) -> int:
    """GET the stream again after the last event read; returns the HTTP status."""
    last = last_id(events)
    async with s.get(f"{url}/v1/streams/{rid}", headers={"Last-Event-ID": last} if last else {}) as r:
        if r.status == 200 and limit != 0:
            await read_sse(r, events, first, limit)
        return r.status


async def undisturbed(url: str, n: int, max_tokens: int) -> list[Events]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        runs: list[Events] = [[] for _ in range(n)]
        await asyncio.gather(*(stream(s, url, body(i, max_tokens, False, f"u-{i}"), runs[i]) for i in range(n)))
    return runs


def compare(runs: list[Events], ref: list[Events]) -> dict:
    """identical: texts equal to the undisturbed run's; gaps_or_duplicates: streams whose chunks, offset by offset,
    are not the undisturbed run's (a chunk missed or read twice across a reconnect)."""
    return {"streams": len(ref), "identical": sum(text(r) == text(f) and bool(text(f)) for r, f in zip(runs, ref)),
            "gaps_or_duplicates": sum(chunks(r) != chunks(f) for r, f in zip(runs, ref))}


async def disconnects(url: str, ref: list[Events], max_tokens: int, rng: random.Random) -> dict:
    """Each client reads a random number of events, drops the connection, resumes and drops again before reading
    any event, then resumes and reads to the end."""
    n = len(ref)
    runs: list[Events] = [[] for _ in range(n)]
    statuses: list[list[int]] = [[] for _ in range(n)]

    async def client(i: int, s) -> None:
        async with s.post(url + "/v1/chat/completions", json=body(i, max_tokens, True, f"d-{i}")) as r:
            await read_sse(r, runs[i], limit=rng.randint(2, max_tokens // 2))  # then the connection is dropped
        rid = runs[i][0][1]["id"]
        await asyncio.sleep(rng.uniform(0, 0.5))
        statuses[i].append(await resume(s, url, rid, runs[i], limit=0))  # dropped before its first event
        await asyncio.sleep(rng.uniform(0, 0.5))
        statuses[i].append(await resume(s, url, rid, runs[i]))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        await asyncio.gather(*(client(i, s) for i in range(n)))
    return {**compare(runs, ref), "resume_statuses": sorted({st for sts in statuses for st in sts})}


@dataclass
class Deployment:
    """A mesh and its gateway with a state directory; kill() SIGKILLs the gateway (--kill gateway: its process
    alone; up: `stagemesh up`, stages and all) and restart() starts it again on the same directory and port."""

    kill_what: str
    stages: int
    state: str
    logs: str
    port: int
    mesh: LocalMesh | None = None
    gw: RunningGateway | None = None
    starts: int = 0

    def start(self) -> RunningGateway:
        self.starts += 1
        logs = os.path.join(self.logs, f"start-{self.starts}")
        os.makedirs(logs, exist_ok=True)
        if self.kill_what == "up":
            self.gw = start_up(self.stages, None, logs, "--batch-invariant", "--state-dir", self.state, port=self.port)
            return self.gw
        if self.mesh is None:
            self.mesh = start_mesh("smollm2", self.stages, log_dir=logs, extra=["--batch-invariant"])
        log_path = os.path.join(logs, "gateway.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--model", "smollm2",
                                     "--stages", ",".join(self.mesh.stage_urls), "--listen", f"127.0.0.1:{self.port}",
                                     "--result-listen", self.mesh.result_listen, "--keys", self.mesh.keys_dir,
                                     "--state-dir", self.state], stdout=log, stderr=subprocess.STDOUT)
        self.gw = RunningGateway(f"http://127.0.0.1:{self.port}", proc, log_path)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited: {open(log_path).read()[-2000:]}")
            try:
                if self.gw.get("/ready")[0] == 200:
                    return self.gw
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the gateway was not ready in 240 s: {open(log_path).read()[-2000:]}")

    def kill(self) -> None:
        os.kill(self.gw.proc.pid, signal.SIGKILL)
        self.gw.proc.wait(30)

    def stop(self) -> None:
        if self.gw is not None:
            self.gw.stop()
        if self.mesh is not None:
            self.mesh.stop()


async def kill_and_resume(dep: Deployment, ref: list[Events], max_tokens: int) -> dict:
    n = len(ref)
    seen: list[Events] = [[] for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        tasks = [asyncio.create_task(stream(s, dep.gw.url, body(i, max_tokens, True, f"r-{i}"), seen[i]))
                 for i in range(n)]
        while sum(len(e) for e in seen) < n * max_tokens // 3:  # a third of the way in
            await asyncio.sleep(0.05)
        dep.kill()
        await asyncio.gather(*tasks)
    cut = [len(e) for e in seen]
    gw = dep.start()
    ready = time.monotonic()
    firsts: list[float | None] = [None] * n
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        async def again(i: int) -> None:
            first: list[float] = []
            statuses.append(await resume(s, gw.url, seen[i][0][1]["id"], seen[i], first=first))
            firsts[i] = first[0] - ready if first else None
        await asyncio.gather(*(again(i) for i in range(n)))
    waits = [w for w in firsts if w is not None]
    return {"kill": dep.kill_what, **compare(seen, ref), "resume_statuses": sorted(set(statuses)),
            "events_before_kill": {"min": min(cut), "max": max(cut)},
            "first_resumed_event_s": {"p50": round(statistics.median(waits), 3) if waits else None,
                                      "max": round(max(waits), 3) if waits else None, "resumed": len(waits)}}


async def tokens_per_s(url: str, streams: int, max_tokens: int, resumable: bool, salt: str) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()
        runs: list[Events] = [[] for _ in range(streams)]
        await asyncio.gather(*(stream(s, url, body(i, max_tokens, resumable, f"{salt}-{i}"), runs[i])
                               for i in range(streams)))
        return streams * max_tokens / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kill", choices=["gateway", "up", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="where the clients drop their connections")
    add_out_arg(ap, "restart")
    args = ap.parse_args()
    report = Report("restart", args.out)
    res: dict = {"streams": args.streams, "stages": args.stages, "max_tokens": args.max_tokens}
    for kill_what in (["gateway", "up"] if args.kill == "both" else [args.kill]):
        work = tempfile.mkdtemp(prefix=f"stagemesh-restart-{kill_what}-")
        dep = Deployment(kill_what, args.stages, os.path.join(work, "state"), work, free_port())
        try:
            dep.start()
            ref = asyncio.run(undisturbed(dep.gw.url, args.streams, args.max_tokens))
            if "disconnects" not in res:
                d = res["disconnects"] = asyncio.run(disconnects(dep.gw.url, ref, args.max_tokens,
                                                                 random.Random(args.seed)))
                report.say(f"disconnects: {d['streams']} seeded resumable streams, each dropped twice (once right "
                           f"after a resume): {d['identical']}/{d['streams']} with the undisturbed text, "
                           f"{d['gaps_or_duplicates']} with a gap or duplicate; resumes answered {d['resume_statuses']}")
            k = res[f"kill_{kill_what}"] = asyncio.run(kill_and_resume(dep, ref, args.max_tokens))
            what = "the gateway alone" if kill_what == "gateway" else "up (its stages die with it)"
            report.say(f"{k['streams']} seeded resumable streams, {what} SIGKILLed after {k['events_before_kill']} "
                       f"events each, restarted on its state directory: {k['identical']}/{k['streams']} with the "
                       f"undisturbed text, {k['gaps_or_duplicates']} with a gap or duplicate; first resumed event "
                       f"{k['first_resumed_event_s']['p50']} s after readiness (p50), "
                       f"{k['first_resumed_event_s']['max']} s (max)")
            if kill_what == "gateway" or args.kill == "up":
                logged, plain = [], []
                for r in range(args.rounds):  # alternated: the machine's drift falls on both
                    plain.append(asyncio.run(tokens_per_s(dep.gw.url, args.streams, args.max_tokens, False, f"p{r}")))
                    logged.append(asyncio.run(tokens_per_s(dep.gw.url, args.streams, args.max_tokens, True, f"l{r}")))
                res["cost"] = {"logged_tok_s": [round(x, 1) for x in logged],
                               "unlogged_tok_s": [round(x, 1) for x in plain],
                               "ratio": round(statistics.median(logged) / statistics.median(plain), 3)}
                report.say(f"the request log's cost at {args.streams} streams: {statistics.median(logged):.1f} tok/s "
                           f"logged against {statistics.median(plain):.1f} not ({res['cost']['ratio']:.3f}x; rounds "
                           f"{res['cost']['logged_tok_s']} / {res['cost']['unlogged_tok_s']})")
        finally:
            dep.stop()
    report.write(res)


if __name__ == "__main__":
    main()
