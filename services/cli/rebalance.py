"""`stagemesh rebalance [URL] [--dry-run] [--split B1,..] [--window 10] [--streams 16] [--json]`: each stage's measured
time per layer on a mesh at work, the split that balances it, and the gain predicted for it; without --dry-run the
gateway moves the mesh to it live (POST /v1/mesh/resplit: layers and their K/V move between neighbouring stages at a
step boundary, no request fails). --split applies a split given by hand, without measuring.

The measurement: every micro-batch passes every stage, so over one window each stage's busy seconds per micro-batch
(its /info counters, through the gateway's /v1/mesh) is the same work's time there. A stage's time per layer is that
over its layers (the last stage's head -- final norm, lm_head, sampling -- timed apart by the stage: head_seconds),
or, on a stage whose cgroup limits its CPU, its CPU time over that limit where that is longer (StageTime.measured).
The proposal is
shared/runtime/plan.py's split for hosts of those speeds (the slowest stage fastest, then the shortest cycle), and its
prediction the same model of time for the split running now and the one proposed.

A live re-split moves layers only between neighbouring stages and leaves every stage at least one layer
(shared.files.layers.check_resplit); a proposal further away is applied in neighbour-sized steps by running the
command again."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from services.cli.status import fetch, gateway_request
from shared.errors import StagemeshError
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange
from shared.files.model_registry import resolve_model
from shared.runtime.plan import MIN_MICROBATCHES, ModelFacts, StageTime, proposal

__all__ = ["StageTime", "apply_split", "cmd_rebalance", "join_option", "measure", "proposal", "replace_stage"]


def join_option(model: ModelFacts, times: list[StageTime], like: int | None = None) -> dict:
    """The other way to speed the mesh up: a host that joins as a new stage (`stagemesh join`). Its place and gain as
    the gateway would predict them (services/gateway/engine/membership.place_joiner, from the same measured ms per
    layer, the last stage's head in layers of its own cost), for a host like stage `like` (default: the fastest per
    layer) -- a hypothesis: the joiner's own probe decides where it goes."""
    from services.gateway.engine.membership import place_joiner

    per_layer, head_layers = [], model.head_cost_in_layers
    for t in times:
        last = t.layers.stop == model.num_layers
        layers_ms = t.ms_per_microbatch - (t.head_ms or 0.0) if last else t.ms_per_microbatch
        per_layer.append(max(layers_ms / len(t.layers), 1e-6))
        if last and t.head_ms:
            head_layers = t.head_ms / per_layer[-1]
    like = min(range(len(times)), key=per_layer.__getitem__) if like is None else like
    p = place_joiner([(t.layers.start, t.layers.stop) for t in times], per_layer, per_layer[like], head_layers,
                     model.num_layers)
    return {"like_stage": like, "ms_per_layer": round(per_layer[like], 4), "place": p.place, "giver": p.giver,
            "layers": f"{p.layers[0]}:{p.layers[1]}", "split": ",".join(str(r[1]) for r in p.split[:-1]),
            "slowest_stage_ms_now": round(p.step_ms_now, 3), "slowest_stage_ms_after": round(p.step_ms_after, 3),
            "predicted_gain": round(p.predicted_gain, 3)}


def waiting_joins(url: str) -> list[dict]:
    """The joiners the gateway placed and that are not yet serving, with the gain it predicted for each (from
    /v1/mesh/members; [] when the gateway takes no joins)."""
    try:
        with urllib.request.urlopen(gateway_request(url, "/v1/mesh/members"), timeout=10) as r:
            members = json.loads(r.read())
    except (OSError, ValueError):  # 404: a gateway without --join-token (HTTPError is an OSError)
        return []
    placed = {e["join"]: e for e in members.get("events", []) if e.get("event") == "placed"}
    return [{"id": j, "url": w["url"], "layers": f"{w['layers'][0]}:{w['layers'][1]}", "state": w["state"],
             "predicted_gain": placed.get(j, {}).get("predicted_gain")} for j, w in members.get("waiting", {}).items()]


def measure(url: str, window_s: float, pipeline: int = 0) -> list[StageTime]:
    """Two /v1/mesh snapshots window_s apart: each stage's Δbusy / Δmicro-batches. StagemeshError when a stage is
    not answering, moved, or too few micro-batches passed (the mesh must be at work)."""
    def stages(snap: dict) -> list[dict]:
        pipes = snap.get("pipelines") or []
        if pipeline >= len(pipes):
            raise StagemeshError(f"the gateway at {url} has {len(pipes)} pipelines, no pipeline {pipeline}")
        out = pipes[pipeline]["stages"]
        lost = [s["index"] for s in out if s.get("layers") is None or s.get("busy_seconds") is None]
        if lost:
            raise StagemeshError(f"stage {lost[0]} is not answering (status shows why); rebalance measures a mesh "
                                 "whose stages all run")
        return out

    first = stages(fetch(url))
    time.sleep(window_s)
    last = stages(fetch(url))
    result = []
    for a, b in zip(first, last):
        if a["layers"] != b["layers"] or a.get("incarnation") != b.get("incarnation"):
            raise StagemeshError(f"stage {a['index']} restarted or changed its layers during the window; run again")
        passed = b["microbatches"] - a["microbatches"]
        if passed < MIN_MICROBATCHES:
            raise StagemeshError(f"only {passed} micro-batches passed stage {a['index']} in {window_s:g} s: rebalance "
                                 "measures a mesh at work -- send it traffic (e.g. `stagemesh bench`) meanwhile, or "
                                 "give a longer --window")
        grew = {k: max(0.0, b.get(k, 0.0) - a.get(k, 0.0)) for k in ("busy_seconds", "head_seconds", "cpu_seconds")}
        result.append(StageTime.measured(LayerRange(*a["layers"]), passed, grew["busy_seconds"], grew["head_seconds"],
                                         grew["cpu_seconds"], b.get("cpu_limit", 0.0)))
    return result


def apply_split(url: str, split: str, pipeline: int = 0, timeout: float = 300.0) -> dict:
    """POST /v1/mesh/resplit: the gateway moves the pipeline to `split` live; its answer. StagemeshError naming why
    when it does not (the gateway's message: a split it cannot move to, a stage that refused)."""
    return _operator_post(url, "/v1/mesh/resplit", {"split": split, "pipeline": pipeline},
                          f"the re-split to {split}", timeout)


def replace_stage(url: str, place: int, stage_url: str, pipeline: int = 0, timeout: float = 120.0) -> dict:
    """POST /v1/mesh/replace: the stage process at `stage_url` takes stage `place`'s place; the gateway's answer.
    StagemeshError naming why when it does not (a process that does not fit the place, a route that did not carry)."""
    return _operator_post(url, "/v1/mesh/replace", {"stage": place, "url": stage_url, "pipeline": pipeline},
                          f"{stage_url} taking stage {place}'s place", timeout)


def _operator_post(url: str, path: str, body: dict, what: str, timeout: float) -> dict:
    req = gateway_request(url, path, body)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()[:2000].decode(errors="replace")
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body
        raise StagemeshError(f"the gateway refused {what} ({e.code}): {message}") from None
    except (OSError, ValueError) as e:
        raise StagemeshError(f"cannot reach the gateway at {url}: {e}") from None


def _applied(result: dict) -> str:
    if not result.get("changed"):
        return f"the mesh already serves split {result['split']}\n"
    return (f"re-split {result['split_before']} -> {result['split']} live: the pipeline paused "
            f"{1e3 * result['pause_s']:.0f} ms, {result['moved_bytes'] / 2**20:.1f} MiB of K/V moved, "
            f"{result['released']} sequences replayed\n")


def cmd_rebalance(args) -> int:
    if args.replace is not None:  # a stage process taking another's place: nothing measured, no layers moved
        place, sep, stage_url = args.replace.partition("=")
        if not sep or not place.strip().isdigit() or not stage_url.strip():
            raise StagemeshError(f"--replace {args.replace!r}: give STAGE=URL, e.g. 1=http://10.0.0.7:8102 (the "
                                 "new stage process's --http)")
        if args.split is not None or args.dry_run:
            raise StagemeshError("--replace moves no layers: give it without --split or --dry-run")
        result = replace_stage(args.url, int(place), stage_url.strip(), args.pipeline)
        sys.stdout.write(json.dumps(result) + "\n" if args.json else
                         f"stage {result['stage']} (layers {result['layers'][0]}:{result['layers'][1]}) is now served "
                         f"by {result['url']} ({result['listen']}) instead of {result['replaced']}, in "
                         f"{result['took_s']:.2f} s; the running requests were replayed\n")
        return 0
    if args.split is not None:  # a split given by hand: apply it, no measurement
        if args.dry_run:
            raise StagemeshError("--split applies a split; --dry-run only proposes one: give one of them")
        result = apply_split(args.url, args.split, args.pipeline)
        sys.stdout.write(json.dumps(result) + "\n" if args.json else _applied(result))
        return 0
    model = ModelFacts.from_gguf(GgufLoader(resolve_model(args.model)), kv_itemsize=4)
    times = measure(args.url, args.window, args.pipeline)
    if times[-1].layers.stop != model.num_layers:
        raise StagemeshError(f"the stages serve {times[-1].layers.stop} layers and --model {args.model} has "
                             f"{model.num_layers}: give the --model the mesh serves")
    joins = {"hypothetical": join_option(model, times), "waiting": waiting_joins(args.url)}
    if len(times) < 2:
        if not args.dry_run:
            raise StagemeshError("one stage holds every layer: there is no split to balance (--dry-run shows what a "
                                 "host that joins would give)")
        result = {"split_now": "", "join": joins}
    else:
        result = {**proposal(model, times, args.streams), "join": joins}
    if not args.dry_run and result["split_proposed"] != result["split_now"]:
        result["applied"] = apply_split(args.url, result["split_proposed"], args.pipeline)
    if args.json:
        print(json.dumps(result))
        return 0
    out = sys.stdout
    if len(times) < 2:
        out.write(f"one stage holds every layer ({times[0].ms_per_microbatch:.2f} ms a micro-batch over {args.window:g}"
                  " s): there is no split to balance\n")
        _join_lines(out, joins)
        return 0
    out.write(f"measured over {args.window:g} s (busy time per micro-batch, every micro-batch passes every stage)\n")
    out.write(f"{'stage':<7}{'layers':<9}{'ms/batch':>10}{'ms/layer':>10}  {'proposed':<9}{'pred. ms':>10}\n")
    for s in result["stages"]:
        out.write(f"{s['stage']:<7}{s['layers']:<9}{s['ms_per_microbatch']:>10.2f}{s['ms_per_layer']:>10.3f}  "
                  f"{s['proposed_layers']:<9}{s['predicted_ms_proposed']:>10.2f}\n")
    if result["split_proposed"] == result["split_now"]:
        out.write(f"the split running ({result['split_now']}) is already the balanced one\n")
    else:
        out.write(f"proposed split {result['split_proposed']} (now {result['split_now']}): the slowest stage "
                  f"{result['slowest_stage_ms_now']:.2f} -> {result['slowest_stage_ms_proposed']:.2f} ms a "
                  f"micro-batch, {result['predicted_gain']:.2f}x the throughput at {args.streams} streams\n")
        if "applied" in result:
            out.write(_applied(result["applied"]))
        else:
            out.write(f"to apply it live: stagemesh rebalance --split {result['split_proposed']} (or start the mesh "
                      f"with: stagemesh up --split {result['split_proposed']})\n")
    _join_lines(out, joins)
    return 0


def _join_lines(out, joins: dict) -> None:
    """The join option: each joiner waiting (the gateway's own prediction), and the hypothetical host."""
    for w in joins["waiting"]:
        gain = f"predicted {w['predicted_gain']:.2f}x by the gateway" if w["predicted_gain"] else "no prediction"
        out.write(f"or a new stage: join {w['id']} ({w['url']}) is placed with layers {w['layers']} ({w['state']}; "
                  f"{gain})\n")
    h = joins["hypothetical"]
    out.write(f"or a new stage: a host like stage {h['like_stage']} ({h['ms_per_layer']:.3f} ms a layer) that joins "
              f"(`stagemesh join`) would take layers {h['layers']} from stage {h['giver']} (split {h['split'] or '-'}):"
              f" the slowest stage {h['slowest_stage_ms_now']:.2f} -> {h['slowest_stage_ms_after']:.2f} ms, predicted "
              f"{h['predicted_gain']:.2f}x (a prediction from this window; the joiner's own probe decides)\n")
