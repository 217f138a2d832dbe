"""Two pipelines behind one gateway (`stagemesh up --replicas 2 --stages 1 --batch-invariant`), real processes on
loopback: distinct prompts spread across both, a conversation's turns stay where its prefix is cached, a session
sticks, and a SIGKILLed stage's in-flight streams replay on the other pipeline at once, token for token; the mesh
view and `stagemesh status` show the loss and the recovery. The router's choices alone (no processes) are checked
over real Replicas objects in the second half."""

import asyncio
import json
import os
import re
import signal
import subprocess

import aiohttp
import pytest

from services.cli.status import not_ready_reason, render
from services.gateway.engine.core import Engine
from services.gateway.engine.metrics import GatewayMetrics
from services.gateway.engine.pipeline import Pipeline
from services.gateway.engine.prefix_cache import BLOCK_TOKENS
from services.gateway.engine.replicas import BALANCE_ABS, Replica, Replicas
from services.gateway.engine.request import Request
from services.testing.harness import start_up
from shared.batch.sampling import SamplingParams
from tests.conftest import stagemesh_cmd, starts_processes
from tests.stage_infos import make_info
from tests.test_failover import stream
from tests.test_mesh_view import mesh, wait_for


@pytest.fixture(scope="module")
@starts_processes
def gateway(tmp_path_factory):
    gw = start_up(1, "bfloat16", str(tmp_path_factory.mktemp("replicas")), "--replicas", "2", "--batch-invariant",
                  "--stage-poll", "0.5")  # a killed stage seen within half a second
    yield gw
    gw.stop()


def access_log(gw) -> dict[str, str]:
    """request id -> the pipeline the access log (up's gateway.log, in its log directory) says it finished on."""
    with open(os.path.join(os.path.dirname(gw.log_path), "gateway.log")) as f:
        return dict(re.findall(r"request (\w+) pipeline=(p\d+)", f.read()))


def pipelines(gw) -> dict[str, dict]:
    return {p["name"]: p for p in mesh(gw)["pipelines"]}


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with s.post(url + ("/v1/chat/completions" if "messages" in body else "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def seq_id(response: dict) -> str:
    return response["id"].split("-", 1)[1]


async def test_distinct_prompts_spread_and_a_conversation_stays_on_its_cached_prefix(gateway):
    gw = gateway
    assert {p["name"] for p in json.loads(gw.get("/ready")[1])["pipelines"]} == {"p0", "p1"}
    async with aiohttp.ClientSession() as s:
        first = await asyncio.gather(*(post(s, gw.url, {"prompt": f"Fact number {i} about rivers:", "max_tokens": 4})
                                       for i in range(4)))
        went = access_log(gw)
        assert {went[seq_id(r)] for r in first} == {"p0", "p1"}  # distinct prompts: both pipelines serve
        messages = [{"role": "user", "content": "Tell me about lighthouses, their keepers and the sea around them."}]
        turns = []
        for follow_up in ("Why were they painted in stripes?", "And who keeps them today?"):
            r = await post(s, gw.url, {"messages": messages, "max_tokens": 24, "temperature": 0})
            turns.append(r)
            messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                         {"role": "user", "content": follow_up}]
        turns.append(await post(s, gw.url, {"messages": messages, "max_tokens": 8, "temperature": 0}))
        went = access_log(gw)
        assert len({went[seq_id(r)] for r in turns}) == 1  # every turn where the conversation's prefix is cached
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in turns]
        assert cached[0] == 0 and 0 < cached[1] < cached[2]  # cache hits grow with the conversation
        # a session (OpenAI's `user`) sticks whatever the prompt
        alice = [await post(s, gw.url, {"prompt": f"Alice asks question {i} about {topic}", "max_tokens": 2,
                                        "user": "alice"}) for i, topic in enumerate(("tea", "trains", "owls"))]
        assert len({access_log(gw)[seq_id(r)] for r in alice}) == 1
    assert gw.metric("stagemesh_gateway_routing_decisions_total", reason="prefix") >= 2
    assert gw.metric("stagemesh_gateway_routing_decisions_total", reason="session") >= 2
    assert gw.metric("stagemesh_gateway_routing_threshold", threshold="cache_threshold") == 0.5
    assert gw.metric("stagemesh_gateway_replica_ready", pipeline="p1") == 1


PROMPTS = ["Write a long story about a lighthouse keeper.", "List ten facts about the moon.",
           "Explain how a bicycle works.", "Describe a busy market in the morning.",
           "Tell me about the history of tea.", "Write a poem about winter rain.",
           "Describe the life of a honeybee.", "Explain why the sky is blue."]


def kill_pipeline_stage(gw, name: str) -> int:
    url = next(p for p in json.loads(gw.get("/ready")[1])["pipelines"] if p["name"] == name)["stages"][0]
    port = url.rsplit(":", 1)[1]
    pid = int(os.popen(f"ss -ltnpH 'sport = :{port}'").read().split("pid=")[1].split(",")[0])
    os.kill(pid, signal.SIGKILL)
    return pid


async def test_killing_one_pipelines_stage_replays_its_streams_on_the_other_token_for_token(gateway):
    gw = gateway
    bodies = [{"prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True} for p in PROMPTS]
    reference = await asyncio.gather(*(stream(gw.url, body=b) for b in bodies))
    assert len({text for text, _ in reference}) == len(PROMPTS)
    before = pipelines(gw)
    # after a few tokens, while all eight stream: kill the stage of the pipeline running the most of them
    killed = {}

    async def shown_lost(victim: str) -> dict:
        """The mesh view's first snapshot with the victim not ready, watched from the kill on: a restarted stage
        may be ready again before the streams end (a stage starts in seconds), so looking afterwards can miss it."""
        def lost_snapshot():
            snap = mesh(gw)
            return snap if snap and not {p["name"]: p for p in snap["pipelines"]}[victim]["ready"] else None
        return await asyncio.to_thread(wait_for, lost_snapshot, 30, f"pipeline {victim} shown lost", 0.1)

    async def kill_once(n):
        if n == 8 and not killed:
            busiest = max(pipelines(gw).values(), key=lambda p: p["running"])
            killed["name"] = busiest["name"]
            killed["pid"] = kill_pipeline_stage(gw, busiest["name"])
            killed["lost"] = asyncio.create_task(shown_lost(busiest["name"]))

    disturbed = await asyncio.wait_for(asyncio.gather(
        stream(gw.url, kill_once, bodies[0]), *(stream(gw.url, body=b) for b in bodies[1:])), 240)
    assert killed, "the stage was never killed"
    victim, other = killed["name"], {"p0": "p1", "p1": "p0"}[killed["name"]]
    for (want, _), (got, chunks) in zip(reference, disturbed):
        assert got == want  # all eight finished, the same text as undisturbed
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert gw.metric("stagemesh_gateway_replica_handoffs_total", pipeline=victim) > 0
    assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
    # while the victim loaded its stage again (the streams did not wait for it), the view showed the loss ...
    lost = await killed["lost"]
    assert lost["ready"]  # the gateway still serves, on the other pipeline
    assert f"pipeline {victim}" in not_ready_reason(lost)  # what `stagemesh status` prints and exits 1 for
    render(lost)
    # ... and a new request avoids it
    async with aiohttp.ClientSession() as s:
        r = await post(s, gw.url, {"prompt": "A new request while one pipeline is down:", "max_tokens": 2})
    if not pipelines(gw)[victim]["ready"]:
        assert access_log(gw)[seq_id(r)] == other
    # the recovery: the stage restarted (up's supervisor), the pipeline is ready again, status exits 0
    wait_for(lambda: all(p["ready"] for p in pipelines(gw).values()), 120, "both pipelines ready again")
    after = pipelines(gw)
    assert after[victim]["stages"][0]["restarts"] == before[victim]["stages"][0]["restarts"] + 1
    assert after[victim]["handed_off"] > 0
    out = subprocess.run(stagemesh_cmd("status", gw.url), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "p0" in out.stdout and "p1" in out.stdout


# ---- the router alone: real Replicas over engines whose pipelines are never started -------------------------------


def replicas(n: int = 2) -> Replicas:
    metrics = GatewayMetrics()
    reps = []
    for i in range(n):
        p = Pipeline(["http://unused"], f"tcp://unused{i}", "fp", 2)
        p.infos = [make_info(kv_slots=8, kv_max_seq_len=256)]
        p.problem, p.client = None, object()  # ready: routing reads only that
        reps.append(Replica(f"p{i}", p, Engine(p, metrics, 1)))
    return Replicas(reps, metrics)


def seq(ids: list[int]) -> Request:
    return Request(seq_id=os.urandom(4).hex(), prompt_ids=ids, params=SamplingParams(), max_tokens=4,
                   stop_ids=frozenset())


def test_routing_prefers_the_cached_prefix_until_the_load_gap_is_too_wide_and_skips_a_lost_pipeline():
    r = replicas()
    prompt = list(range(1, 4 * BLOCK_TOKENS + 2))
    r.all[1].scheduler.prefix.insert("kept", prompt)
    assert r.route(prompt) == (r.all[1], "prefix")
    assert r.route(list(range(500, 600)))[1] == "load"  # no prefix held: least load
    for _ in range(BALANCE_ABS + 1):  # the replica holding the prefix gets busy: the idler one takes it
        r.all[1].scheduler.waiting.append(seq([7]))
    assert r.route(prompt) == (r.all[0], "balance")
    r.all[1].scheduler.waiting.clear()
    r.all[1].pipeline.problem = "stage 0 is unreachable"
    assert r.route(prompt) == (r.all[0], "load")  # a lost pipeline takes nothing new
    assert r.take_over([s := seq(prompt)], r.all[1]) == [s] and s.pipeline == "p0" and s.seq_id in r.all[0].scheduler.running


def test_gateway_flags_name_each_pipeline_and_give_each_its_own_result_port():
    from argparse import Namespace

    from services.gateway.main import pipeline_specs
    from shared.errors import StagemeshError

    def specs(**kw):
        args = Namespace(stages=None, num_stages=None, pipeline=[], result_listen=[], first_stage=None)
        vars(args).update(kw)
        return [(s.stage_urls, s.result_listen) for s in pipeline_specs(args)]

    assert specs(stages="http://a:1,http://b:1") == [(["http://a:1", "http://b:1"], "tcp://127.0.0.1:5599")]
    assert specs(pipeline=["http://a:1", "http://c:1"], result_listen=["tcp://0.0.0.0:7000"]) == [
        (["http://a:1"], "tcp://0.0.0.0:7000"), (["http://c:1"], "tcp://0.0.0.0:7001")]
    assert specs(pipeline=["http://a:1", "http://c:1"], result_listen=["tcp://g:1", "tcp://g:9"])[1][1] == "tcp://g:9"
    # the Kubernetes form: one pattern per pipeline, as many stages as --num-stages
    assert specs(pipeline=["http://s-{i}.a:1", "http://s-p1-{i}.b:1"], num_stages=2)[1][0] == [
        "http://s-p1-0.b:1", "http://s-p1-1.b:1"]
    for bad in ({"stages": "http://a:1", "pipeline": ["http://c:1"]},
                {"pipeline": ["http://a:1", "http://c:1"], "result_listen": ["tcp://g:1", "tcp://g:2", "tcp://g:3"]},
                {"pipeline": ["http://a:1", "http://c:1"], "first_stage": "tcp://a:5550"},
                {"pipeline": ["http://s-{i}.a:1"]}):  # a pattern without --num-stages
        with pytest.raises(StagemeshError):
            specs(**bad)


def test_endpoint_picker_gauges_sum_the_pipelines_and_count_kv_use_over_the_serving_ones():
    """What an InferencePool's endpoint picker scrapes (POOL_METRICS): the gateway as one model server."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.gateway.engine.metrics import POOL_METRICS, watch_replicas

    r = replicas()
    watch_replicas(r.metrics, r)

    def scrape() -> dict[str, float]:
        text = generate_latest(r.metrics.registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    r.all[0].scheduler.waiting.extend([seq([1]), seq([2])])
    r.all[1].scheduler.waiting.append(seq([3]))
    for i, s in enumerate([seq([4]), seq([5]), seq([6])]):
        r.all[i % 2].scheduler.running[s.seq_id] = s
    got = scrape()
    assert {name for name, _ in POOL_METRICS.values()} <= got.keys()
    assert got["vllm:num_requests_waiting"] == 3 and got["vllm:num_requests_running"] == 3
    assert got["vllm:kv_cache_usage_perc"] == pytest.approx(3 / 16) == got["vllm:gpu_cache_usage_perc"]
    r.all[0].pipeline.problem = "stage 0 is unreachable"  # its slots no longer serve: p1's 1 of 8 is what is left
    assert scrape()["vllm:kv_cache_usage_perc"] == pytest.approx(1 / 8)
    assert scrape()["vllm:num_requests_waiting"] == 3


def test_routing_counts_live_once_in_each_replica_and_metrics_and_info_read_them():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.gateway.engine.metrics import watch_replicas

    r = replicas()
    watch_replicas(r.metrics, r)
    prompt = list(range(1, 4 * BLOCK_TOKENS + 2))
    r.all[1].scheduler.prefix.insert("kept", prompt)
    r.submit(seq(prompt))  # prefix -> p1
    r.submit(seq(list(range(500, 600))), session="u")  # load -> p0 (less loaded)
    r.submit(seq([9, 9, 9]), session="u")  # session -> p0
    r.all[1].pipeline.problem = "stage 0 is unreachable"
    r.take_over([seq(prompt)], r.all[1])  # failover -> p0, one handed off by p1
    assert r.all[0].routed == {**dict.fromkeys(r.all[0].routed, 0), "load": 1, "session": 1, "failover": 1}
    assert r.all[1].routed["prefix"] == 1 and (r.all[0].handed_off, r.all[1].handed_off) == (0, 1)
    exported = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(generate_latest(r.metrics.registry).decode()) for s in f.samples}
    routing = {(dict(k[1])["pipeline"], dict(k[1])["reason"]): v for k, v in exported.items()
               if k[0] == "stagemesh_gateway_routing_decisions_total"}
    assert routing == {("p0", "load"): 1, ("p0", "session"): 1, ("p0", "failover"): 1, ("p1", "prefix"): 1}
    assert exported[("stagemesh_gateway_replica_handoffs_total", (("pipeline", "p1"),))] == 1
    assert [i["routed"] for i in r.info()] == [3, 1] and [i["handed_off"] for i in r.info()] == [0, 1]


def test_every_stage_up_starts_shares_one_budget_and_one_prefix_bound(gateway):
    """--replicas 2 --stages 1: the host's default memory budget and cached-prefix bound are divided among all the
    stages `up` starts (both pipelines'), so together they stay within the host (the third hostile pass: each stage
    took the whole default, two of them more than the host had)."""
    from shared.models.memory import DEFAULT_FRACTION, PREFIX_FRACTION

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    infos = [gateway.stage_info(i) for i in range(2)]
    budgets = [i.weights["memory"]["budget_bytes"] for i in infos]
    bounds = [i.kv_prefix_memory_bytes for i in infos]
    assert len(set(budgets)) == 1 and len(set(bounds)) == 1, (budgets, bounds)  # the same share each
    assert sum(budgets) <= DEFAULT_FRACTION * total, budgets  # two shares of what the host has, not two wholes
    assert sum(bounds) <= PREFIX_FRACTION * total, bounds
