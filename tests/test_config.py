"""The serving knobs' flags are generated from their config dataclasses (shared/config.py, services/gateway/config.py):
each field has exactly one flag in each command that takes it, whose default is the field's own, and a bad value is
refused naming that flag, both when a config is built in code and when the command line is parsed."""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import fields

import pytest

from services.cli.flags import STAGE_FLAGS
from services.cli.main import build_parser
from services.gateway.config import GatewayConfig
from services.process.args import config_argv, config_from_args
from services.testing.k8s_render import find, render
from shared.config import GATEWAY_PORT, LoadConfig, SchedulerConfig, StageConfig, flag_of, serving_defaults
from shared.errors import StagemeshError
from tests.conftest import ROOT

# command -> (the least it parses with, {config class: the fields it takes (None: all)}, what the command fills in)
COMMANDS = {
    "stage": (["stage", "--listen", "tcp://127.0.0.1:5551", "--next", "tcp://127.0.0.1:5552"],
              {StageConfig: None, LoadConfig: None}),
    "gateway": (["gateway", "--stages", "http://a:8101"], {SchedulerConfig: None, GatewayConfig: None}),
    "up": (["up"], {StageConfig: STAGE_FLAGS, SchedulerConfig: None, GatewayConfig: None, LoadConfig: None}),
    "generate": (["generate", "--prompt", "hi"], {LoadConfig: None}),
}
SET_BY_COMMAND = {GatewayConfig: {"model_id": "smollm2"}}
SERVING = ("stage", "up")  # their LoadConfig defaults are serving_defaults' (compile in the background)


def command_defaults(command: str, cls) -> dict:
    """The values a command's defaults give a config beyond the class's own."""
    serving = serving_defaults(os.environ) if cls is LoadConfig and command in SERVING else {}
    return {**SET_BY_COMMAND.get(cls, {}), **serving}


def subparser(command: str) -> argparse.ArgumentParser:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flagged(cls, only):
    return [f for f in fields(cls) if flag_of(f) is not None and (only is None or f.name in only)]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_has_exactly_one_flag_whose_default_is_the_fields(command):
    argv, classes = COMMANDS[command]
    parser = subparser(command)
    args = build_parser().parse_args(argv)
    for cls, only in classes.items():
        fs = flagged(cls, only)
        assert fs, cls  # not vacuous
        for f in fs:
            setting = [a for a in parser._actions if a.dest == f.name]
            assert len(setting) == 1 and setting[0].option_strings == [flag_of(f)], (command, f.name, setting)
        built = config_from_args(cls, args, **SET_BY_COMMAND.get(cls, {}))
        assert built == cls(**command_defaults(command, cls)), (command, cls.__name__)
    taken = [flag_of(f) for cls, only in classes.items() for f in flagged(cls, only)]
    assert len(taken) == len(set(taken)), f"two fields of {command} share a flag"


def test_every_field_either_has_a_flag_or_says_who_sets_it():
    for cls in (StageConfig, SchedulerConfig, GatewayConfig, LoadConfig):
        for f in fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
            if flag_of(f) is None:
                assert f.metadata.get("not_a_flag"), f.name


def test_up_passes_its_stage_flags_on_to_each_stage():
    """config_argv renders what `up` forwards; a stage parses it back to the same values."""
    given = StageConfig(kv_slots=5, max_seq_len=64)
    up = config_from_args(StageConfig, build_parser().parse_args(["up", *config_argv(given, STAGE_FLAGS)]))
    assert (up.kv_slots, up.max_seq_len) == (5, 64)
    stage_argv = COMMANDS["stage"][0] + config_argv(up, STAGE_FLAGS)
    assert config_from_args(StageConfig, build_parser().parse_args(stage_argv)) == given


def test_up_passes_every_load_setting_on_to_each_stage():
    """Every LoadConfig field away from its default: `up` parses it, forwards it (config_argv), a stage parses the
    same config back."""
    given = LoadConfig(dtype="bfloat16", kv_dtype="float32", weights="lean", memory_budget=3 << 30,
                       kernel_plan="/tmp/plans.json", batch_invariant=True, compile_decode="on")
    assert all(getattr(given, f.name) != f.default for f in fields(LoadConfig))  # none left at its default
    up = config_from_args(LoadConfig, build_parser().parse_args(["up", *config_argv(given)]))
    assert up == given
    stage_argv = COMMANDS["stage"][0] + config_argv(up)
    assert config_from_args(LoadConfig, build_parser().parse_args(stage_argv)) == given
    assert config_argv(LoadConfig()) == ["--compile-decode", "off"]  # unset fields are the stage's own defaults


def test_flags_reach_the_config():
    argv = ["gateway", "--stages", "http://a:8101", "--prefix-cache", "off", "--failover-timeout", "7.5",
            "--max-replays", "0", "--allow-origin", "HTTPS://App.Example.com/", "--allow-origin", "*",
            "--trace-budget", "16M", "--request-timeout", "inf", "--allow-trace"]
    args = build_parser().parse_args(argv)
    scheduling = config_from_args(SchedulerConfig, args)
    assert (scheduling.prefix_cache, scheduling.failover_timeout_s, scheduling.max_replays) == (False, 7.5, 0)
    gateway = config_from_args(GatewayConfig, args, model_id="m")
    assert gateway.allow_origins == ("https://app.example.com", "*")
    assert (gateway.trace_budget, gateway.request_timeout_s, gateway.allow_trace) == (16 << 20, math.inf, True)


BAD = [
    (StageConfig, "kv_slots", 0, "0"),
    (StageConfig, "max_seq_len", 8, "8"),
    (StageConfig, "slot_lease_s", -1.0, "-1"),
    (StageConfig, "threads", 0, "0"),
    (SchedulerConfig, "max_inflight", 0, "0"),
    (SchedulerConfig, "max_queue", 0, "0"),
    (SchedulerConfig, "prefill_chunk", -5, "-5"),
    (SchedulerConfig, "token_budget", 0, "0"),
    (SchedulerConfig, "prefix_cache_audit", 1.5, "1.5"),
    (SchedulerConfig, "stall_timeout_s", 0.0, "0"),
    (SchedulerConfig, "stage_poll_s", -0.5, "-0.5"),
    (SchedulerConfig, "failover_timeout_s", math.nan, "nan"),
    (SchedulerConfig, "max_replays", -1, "-1"),
    (GatewayConfig, "default_max_tokens", 0, "0"),
    (GatewayConfig, "request_timeout_s", 0.0, "0"),
    (GatewayConfig, "allow_origins", ("example.com/x",), "example.com/x"),
    (GatewayConfig, "allow_hosts", ("a.example:80",), "a.example:80"),
    (GatewayConfig, "drain_timeout_s", -1.0, "-1"),
    (GatewayConfig, "keepalive_timeout_s", 0.0, "0"),
    (GatewayConfig, "trace_budget", 0, "lots"),
    (LoadConfig, "dtype", "float8", "float8"),
    (LoadConfig, "weights", "dense", "dense"),
    (LoadConfig, "memory_budget", 0, "0"),
    (LoadConfig, "compile_decode", "sometimes", "sometimes"),
]


@pytest.mark.parametrize("cls, name, value, text", BAD, ids=[f"{c.__name__}.{n}" for c, n, _, _ in BAD])
def test_a_bad_value_is_refused_naming_the_flag(cls, name, value, text, capsys):
    flag = flag_of(next(f for f in fields(cls) if f.name == name))
    with pytest.raises(StagemeshError, match=re.escape(flag)):
        cls(**{**SET_BY_COMMAND.get(cls, {}), name: value})
    command = "stage" if cls in (StageConfig, LoadConfig) else "gateway"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*COMMANDS[command][0], flag, text])
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("cls", [StageConfig, SchedulerConfig, GatewayConfig, LoadConfig])
def test_a_value_of_the_wrong_type_is_refused_naming_the_flag(cls):
    """Every flagged field is checked, not only the ones with a range: a value of no sensible type names the flag."""
    for f in flagged(cls, None):
        with pytest.raises(StagemeshError, match=re.escape(flag_of(f))):
            cls(**{**SET_BY_COMMAND.get(cls, {}), f.name: object()})


def test_metrics_key_needs_an_api_key():
    with pytest.raises(StagemeshError, match="--metrics-require-key.*STAGEMESH_API_KEY"):
        GatewayConfig(model_id="m", metrics_require_key=True)
    assert GatewayConfig(model_id="m", metrics_require_key=True, api_key="k").metrics_require_key


def test_one_gateway_port():
    """The gateway's default port is GATEWAY_PORT wherever it is spelled outside Python: the Makefile and the
    manifests (which cannot import it)."""
    makefile = open(f"{ROOT}/Makefile").read()
    assert re.search(r"^PORT \?= (\d+)$", makefile, re.M).group(1) == str(GATEWAY_PORT)
    args = build_parser().parse_args(COMMANDS["gateway"][0])
    assert args.listen.endswith(f":{GATEWAY_PORT}")
    assert build_parser().parse_args(["up"]).port == GATEWAY_PORT
    pod = find(render("cpu"), "Deployment", "stagemesh-gateway")["spec"]["template"]["spec"]
    assert {"name": "http", "containerPort": GATEWAY_PORT} in pod["containers"][0]["ports"]


# Every case runs in one interpreter, in turn (tests.conftest.stagemesh_runs): whether it loaded torch (once loaded it
# stays, so the first case that loads it is the one named), its exit code and what it wrote to stderr.
CLI_CASES = [
    (["--help"], 0),
    (["up", "--help"], 0),
    (["stage", "--help"], 0),
    (["up", "--stage", "3"], 2),  # no abbreviation: --stage is not --stages
    (["up", "--stages", "0"], 2),
    (["up", "--stages", "40"], 2),  # more stages than the model has layers: read from its header alone
    (["up", "--model", "/no/such/model.gguf"], 2),
    (["up", "--memory-budget", "lots"], 2),
    (["stage", "--listen", "localhost:5551", "--next", "tcp://127.0.0.1:5552"], 2),
    (["stage", "--listen", "tcp://127.0.0.1:5551", "--next", "tcp://127.0.0.1:5552", "--model", "/no/such.gguf"], 2),
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"], 2),
]


@pytest.fixture(scope="module")
def cli_answers() -> list[tuple[bool, int, str]]:
    """(it loaded torch, exit code, stderr) of each of CLI_CASES, run in turn in one fresh interpreter."""
    from tests.conftest import stagemesh_runs

    return [(a["torch"], a["code"], a["stderr"]) for a in stagemesh_runs(*(argv for argv, _ in CLI_CASES), timeout=120)]


@pytest.mark.parametrize("case", range(len(CLI_CASES)), ids=[" ".join(argv) for argv, _ in CLI_CASES])
def test_help_and_mistakes_are_answered_before_torch_loads(cli_answers, case):
    """A command's flags are declared without importing what runs it, and what a user can get wrong is checked
    before torch loads: --help and a mistake are answered in well under a second, not after seconds of imports."""
    torch_loaded, code, stderr = cli_answers[case]
    assert (torch_loaded, code) == (False, CLI_CASES[case][1]), stderr
    if code:
        assert "error" in stderr, stderr
