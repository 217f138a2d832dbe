"""`up --split auto`: each stage times its own layers at start (--calibrate, shared/runtime/calibrate.py) and the
gateway moves the mesh to the split that balances those times within each stage's free memory before it reports
ready (services/gateway/engine/balance.py StartSplit, the arithmetic shared.runtime.plan.proposal's)."""

import json
import math
import subprocess
import time
import urllib.request

import pytest
import torch

from services.gateway.engine.balance import StartSplit
from services.testing.harness import scrape_metric, start_up
from services.testing.slow_host import SlowStages, can_throttle
from shared.errors import StagemeshError
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange
from shared.files.model_registry import resolve_model
from shared.runtime.calibrate import calibrate
from shared.runtime.model_files import ModelFiles
from shared.runtime.plan import ModelFacts, StageTime, proposal
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.stage_info import InfoError, StageInfo
from tests.conftest import stagemesh_cmd
from tests.stage_infos import make_info

GiB = 2**30


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_gguf(GgufLoader(resolve_model("smollm2")), kv_itemsize=4)


def test_a_stage_without_free_memory_gains_no_layers(facts):
    """Stage 1 four times slower a layer: with memory to spare stage 0 takes layers from it; with none free,
    stage 0 keeps what it has (every layer it would gain needs bytes it has not got)."""
    times = [StageTime(LayerRange(0, 17), 17.0), StageTime(LayerRange(17, 30), 4 * (13 + facts.head_cost_in_layers))]
    roomy = proposal(facts, times, 16, free_bytes=[8 * GiB, 8 * GiB])
    assert int(roomy["split_proposed"]) > 17, roomy
    full = proposal(facts, times, 16, free_bytes=[0, 8 * GiB])
    assert int(full["split_proposed"]) <= 17, full


def test_a_head_timed_apart_is_not_counted_as_layers(facts):
    """1 ms a layer on both stages and a 20 ms head on the last: told the head's time, the proposal sees equal layer
    speeds and balances n = (30 - n) + 20, n = 25 (both stages 25 ms)."""
    times = [StageTime(LayerRange(0, 17), 17.0), StageTime(LayerRange(17, 30), 13.0 + 20.0, head_ms=20.0)]
    p = proposal(facts, times, 16)
    assert [s["ms_per_layer"] for s in p["stages"]] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert p["split_proposed"] == "25" and p["slowest_stage_ms_proposed"] == pytest.approx(25.0), p


def _calibration(ms: float, rows: int = 8, head: float | None = None, free: int = 8 * GiB) -> dict:
    c = {"rows": [1, rows], "ms_per_step": [ms / 2, ms], "seconds": 2.0, "free_bytes": free}
    if head is not None:
        c["head_ms"] = [head / 2, head]
    return c


def test_start_split_balances_the_calibrations_and_names_a_stage_without_one(facts):
    infos = [make_info(layers=(0, 17), position="first", calibration=_calibration(17.0)),
             make_info(layers=(17, 30), position="last", calibration=_calibration(13.0 + 20.0, head=20.0))]
    start = StartSplit(facts)
    assert start.target(infos) == [LayerRange(0, 25), LayerRange(25, 30)]
    assert start.proposal["split_now"] == "17" and start.proposal["predicted_gain"] > 1.0
    assert start.proposal["stages"][1]["calibration"]["head_ms"] == [10.0, 20.0]  # shown beside the proposal
    assert "split 25" in start.summary() and "17" in start.summary()
    with pytest.raises(StagemeshError, match="stage 1 reports no calibration.*--calibrate"):
        StartSplit(facts).target([infos[0], make_info(layers=(17, 30), position="last")])


@pytest.mark.parametrize("bad", [
    {"rows": [1, 8], "ms_per_step": [1.0], "seconds": 1.0, "free_bytes": 1},  # one time for two sizes
    {"rows": [0], "ms_per_step": [1.0], "seconds": 1.0, "free_bytes": 1},
    {"rows": [1], "ms_per_step": [-1.0], "seconds": 1.0, "free_bytes": 1},
    {"rows": [1], "ms_per_step": [1.0], "seconds": 1.0},
    {"rows": [1], "ms_per_step": [1.0], "seconds": 1.0, "free_bytes": 1, "head_ms": [1.0, 2.0]},
    "fast",
])
def test_a_malformed_calibration_is_refused_naming_the_field(bad):
    data = json.loads(json.dumps(make_info(calibration=None).to_json())) | {"calibration": bad}
    with pytest.raises(InfoError, match="'calibration'"):
        StageInfo.from_json(data)


def test_calibrate_times_each_batch_size_of_a_real_piece():
    """The last piece of SmolLM2: one time per batch size (clamped to its KV slots), its head timed apart; the
    sequences it used are released (every slot free again)."""
    files = ModelFiles.open("smollm2")
    runtime = StageRuntime.load(files.loader, LayerRange(27, 30), torch.float32,
                                "cpu", kv_slots=4, max_seq_len=128, compile_decode="off")
    # (each time a mean over 0.2 s, the head's over 0.1 s: over a few tens of ms, a burst of the other suite part's
    # work on the same cores could make the head alone look slower than the step it is part of)
    c = calibrate(runtime, [1, 16], min_seconds=0.2)
    assert c["rows"] == [1, 4] and len(c["ms_per_step"]) == 2 and len(c["head_ms"]) == 2
    assert all(m > h > 0 for m, h in zip(c["ms_per_step"], c["head_ms"]))  # the head is part of the step
    assert c["free_bytes"] > 0 and runtime.kv.used_slots == 0
    sent = json.loads(json.dumps(make_info(calibration=c).to_json()))  # what /info carries, accepted by the gateway
    assert StageInfo.from_json(sent).calibration == c


# ---- real processes: `up --split auto` on a throttled host ---------------------------------------------------------

def _auto_up(tmp_path, name: str, quota: dict[int, float], stack):
    """`up --split auto` with its two stages pinned to a core each (the gateway beside stage 1) and `quota`'s
    stages throttled to that share of their core from the moment they start; its /v1/mesh pipeline once the view
    has sampled after ready."""
    logs = tmp_path / name
    logs.mkdir()
    slow = SlowStages(stack, cores={0: 0, 1: 1}, quota=quota, gateway_core=1)
    gw = start_up(2, None, str(logs), "--split", "auto", "--compile-decode", "off", "--threads-alone", "1",
                  "--kv-slots", "8", "--insecure-plaintext", "--auto-rebalance", "off", while_starting=slow)
    stack.callback(gw.stop)
    assert sorted(slow.done) == [0, 1]
    ready_at = time.time()
    while True:  # the mesh view samples every tick: wait for one taken after ready
        snap = json.loads(gw.get("/v1/mesh")[1])
        if snap["time"] > ready_at:
            return gw, snap["pipelines"][0]
        time.sleep(0.2)


def _stage_metric(stage_url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(stage_url + "/metrics", timeout=10) as r:
        return scrape_metric(r.read().decode(), name, labels)


@pytest.mark.processes
@pytest.mark.skipif(not can_throttle(), reason="needs a writable cgroup v1 cpu controller (/sys/fs/cgroup/cpu)")
def test_up_split_auto_gives_a_throttled_stage_fewer_layers(tmp_path):
    """Equal stages, then stage 1 throttled to 30 % of its core from its start: the throttled stage measures itself
    slower a layer than stage 0 and ends with fewer layers than it has on equal stages; either way the gateway was
    ready only with the split chosen (its /v1/mesh, `status` and the stages' own /info agree on it)."""
    import contextlib

    splits, fractions = {}, {}
    for name, quota in (("equal", {}), ("throttled", {1: 0.3})):
        with contextlib.ExitStack() as stack:
            gw, pipe = _auto_up(tmp_path, name, quota, stack)
            auto = pipe["split_auto"]
            assert auto["state"] == "done", auto
            assert pipe["split"] == auto["proposal"]["split_proposed"], pipe
            layers = [list(gw.stage_info(i).layers) for i in range(2)]
            assert str(layers[0][1]) == pipe["split"], (layers, pipe["split"])
            if pipe["split"] != auto["proposal"]["split_now"]:  # moved by a live re-split before ready
                assert any(r["trigger"] == "split-auto" and r["outcome"] == "done" for r in pipe["resplits"]), pipe
            per_layer = [s["ms_per_layer"] for s in auto["proposal"]["stages"]]
            status = subprocess.run(stagemesh_cmd("status", gw.url), capture_output=True, text=True, timeout=60)
            assert status.returncode == 0 and "chosen by measurement" in status.stdout, status.stdout + status.stderr
            assert f"split {pipe['split']} chosen" in " ".join(status.stdout.split())
            splits[name] = (int(pipe["split"]), per_layer)
            # each stage states its one-row decode against the memory roofline (the triad --calibrate measured)
            fractions[name] = [_stage_metric(url, "stagemesh_stage_roofline_fraction", basis="calibrated")
                               for url in gw.stage_urls()]
            assert all(0 < f < math.inf for f in fractions[name]), fractions
    (equal, _), (throttled, per_layer) = splits["equal"], splits["throttled"]
    assert per_layer[1] > per_layer[0], splits  # the throttle is measured
    assert 30 - throttled < 30 - equal, splits  # ... and the throttled stage holds fewer layers
