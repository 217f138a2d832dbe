"""A stage that leaves and a spare that takes its place (issue 58, item 4): `stagemesh up --spares N` keeps spare
stage processes waiting (services/stage/spare.py, services/process/launch.py SparePool); a stage that exits is
replaced by one, which serves the same range on the same addresses, and the gateway replays what it was serving."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

STREAMS = 4
MAX_TOKENS = 64  # the kills land at fractions of it (a third; a fifth, +4, a half in the storm)
PROMPT = "Log {i}: the night shift at the observatory began when"


async def _streams(url: str, on_token=None) -> list[str]:
    from services.testing.harness import seeded_streams

    return await seeded_streams(url, PROMPT, 500, STREAMS, MAX_TOKENS, on_token)


def _wait_spare(gw, timeout: float = 120) -> int:
    """The pid of the one spare waiting, once its log says it is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = gw.spare_pids()
        if len(pids) == 1:
            with open(os.readlink(f"/proc/{pids[0]}/fd/1")) as f:
                if "spare ready" in f.read():
                    return pids[0]
        time.sleep(0.2)
    raise AssertionError(f"no spare ready after {timeout} s: {gw.spare_pids()}")


@pytest.mark.processes
async def test_a_spare_takes_the_place_of_a_stage_killed_mid_stream(tmp_path):
    """`up --spares 1 --batch-invariant`: stage 1 SIGKILLed while four seeded streams run; the spare serves its
    range on its addresses (its output now in stage1.log), every stream finishes with the undisturbed run's text, the
    pool starts a new spare, and the next kill is taken by that one. Then a kill storm: three kills in one set of
    streams, each costing one replay (a spare that takes over between health polls shows as an unknown sequence and
    then as a new incarnation: one loss, not two), so no request reaches --max-replays' 3."""
    from services.testing.harness import start_up

    # polls every 0.5 s (2 s by default): each of the five kills is seen up to 1.5 s sooner, the same way
    gw = start_up(2, "float32", str(tmp_path), "--batch-invariant", "--spares", "1", "--stage-poll", "0.5")
    try:
        reference = await _streams(gw.url)
        for round_ in range(2):
            spare = _wait_spare(gw)
            victim_pid, victim = gw.stage_pids()[1], gw.stage_info(1)
            killed = asyncio.get_running_loop().create_future()

            def kill_midway(least: int, killed=killed, victim_pid=victim_pid) -> None:
                if least >= MAX_TOKENS // 3 and not killed.done():
                    os.kill(victim_pid, signal.SIGKILL)
                    killed.set_result(least)

            texts = await asyncio.wait_for(_streams(gw.url, kill_midway), 600)
            assert killed.done() and killed.result() < MAX_TOKENS, "the kill did not land mid-stream"
            assert texts == reference
            assert gw.stage_pids()[1] == spare, (round_, gw.stage_pids(), spare)
            info = gw.stage_info(1)
            assert info.incarnation != victim.incarnation and info.layers == victim.layers, info
            with open(gw.log_path) as f:
                assert f"stage 1 exited; spare pid {spare} took its place" in f.read()
            with open(tmp_path / "stage1.log") as f:
                assert f"spare (pid {spare}) takes over" in f.read()
        assert gw.metric("stagemesh_gateway_replayed_sequences_total") > 0  # what stage 1 held was replayed
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
        assert _wait_spare(gw) not in (spare, victim_pid)  # the pool is one spare strong again

        # a kill storm (issue 69 item 11): in one set of streams stage 0 dies, then stage 1 before the pool has a
        # spare again (that one is restarted the usual way), then stage 0's replacement itself; nothing is lost
        storm: list[tuple[int, int]] = []  # (stage killed, its pid), in order
        plan = [(MAX_TOKENS // 5, 0), (MAX_TOKENS // 5 + 4, 1), (MAX_TOKENS // 2, 0)]  # (fewest tokens any stream has, stage)

        def kill_storm(least: int) -> None:
            if len(storm) < len(plan) and least >= plan[len(storm)][0]:
                stage = plan[len(storm)][1]
                pid = gw.stage_pids().get(stage)
                if pid is not None and all(pid != killed for _, killed in storm):  # a live process, not one killed
                    os.kill(pid, signal.SIGKILL)
                    storm.append((stage, pid))

        texts = await asyncio.wait_for(_streams(gw.url, kill_storm), 900)
        assert [stage for stage, _ in storm] == [0, 1, 0], storm  # every kill of the storm landed mid-stream
        assert texts == reference
        assert gw.metric("stagemesh_gateway_requests_total", outcome="error") == 0
    finally:
        gw.stop()


def _spare(tmp_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "spare", "--model", "smollm2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)


@pytest.mark.processes
@pytest.mark.parametrize("order, says", [
    (b"take stage 1\n", "not JSON"),
    (b'["--listen", "tcp://127.0.0.1:1"]\n', "must be an object"),
    (b'{"argv": "--listen x", "log": null}\n', "non-empty list of strings"),
    (b'{"argv": ["--listen", "tcp://127.0.0.1:1"], "log": null, "shell": "rm -rf /"}\n', "must be an object"),
    (b'{"argv": ["--listen", "tcp://127.0.0.1:1", "--next", "tcp://127.0.0.1:2", "--no-such-flag"]}\n',
     "unrecognized arguments: --no-such-flag"),
    (b'{"argv": ["--listen", "udp://127.0.0.1:1", "--next", "tcp://127.0.0.1:2"]}\n', "--listen"),
    (b'{"argv": ["--next", "tcp://127.0.0.1:2"]}\n', "--listen"),
    (b"{" + b" " * (65 << 10) + b"}\n", "past the 65536-byte bound"),
])
def test_a_spare_refuses_an_order_that_is_not_one_and_says_why(tmp_path, order, says):
    """Whatever comes on its stdin that is not a takeover order ends the spare with code 2 and a message naming
    what was wrong, having bound nothing (its owner then starts the stage the usual way)."""
    proc = _spare(tmp_path)
    out, _ = proc.communicate(order, timeout=120)
    text = out.decode()
    assert proc.returncode == 2, text
    assert says in text and "stagemesh spare: error:" in text, text
    assert "takes over" not in text


@pytest.mark.processes
def test_a_spare_whose_owner_leaves_ends(tmp_path):
    proc = _spare(tmp_path)
    out, _ = proc.communicate(b"", timeout=120)
    assert proc.returncode == 0 and "no takeover order" in out.decode(), out.decode()

