"""`stagemesh stage`'s flags, declared without importing what runs it (services/stage/main.py, imported when the
command runs), so --help and a flag's error come at once."""

from __future__ import annotations

from services.process.args import (
    add_config_args,
    add_model_args,
    add_otlp_args,
    config_from_args,
    later,
    otlp_from_args,
    parse_host_port,
)
from services.process.keys import add_security_args
from shared.config import LoadConfig, StageConfig, check_address
from shared.errors import StagemeshError
from shared.files.model_registry import resolve_model


def register(sub) -> None:
    p = sub.add_parser("stage", help="serve one layer range as a pipeline stage",
                       description="Receive activations on --listen, compute this stage's layers, send to --next.")
    add_model_args(p, serving=True)
    p.add_argument("--layers", help="layer range START:STOP served by this stage, e.g. 0:15 (with --keys, also give "
                                    "--stage-index: which stage's keys are this one's)")
    p.add_argument("--stage-index", type=int,
                   help="this stage's index (with --num-stages and no --layers: a split of equal compute, the lm_head "
                        "counted)")
    p.add_argument("--num-stages", type=int, help="number of stages in the pipeline (with --stage-index)")
    p.add_argument("--listen", required=True, help="ZeroMQ address to bind for input, e.g. tcp://127.0.0.1:5551")
    p.add_argument("--next", required=True,
                   help="ZeroMQ address of the next stage (may contain {next}: this stage's index + 1, as in a "
                        "StatefulSet's DNS names), or the gateway's result address")
    p.add_argument("--last-next", default=None,
                   help="where the last stage sends results, overriding --next (lets every stage share one command)")
    p.add_argument("--http", default="127.0.0.1:8101", help="HOST:PORT for health, readiness, info and metrics")
    add_config_args(p, StageConfig)  # --kv-slots, --max-seq-len, --slot-lease, --threads
    p.add_argument("--calibrate", default=None, metavar="ROWS[,ROWS]",
                   help="before it reports ready, time decode steps of its own layers at these batch sizes (about a "
                        "second each, so a throttled host shows its real speed) and report them with its free memory "
                        "in /info, for a gateway started with --split auto (`up --split auto` passes it)")
    p.add_argument("--no-prefetch", action="store_true", help="receive, compute and send one after another (baseline)")
    p.add_argument("--no-trace", action="store_true", help="ignore trace requests entirely (the benchmark's bypass)")
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="stop when process PID (the launcher, e.g. `stagemesh up`) is no longer this one's parent")
    add_otlp_args(p)
    add_security_args(p)
    p.set_defaults(func=later("services.stage.main:cmd_stage", check=check_stage_flags))

    p = sub.add_parser("spare", help="a stage started ahead of need: takes over a stage that leaves",
                       description="Import the runtime and open --model, then wait on stdin for one takeover order "
                                   '({"argv": [stage flags], "log": path}, one JSON line) and serve as that stage. '
                                   "`stagemesh up --spares N` starts and orders them; see services/stage/spare.py.")
    p.add_argument("--model", default="smollm2", help="alias or .gguf path: the file of the stages it may replace")
    p.set_defaults(func=later("services.stage.spare:cmd_spare", check=lambda args: resolve_model(args.model)))


def check_stage_flags(args) -> None:
    """What a stage's command line can get wrong, refused before torch loads (cmd_stage uses the same values)."""
    check_address(args.listen, "--listen")
    parse_host_port(args.http, "--http")
    config_from_args(StageConfig, args)
    config_from_args(LoadConfig, args)
    otlp_from_args(args)
    calibrate_rows(args.calibrate)
    resolve_model(args.model)  # an alias whose package is missing, or no such file


def calibrate_rows(text: str | None) -> list[int] | None:
    """--calibrate's batch sizes (None: no calibration), or a StagemeshError saying what to write."""
    if text is None:
        return None
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise StagemeshError(f"--calibrate {text!r} must be batch sizes of 1 or more, comma-separated, e.g. 1,8")
    return rows
