"""`stagemesh spare`: a stage process started ahead of need, which takes over the place of a stage that leaves.

A stage that dies (or is stopped) is started again by `stagemesh up` with the same command; until it is ready the
pipeline waits, and most of that wait is the new process's own start: the interpreter, torch and the runtime
imported (~2 s here), the model's file opened. A spare has done all of that already. It waits on its stdin, which only
the process that started it holds (no socket: nothing on the network can order it), for one takeover order:

    {"argv": [the stage command's flags, as `stagemesh stage` takes them], "log": "/path/stage1.log" | null}

one JSON line, at most MAX_ORDER_BYTES. It then appends its output to `log` and serves as that stage, on that stage's
addresses, keys and range (cmd_stage, with the file it already has open when --model names the same one). The gateway
sees what it sees when a stage restarts: the stage's address answers again, with a new incarnation, and the
sequences it held are replayed. An order that is not one (not JSON, flags `stagemesh stage` refuses) ends the spare
with code 2 and says why on its output; its owner starts the stage the usual way instead. Its stdin closing
without an order (its owner is gone) ends it with code 0.

What is shared by every stage of a pipeline (the model's file, its environment) is what a spare prepares; what makes
a stage one place in the pipeline (its range, addresses, keys, threads) comes with the order, so one spare covers
any stage of any pipeline on its host that serves the same file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from shared.errors import StagemeshError

log = logging.getLogger("stagemesh.spare")

MAX_ORDER_BYTES = 64 << 10  # a stage's command line is ~1 kB; anything near this is not an order


class BadOrder(StagemeshError):
    """The takeover order is not one this spare can carry out (the message says what was wrong)."""


def read_order(line: bytes) -> tuple[list[str], str | None]:
    """The stage flags and log path of one takeover order (one JSON line). BadOrder when it is not one."""
    if len(line) > MAX_ORDER_BYTES:
        raise BadOrder(f"the takeover order is {len(line)} bytes, past the {MAX_ORDER_BYTES}-byte bound")
    try:
        order = json.loads(line)
    except ValueError as e:
        raise BadOrder(f"the takeover order is not JSON ({e}): send one line "
                       '{"argv": [stage flags], "log": path or null}') from None
    if not isinstance(order, dict) or set(order) - {"argv", "log"} or "argv" not in order:
        raise BadOrder('the takeover order must be an object {"argv": [stage flags], "log": path or null}, '
                       f"got {str(order)[:200]}")
    argv, log_path = order["argv"], order.get("log")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise BadOrder(f"the takeover order's argv must be a non-empty list of strings, got {str(argv)[:200]}")
    if log_path is not None and not isinstance(log_path, str):
        raise BadOrder(f"the takeover order's log must be a path or null, got {log_path!r}")
    return argv, log_path


def stage_args(argv: list[str]) -> argparse.Namespace:
    """`stagemesh stage ARGV` parsed and checked as the stage command does it. BadOrder when it refuses them."""
    from services.stage.flags import check_stage_flags, register

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse would print usage and exit: here it is the order that is wrong
            raise BadOrder(f"the takeover order's stage flags: {message}")

    parser = Parser(prog="stagemesh", allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true")
    register(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    args = parser.parse_args(["stage", *argv])
    check_stage_flags(args)
    return args


def _append_output_to(path: str) -> None:
    """From now on this process's stdout and stderr append to `path` (the stage's own log)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def cmd_spare(args) -> int:
    t0 = time.perf_counter()
    # torch and the runtime: what a restarted stage spends most of its start on
    from services.stage import main as stage_main
    from shared.kernels import plans
    from shared.runtime.model_files import ModelFiles

    files = ModelFiles.open(args.model)
    log.info("spare ready in %.1f s: %s open; waiting on stdin for the stage to take over", time.perf_counter() - t0,
             os.path.basename(files.loader.path))
    line = sys.stdin.buffer.readline(MAX_ORDER_BYTES + 1)
    if not line.strip():
        log.info("stdin closed with no takeover order (its owner is gone); stopping")
        return 0
    argv, log_path = read_order(line)
    stage = stage_args(argv)  # a refused order is said on the spare's own output
    if log_path:
        _append_output_to(log_path)
    plans.use(plans.KernelPlans.from_flag(stage.kernel_plan))
    log.info("spare (pid %d) takes over: stagemesh stage %s", os.getpid(), " ".join(argv))
    return stage_main.cmd_stage(stage, opened=files)
