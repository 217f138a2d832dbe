"""Argument helpers shared by the `stagemesh` subcommands: every flag that more than one command takes is
declared here, once; the serving knobs' flags are generated from their config dataclasses (add_config_args), so their
defaults and help live only on the fields (shared/config.py, services/gateway/config.py)."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, Field, fields

from shared.config import flag_of, parse_bytes
from shared.device import DTYPES
from shared.errors import StagemeshError
from shared.models.compiled_decode import COMPILE_MODES
from shared.models.linear import WEIGHT_MODES
from shared.otlp import otlp_endpoint, require_sdk
from shared.sampling import SamplingParams

COMPILE_DECODE_ENV = "STAGEMESH_COMPILE_DECODE"  # the serving commands' --compile-decode default, when set


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True, serving: bool = False) -> None:
    """serving: a command that serves (stage, up): --compile-decode defaults to auto (or $STAGEMESH_COMPILE_DECODE)
    there, to off elsewhere (a one-off generate would spend its run compiling)."""
    p.add_argument("--model", default="smollm2", help="alias (smollm2, gemma3-270m) or path to a .gguf file (default: smollm2)")
    if dtype:
        p.add_argument("--dtype", choices=list(DTYPES), default=None,
                       help="compute dtype (default: float32 where the integer-dot kernels run, else bfloat16 "
                            "where the CPU/GPU multiplies it natively, else float32)")
        p.add_argument("--weights", choices=list(WEIGHT_MODES), default=None,
                       help="matmul kernels: auto (every quantized type decodes from a kernel of about its stored "
                            "size -- int4, two int4 planes, int8 rows -- and prefills from a dense copy, prepacked "
                            "bf16 or f32 as timed at load, where --memory-budget holds it), lean (the quantized "
                            "kernels only: memory about the file's share, slower prefill), bf16, f32 (exact "
                            "reference) (default: f32 when --dtype float32 is given, else auto)")
        p.add_argument("--memory-budget", type=_size, default=None, metavar="BYTES",
                       help="bytes a stage's weights and KV cache may take, e.g. 4G: auto keeps its dense prefill "
                            "copy only where it fits (default: 80%% of the memory available at load, shared by the "
                            "stages `up` starts)")
        p.add_argument("--kernel-plan", default=None, metavar="FILE|off",
                       help="the kernel plans file: which kernels this machine measured fastest for each shape, read "
                            "where it has them, measured and written where not (stages given one file pick the same "
                            "kernels); off measures at every load (default: $STAGEMESH_KERNEL_PLANS, else "
                            "~/.cache/stagemesh/kernel-plans.json)")
        p.add_argument("--batch-invariant", action="store_true",
                       help="each sequence's numbers independent of what else is in its micro-batch (fixed kernels "
                            "and reduction order): greedy output reproducible under any load; costs speed at large "
                            "batches")
        default = os.environ.get(COMPILE_DECODE_ENV, "auto") if serving else "off"
        if default not in COMPILE_MODES:
            raise StagemeshError(f"{COMPILE_DECODE_ENV}={default!r} must be one of {', '.join(COMPILE_MODES)}")
        p.add_argument("--compile-decode", nargs="?", const="on", choices=COMPILE_MODES, default=default,
                       help="one sequence's decode step under torch.compile (20-45%% faster per token on SmolLM2; "
                            "compiling takes ~3 min at the first start, seconds from inductor's cache after): auto "
                            "compiles in the background while the stage already serves eagerly, where the model and "
                            "weights allow it; on (the flag alone) compiles before the stage is ready and refuses what "
                            f"it does not cover (e.g. --batch-invariant); off never (default: {default})")


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def weights_from_args(args) -> str | None:
    """The weights mode a command loads with: --weights; else auto when --dtype is left to its default (a CPU without
    native bf16 computes in float32 by default and still serves with the fast kernels); else None, which
    resolve_weights turns into f32 for an explicit --dtype float32 (the exact reference) and auto otherwise."""
    return args.weights or (None if args.dtype else "auto")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_from_args(args) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise StagemeshError(str(e)) from None


# ---- flags generated from the config dataclasses (shared/config.py, services/gateway/config.py) ----------------------

_BASE_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _base_type(f: Field) -> type:
    """The value type of field f: int for `int | None`, str for `tuple[str, ...]` (annotations are strings here)."""
    text = str(f.type)
    if f.metadata.get("repeatable"):
        text = text.removeprefix("tuple[").split(",")[0]
    return _BASE_TYPES[text.split("|")[0].strip()]


def _on_off(f: Field) -> bool:
    """A bool field that is on by default: its flag takes on|off (a bare switch could not turn it off)."""
    return _base_type(f) is bool and f.default is True


def _size_text(n: int) -> str:
    """64 << 20 -> '64M' (the form the flag takes)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _default_note(f: Field) -> str:
    """What the flag's help says about its default, from the field's default (written nowhere else)."""
    meta, default = f.metadata, f.default
    if default is None or default == ():
        return f" (default: {meta['unset']})" if meta.get("unset") else ""
    if _base_type(f) is bool:
        return " (default on)" if default else ""
    if meta.get("unit") == "bytes":
        return f" (default {_size_text(default)})"
    return f" (default {default:g})" if isinstance(default, float) else f" (default {default})"


def _flag_type(cls: type, f: Field, flag: str):
    """argparse's type for field f: the text parsed (its `parse`, else its type), then checked by the config class's
    own validation with this one value, so a bad value is refused at parse time naming the flag."""
    parse = f.metadata.get("parse") or _base_type(f)
    required = {g.name: None for g in fields(cls) if g.default is MISSING and g.default_factory is MISSING}

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError as e:
            if f.metadata.get("parse"):
                raise argparse.ArgumentTypeError(str(e)) from None
            raise argparse.ArgumentTypeError(f"{text!r} is not {_TYPE_NAMES[parse]}") from None
        try:
            cls(**{**required, f.name: (value,) if f.metadata.get("repeatable") else value})
        except StagemeshError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None
        return value

    return convert


def add_config_args(p: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None) -> None:
    """One flag per field of config class `cls` (or per field named in `only`): --kebab-case name, type, default and
    help from the field. The parsed value lands under the field's own name (args.<field>)."""
    for f in fields(cls):
        flag = flag_of(f)
        if flag is None or (only is not None and f.name not in only):
            continue
        meta = f.metadata
        text = (meta["help"] + _default_note(f)).replace("%", "%%")
        if _on_off(f):
            p.add_argument(flag, dest=f.name, choices=("on", "off"), default="on", help=text)
        elif _base_type(f) is bool:
            p.add_argument(flag, dest=f.name, action="store_true", help=text)
        else:
            unit = meta.get("unit")
            metavar = meta.get("metavar") or {"seconds": "SECONDS", "bytes": "BYTES"}.get(unit) or (
                "N" if _base_type(f) is int else None)
            p.add_argument(flag, dest=f.name, type=_flag_type(cls, f, flag), metavar=metavar, help=text,
                           action="append" if meta.get("repeatable") else "store",
                           default=list(f.default) if meta.get("repeatable") else f.default)


def config_from_args(cls: type, args, **set_by_command):
    """The config of class `cls` these parsed arguments describe (fields whose flag a command lacks keep their
    defaults; `set_by_command` fills the fields that are no flag), validated by the class."""
    values = {}
    for f in fields(cls):
        if flag_of(f) is None or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if _on_off(f):
            value = value == "on"
        elif f.metadata.get("repeatable"):
            value = tuple(value)
        values[f.name] = value
    return cls(**values, **set_by_command)


def config_argv(config, names: tuple[str, ...]) -> list[str]:
    """The flags that give a command the values of `names` in `config` (what `up` passes on to its stages); a field
    left unset (None) is left to the command's own default."""
    argv = []
    for f in fields(config):
        if f.name in names and getattr(config, f.name) is not None:
            argv += [flag_of(f), str(getattr(config, f.name))]
    return argv


def model_flags(args) -> list[str]:
    """The add_model_args flags of args as a stage command line wants them (what `up` forwards to its stages)."""
    flags = []
    if getattr(args, "dtype", None):
        flags += ["--dtype", args.dtype]
    if getattr(args, "weights", None):
        flags += ["--weights", args.weights]
    if getattr(args, "batch_invariant", False):
        flags.append("--batch-invariant")
    if getattr(args, "memory_budget", None) is not None:  # `up` fixes its stages' shares of the default first
        flags += ["--memory-budget", str(args.memory_budget)]
    if getattr(args, "compile_decode", None):
        flags += ["--compile-decode", args.compile_decode]
    if getattr(args, "kernel_plan", None):
        flags += ["--kernel-plan", args.kernel_plan]
    return flags


def add_otlp_args(p: argparse.ArgumentParser) -> None:
    """Optional distributed tracing (`gateway`, `stage`, `up`, which passes it to its stages)."""
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces (one per request, a span per micro-batch per stage) over "
                        "OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 (needs the otlp extra: from the "
                        "checkout, .venv/bin/pip install -e '.[otlp]'; default: off)")


def otlp_from_args(args) -> str | None:
    """The validated OTLP/HTTP traces URL of --otlp-endpoint (None: tracing off); checks that the SDK is installed."""
    if getattr(args, "otlp_endpoint", None) is None:
        return None
    url = otlp_endpoint(args.otlp_endpoint)
    require_sdk()
    return url


def parse_host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise StagemeshError(f"{flag} {text!r} must be HOST:PORT, e.g. 127.0.0.1:8101")
    return host.strip("[]"), int(port)
