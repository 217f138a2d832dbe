"""`stagemesh plan`: the split over hosts, the memory refusal, the one-versus-two-host figures and their monotonicity
(shared/runtime/plan.py), and the command's edge (services/cli/plan.py)."""

import json
import subprocess

import pytest

from services.cli.plan import Measured, build_hosts, measure_here, parse_host, rooflines
from shared.errors import StagemeshError
from shared.files.layers import split_at
from shared.runtime.plan import (
    GATEWAY_MS,
    HOP_MS,
    RUNTIME_BYTES,
    GiB,
    Host,
    ModelFacts,
    Workload,
    hop_bytes,
    plan,
    predict,
)
from shared.runtime.roofline import Roofline, token_bytes, triad_bandwidth
from tests.conftest import stagemesh_cmd

MiB = 2**20


def model(layers: int = 12, layer_mib: float = 100, head_mib: float = 0, kv_per_token_layer: int = 0) -> ModelFacts:
    return ModelFacts("m", (int(layer_mib * MiB),) * layers, int(head_mib * MiB), 4096, kv_per_token_layer, 0.0)


def host(name: str, ms: float = 1.0, mem_gib: float = 64, **kw) -> Host:
    return Host(name, int(mem_gib * GiB), ms, **({"head_ms": 0.0, "overhead_ms": 0.0} | kw))


def spans(p) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in p.ranges]


@pytest.mark.parametrize("hosts,expected", [
    ([host("a"), host("b")], [(0, 6), (6, 12)]),
    ([host("a", 1.0), host("b", 2.0)], [(0, 8), (8, 12)]),  # 8 ms each: the faster host takes twice the layers
    ([host("a", 2.0), host("b", 1.0)], [(0, 4), (4, 12)]),
    ([host("a"), host("b", head_ms=2.0)], [(0, 7), (7, 12)]),  # the head counts as 2 layers on the last host
    ([host("a", overhead_ms=2.0), host("b")], [(0, 5), (5, 12)]),  # a's fixed cost per step is 2 layers' worth
    ([host("a"), host("b", 2.0), host("c")], [(0, 5), (5, 7), (7, 12)]),  # every stage 5 ms
    # b's fixed cost makes it the slowest whatever it serves (101 ms); then the least sum puts layers on a, not c
    ([host("a"), host("b", overhead_ms=100), host("c", 2.0)], [(0, 10), (10, 11), (11, 12)]),
])
def test_split_balances_uneven_hosts(hosts, expected):
    assert spans(plan(model(), hosts, Workload())) == expected


@pytest.mark.parametrize("mem_b,expected", [
    (64, [(0, 6), (6, 12)]),
    (RUNTIME_BYTES / GiB + 0.45, [(0, 8), (8, 12)]),  # b holds 4 layers beside its runtime: a takes the rest, slower but fitting
    (RUNTIME_BYTES / GiB + 0.15, [(0, 11), (11, 12)]),
])
def test_memory_bounds_the_split(mem_b, expected):
    m = model(layer_mib=0.1 * 1024)
    assert spans(plan(m, [host("a"), host("b", mem_gib=mem_b)], Workload())) == expected


def test_kv_for_the_workload_counts_in_each_stage():
    m = model(kv_per_token_layer=1000)
    p = plan(m, [host("a"), host("b")], Workload(streams=16, context=2048))
    assert [s.kv for s in p.memory] == [16 * 2048 * 6 * 1000] * 2
    assert p.memory[0].total == 6 * 100 * MiB + 16 * 2048 * 6 * 1000 + RUNTIME_BYTES


@pytest.mark.parametrize("hosts,work,says", [
    ([host("a", mem_gib=0.75), host("b", mem_gib=0.75)], Workload(),
     ["host a has 0.75 GiB; layers 0:6 need 1.00 GiB (0.59 GiB weights, 0.01 GiB KV, 0.40 GiB runtime)",
      "host b has 0.75 GiB; layers 6:12", "add memory or a host"]),
    ([host("a", mem_gib=8), host("b", mem_gib=0.3)], Workload(), ["host b has 0.30 GiB; layers 6:12"]),
    ([host("a", mem_gib=2)], Workload(streams=64, context=4096), ["needs", "fewer --streams or a shorter --context"]),
])
def test_refuses_what_does_not_fit_naming_it(hosts, work, says):
    m = model(kv_per_token_layer=1024)
    with pytest.raises(StagemeshError) as e:
        plan(m, hosts, work)
    for text in says:
        assert text in str(e.value)


def test_more_hosts_than_layers_is_refused():
    with pytest.raises(StagemeshError, match="at most 2 hosts"):
        plan(model(layers=2), [host("a"), host("b"), host("c")], Workload())


def test_one_stream_is_the_sum_around_the_ring():
    m = model()
    link = {"rtt_ms": 2.0, "gbit": 1.0, "overhead_ms": 0.5}
    p = plan(m, [host("a", **link), host("b", **link)], Workload())
    wire = hop_bytes(m, 1) * 8 / 1e9 * 1e3 + (256 + 8) * 8 / 1e9 * 1e3  # a -> b hidden, b -> gateway token id
    expected = GATEWAY_MS + (6.5 + 6.5) + 3 * HOP_MS + (1.0 + 1.0) + wire  # gateway -> a is local
    assert p.token_ms == pytest.approx(expected)
    assert p.tokens_per_s == pytest.approx(1e3 / expected)


@pytest.mark.parametrize("rtt_ms,gbit,one_stream_gains,streams_gain", [
    (0.0, None, False, True),  # a second host adds a hop to each token, and halves each micro-batch's compute
    (1.0, 1.0, False, True),  # a gigabit link with 1 ms RTT: still worth it at 16 streams
    (40.0, 0.01, False, False),  # 10 Mbit/s, 40 ms: the link costs more than the second host gives
])
def test_one_host_against_two(rtt_ms, gbit, one_stream_gains, streams_gain):
    m = model(layers=24)
    work = Workload(streams=16, extra_row=0.05)
    one = plan(m, [host("a", overhead_ms=0.5)], work)
    two = plan(m, [host("a", overhead_ms=0.5), host("b", overhead_ms=0.5, rtt_ms=rtt_ms, gbit=gbit)], work)
    assert (two.tokens_per_s > one.tokens_per_s) == one_stream_gains
    assert (two.streams_tokens_per_s > one.streams_tokens_per_s) == streams_gain
    assert one.bottleneck == "the latency of a cycle"  # one host: each micro-batch waits for its previous token


def test_a_slow_link_bounds_many_streams():
    two = plan(model(), [host("a", gbit=0.001), host("b")], Workload(streams=64))
    assert two.bottleneck == "the link from a"


@pytest.mark.parametrize("vary", ["gbit", "rtt_ms"])
def test_more_bandwidth_or_less_latency_never_predicts_slower(vary):
    values = [0.01, 0.1, 1.0, 10.0, 100.0] if vary == "gbit" else [50.0, 10.0, 1.0, 0.1, 0.0]
    m = model(layers=24)
    work = Workload(streams=16, extra_row=0.05)
    plans = [plan(m, [host("a", **{vary: v}), host("b", **{vary: v})], work) for v in values]
    one = [p.tokens_per_s for p in plans]
    many = [p.streams_tokens_per_s for p in plans]
    assert one == sorted(one) and many == sorted(many)
    assert one[-1] > one[0] and many[-1] > many[0]


def test_predict_keeps_a_given_split():
    m = model()
    p = predict(m, [host("a"), host("b")], split_at(12, [3]), Workload())
    assert spans(p) == [(0, 3), (3, 12)] and p.stage_ms == (3.0, 9.0)


def test_facts_from_the_gguf_account_for_every_tensor(smollm2):
    loader = smollm2.loader
    facts = ModelFacts.from_gguf(loader, kv_itemsize=2)
    c = smollm2.config
    assert facts.num_layers == c.num_layers and facts.hidden_size == c.hidden_size
    assert facts.kv_bytes_per_token_layer == 2 * c.num_kv_heads * c.head_dim * 2
    # SmolLM2 ties its head to token_embd: the blocks and the head are the whole file
    assert c.tied_embeddings
    assert sum(facts.layer_bytes) + facts.head_bytes == loader.tensor_bytes(loader.tensor_names)
    assert len(set(facts.layer_bytes)) == 1


@pytest.mark.parametrize("spec,says", [
    ("a", "must be NAME:mem="),
    ("a:cores=2", "gives no mem="),
    ("a:mem=lots", "'mem=lots' is not valid"),
    ("a:mem=1G,speed=2", "unknown key 'speed'"),
    ("a:mem=1G,gbit=0", "gbit must be positive"),
    ("a:mem=1G,ms_per_layer=-1", "ms_per_layer must be positive"),
    ("a:mem=1G,cores=0", "'cores=0' is not valid"),
    ("a:mem=1G,rtt_ms", "'rtt_ms' is not valid"),
])
def test_host_specs_are_checked_at_the_edge(spec, says):
    with pytest.raises(StagemeshError, match=says):
        parse_host(spec)


def test_host_spec_parses_every_key():
    s = parse_host("b:mem=1.5G,cores=4,ms_per_layer=1.2,head_ms=5,overhead_ms=0.4,rtt_ms=1,gbit=2.5")
    assert (s.name, s.memory, s.cores) == ("b", int(1.5 * GiB), 4)
    assert s.given == {"ms_per_layer": 1.2, "head_ms": 5.0, "overhead_ms": 0.4, "rtt_ms": 1.0, "gbit": 2.5}


def test_measured_speed_fills_what_a_host_leaves_out():
    here = Measured(threads=2, ms_per_layer=0.3, head_ms=1.5, overhead_ms=0.6, batch_factor=2.0, rows=8)
    a, b, c = build_hosts([parse_host("a:mem=1G,cores=2"), parse_host("b:mem=1G,cores=2,head_ms=9"),
                           parse_host("c:mem=1G,ms_per_layer=2")], {2: here})
    assert (a.ms_per_layer, a.head_ms, a.overhead_ms) == (0.3, 1.5, 0.6)
    assert (b.ms_per_layer, b.head_ms) == (0.3, 9.0)  # what a host gives wins
    assert (c.ms_per_layer, c.head_ms) == (2.0, None)  # a host with its own speed takes nothing measured here


@pytest.mark.slow  # seconds of in-process computation: make test runs it, the unit tier (make test-unit) does not
def test_measuring_here_times_layers_head_and_batch(smollm2):
    m = measure_here(smollm2, "float32", threads=1, rows=4)
    assert 0 < m.ms_per_layer < m.head_ms  # SmolLM2's head (49,152 x 576) costs about 4 of its layers
    assert m.overhead_ms > 0 and 1.0 <= m.batch_factor < 4  # 4 rows a step cost less than 4 steps of one
    assert 1e8 < m.bandwidth < 1e13  # a STREAM triad on one thread: between 0.1 GB/s and 10 TB/s


# ---- the memory roofline (shared/runtime/roofline.py) ----------------------------------------------------------------

def test_a_token_reads_its_layers_the_head_on_the_last_stage_and_the_kv_of_its_context():
    m = model(layers=4, layer_mib=10, head_mib=3, kv_per_token_layer=1024)
    assert token_bytes(m) == 43 * MiB
    assert token_bytes(m, range(0, 2), head=False) == 20 * MiB
    assert token_bytes(m, range(2, 4), context=100) == 23 * MiB + 2 * 100 * 1024
    r = Roofline(bandwidth=10e9, bytes_per_token=100_000_000)
    assert (r.tokens_per_s, r.ms_per_token, r.fraction(50.0)) == (100.0, 10.0, 0.5)


def test_the_triad_times_more_bytes_as_longer():
    with pytest.raises(ValueError, match="passes >= 1"):
        triad_bandwidth(1 << 20, passes=0)
    small, large = triad_bandwidth(1 << 22), triad_bandwidth(1 << 26)  # 4 MiB arrays sit in a cache, 64 MiB do not
    assert 1e8 < large < 1e13 and 1e8 < small < 1e14


def test_the_plan_states_its_one_stream_as_a_fraction_of_the_roofline():
    m = model(layers=12, layer_mib=100, head_mib=50)
    p = predict(m, [host("a", 4.0), host("b", 4.0)], split_at(12, [6]), Workload())
    roof = rooflines(m, p, [100e9, 50e9])
    a_ms, b_ms = 1e3 * 600 * MiB / 100e9, 1e3 * 650 * MiB / 50e9  # b holds the head and reads at half the speed
    assert [s["roofline_ms"] for s in roof["stages"]] == [round(a_ms, 3), round(b_ms, 3)]
    assert [s["fraction"] for s in roof["stages"]] == [round(a_ms / 24.0, 4), round(b_ms / 24.0, 4)]  # 6 x 4 ms
    assert 0 < roof["predicted_fraction"] == round(p.tokens_per_s * (a_ms + b_ms) / 1e3, 4) < 1  # hops cost too
    assert rooflines(m, p, [100e9, None]) is None  # b gave its own speed: its bandwidth is not known here


@pytest.mark.processes
def test_plan_command_answers_whether_a_second_host_helps():
    args = ["plan", "--host", "a:mem=8G,ms_per_layer=0.5,head_ms=2", "--host",
            "b:mem=8G,ms_per_layer=0.5,head_ms=2,rtt_ms=1,gbit=1", "--streams", "8", "--batch-factor", "1.5"]
    proc = subprocess.run(stagemesh_cmd(*args, "--json"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [s["layers"] for s in out["plan"]["stages"]] == ["0:17", "17:30"]  # SmolLM2's 30 layers, the head on b
    assert out["measured"] == [] and out["batch_factor"] == 1.5
    assert out["first_host_alone"]["streams_tokens_per_s"] < out["plan"]["streams_tokens_per_s"]
    text = subprocess.run(stagemesh_cmd(*args), capture_output=True, text=True, timeout=120).stdout
    assert "will a second machine help? yes" in text and "0:17" in text


@pytest.mark.processes
def test_plan_command_refuses_a_bad_flag_before_loading():
    proc = subprocess.run(stagemesh_cmd("plan", "--host", "a:mem=8G", "--streams", "0"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--streams and --context must be at least 1" in proc.stderr
