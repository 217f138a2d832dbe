"""`stagemesh up` fails fast and in one line on what a user gets wrong first (issue 32): a taken port, a missing or
non-GGUF model file, a bad flag; all before any stage loads. Plus the lines it prints as the mesh comes up."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from services.cli.up import decode_notes, ready_banner
from services.testing.harness import free_port
from tests.conftest import ROOT, stagemesh_cmd

pytestmark = pytest.mark.timing  # each refusal is held to FAST_S

FAST_S = 10.0  # the whole command, interpreter start and imports included (~4.5 s of imports on a slow 2-core VM);
# a run that started stages or waited on them would take far longer (run_up kills it at 60 s)


def run_up(*args: str, log_dir: str) -> tuple[int, str, float]:
    """`stagemesh up ARGS` to its exit: (exit code, stderr, seconds). A run that starts stages is killed at 60 s."""
    start = time.monotonic()
    try:
        p = subprocess.run(stagemesh_cmd("up", "--log-dir", log_dir, *args), capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"stagemesh up {' '.join(args)} was still running after 60 s: {e.stdout!r}")
    return p.returncode, p.stderr, time.monotonic() - start


def assert_fast_one_line(rc: int, err: str, took: float, log_dir: str, *must_name: str) -> None:
    assert rc != 0
    assert took < FAST_S, f"took {took:.1f} s"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for word in must_name:
        assert word in lines[0], lines[0]
    assert not any(name.startswith("stage") for name in os.listdir(log_dir)), "a stage was started"


@pytest.mark.processes
def test_port_in_use_exits_at_once_naming_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err, took = run_up("--port", str(port), log_dir=str(tmp_path))
    assert_fast_one_line(rc, err, took, str(tmp_path), str(port), "in use")


@pytest.mark.processes
@pytest.mark.parametrize("model, words", [
    ("/nonexistent/model.gguf", ["/nonexistent/model.gguf"]),
    (__file__, ["not a GGUF file", os.path.basename(__file__)]),
], ids=["missing", "not-gguf"])
def test_bad_model_exits_at_once(tmp_path, model, words):
    rc, err, took = run_up("--model", model, "--port", str(free_port()), log_dir=str(tmp_path))
    assert_fast_one_line(rc, err, took, str(tmp_path), *words)


@pytest.mark.processes
@pytest.mark.parametrize("flags, word", [
    (["--port", "70000"], "--port"),
    (["--stages", "two"], "--stages"),
    (["--stages", "0"], "--stages"),
    (["--dtype", "float8"], "--dtype"),
    (["--trace-budget", "lots"], "--trace-budget"),
    (["--stall-timeout", "0"], "--stall-timeout"),
    (["--allow-origin", "example.com/x"], "--allow-origin"),
    (["--stages", "40"], "30 layers, so at most 30 stages"),  # SmolLM2: refused before 40 processes start
    (["--stage", "3"], "unrecognized arguments: --stage 3"),  # never taken as --stages by abbreviation
    (["--chat-template", "nope"], "--chat-template 'nope' is neither a built-in template"),
    (["--split", "12,9"], "must be strictly increasing"),
    (["--split", "10,20", "--stages", "2"], "makes 3 stages, not --stages 2"),
    (["--split", "auto,3"], "or give --split auto"),  # auto is the whole value, not a boundary
    (["--split", "fast"], "must be comma-separated layer numbers"),
], ids=["port-range", "stages-type", "stages-zero", "dtype", "trace-budget", "stall-timeout", "origin", "stages-past-layers",
        "abbreviation", "chat-template", "split-order", "split-stages", "split-auto-mixed", "split-word"])
def test_bad_flag_is_one_line(tmp_path, flags, word):
    rc, err, took = run_up("--port", str(free_port()), *flags, log_dir=str(tmp_path))  # the last --port wins
    assert_fast_one_line(rc, err, took, str(tmp_path), word)


def test_banner_has_url_curl_and_cli():
    text = ready_banner("0.0.0.0", 8123, 2, "smollm2")
    assert "http://127.0.0.1:8123/" in text
    curl = next(ln for ln in text.splitlines() if "curl" in ln)
    assert "http://127.0.0.1:8123/v1/chat/completions" in curl and '"smollm2"' in curl
    assert "stagemesh status http://127.0.0.1:8123 " in text.splitlines()[-1]  # the status hint names this gateway
    assert "status http" not in ready_banner("127.0.0.1", 8000, 1, "smollm2").splitlines()[-1]  # the default needs none
    plain = ready_banner("127.0.0.1", 8123, 1, "gemma3-270m", chat=False)  # a model without a chat template
    curl = next(ln for ln in plain.splitlines() if "curl" in ln)
    assert "/v1/completions" in curl and '"prompt"' in curl and "messages" not in curl


def test_decode_notes_announce_each_change_once():
    states: dict[int, str] = {}
    compiling = {"state": "compiling"}
    assert len(decode_notes(states, {0: compiling, 1: compiling})) == 2
    assert decode_notes(states, {0: compiling, 1: compiling}) == []
    done = {"state": "ready", "compile_seconds": {"256": 100.0, "2048": 80.0}}
    notes = decode_notes(states, {0: done, 1: compiling})
    assert notes == ["stage 0: decode switched to the compiled step (compiled in 180 s)"]
    both = {"state": "ready", "compile_seconds": {"1": 30.0, "2": 31.0},
            "batched": {"sizes": [2, 32], "reason": None, "compile_seconds": {"1": 40.0, "2": 41.0}}}
    assert decode_notes({}, {0: both}) == [
        "stage 0: decode switched to the compiled steps, one sequence and batches of 2-32 (compiled in 142 s)"]
    alone = {"state": "ready", "compile_seconds": {"2": 30.0},
             "batched": {"sizes": [2, 3], "reason": "layers with an attention soft cap attend with SDPA",
                         "compile_seconds": {}}}
    assert decode_notes({}, {0: alone}) == ["stage 0: decode switched to the compiled step (batches decode eagerly: "
                                            "layers with an attention soft cap attend with SDPA) (compiled in 30 s)"]
    # the one-sequence step from a saved package runs while the batched graph still compiles: announced apart
    loaded = {"state": "compiling", "one_sequence": {"path": "aoti-loaded", "ready": True, "seconds": {"2": 1.5}}}
    notes = decode_notes({0: "compiling"}, {0: loaded})
    assert notes == ["stage 0: decoding one stream at full speed: compiled step loaded from cache in 1.5 s (several "
                     "streams at once still run slower until their step compiles)"]
    assert decode_notes({0: "compiling, one sequence ready"}, {0: loaded}) == []
    failed = {"state": "failed", "error": "no C++ compiler"}
    assert "no C++ compiler" in decode_notes(states, {1: failed})[0]


def test_up_restarts_a_stage_as_the_mesh_routes_it_now():
    from services.cli.up import MeshNow, restart_ranges

    local = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    # as started: every stage with its own flags
    assert restart_ranges(local, MeshNow(local, None)) == ([None, None], {})
    # a re-split (or hosts that joined and left) committed another split: a restart serves it
    assert restart_ranges(local, MeshNow([u + "/" for u in local], ["0:20", "20:30"])) == (["0:20", "20:30"], {})
    # a host joined beside them: neither is restarted in place (its neighbours' keys are the joiner's own)
    joined = [local[0], "http://10.0.0.9:7000", local[1]]
    ranges, skip = restart_ranges(local, MeshNow(joined, ["0:10", "10:20", "20:30"]))
    assert ranges == [None, None] and set(skip) == set(local) and "routes around it" in skip[local[0]]
    # the mesh routes around stage 0 now (its loss was covered): not restarted, and why
    ranges, skip = restart_ranges(local, MeshNow(joined[1:], ["0:20", "20:30"]))
    assert "no longer routes through it" in skip[local[0]] and "routes around" in skip[local[1]]
