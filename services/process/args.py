"""Argument helpers shared by the `stagemesh` subcommands: every flag that more than one command takes is
declared here, once; the serving knobs' flags are generated from their config dataclasses (add_config_args), so their
defaults and help live only on the fields (shared/config.py, services/gateway/config.py)."""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import MISSING, Field, fields

from shared.config import LoadConfig, flag_of, serving_defaults
from shared.errors import StagemeshError
from shared.observe.otlp import otlp_endpoint, require_sdk


def later(target: str, check=None):
    """The command function "module:function", imported when the command runs: a command's flags are declared
    without importing what runs it (torch, aiohttp), so `--help` and a flag's error come at once. check(args), a
    light function, runs first: what a user can get wrong (addresses, ports, the model's file) is refused before
    torch loads."""
    module, name = target.split(":")

    def run(args):
        if check is not None:
            check(args)
        return getattr(importlib.import_module(module), name)(args)

    run.target = target
    return run


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True, serving: bool = False) -> None:
    """--model; with dtype (a command that loads layers), the LoadConfig flags too. serving: a command that serves
    (stage, up): --compile-decode defaults to auto (or $STAGEMESH_COMPILE_DECODE) there, to off elsewhere."""
    p.add_argument("--model", default="smollm2", help="alias (smollm2, gemma3-270m) or path to a .gguf file (default: smollm2)")
    if dtype:
        add_config_args(p, LoadConfig, defaults=serving_defaults(os.environ) if serving else None)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_from_args(args):
    """The SamplingParams of --temperature, --top-k, --top-p and --seed."""
    from shared.batch.sampling import (
        SamplingParams,  # torch: imported when a command runs, not to parse its flags
    )

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


def _default_note(f: Field, default) -> str:
    """What the flag's help says about its default, from the field's default (written nowhere else)."""
    meta = f.metadata
    if default is None or default == ():
        return f" (default: {meta['unset']})" if meta.get("unset") else ""
    if _base_type(f) is bool:
        return " (default on)" if default else ""
    if meta.get("unit") == "bytes":
        return f" (default {_size_text(default)})"
    if meta.get("choices"):
        return f" (default: {default})"
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


def add_config_args(p: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None,
                    defaults: dict | None = None) -> None:
    """One flag per field of config class `cls` (or per field named in `only`): --kebab-case name, type, default and
    help from the field (or from `defaults`, this command's own, checked by the class). The parsed value lands under
    the field's own name (args.<field>)."""
    defaults = defaults or {}
    if defaults:
        cls(**defaults)  # a command's own default is validated like any value
    for f in fields(cls):
        flag = flag_of(f)
        if flag is None or (only is not None and f.name not in only):
            continue
        meta = f.metadata
        default = defaults.get(f.name, f.default)
        text = (meta["help"] + _default_note(f, default)).replace("%", "%%")
        if meta.get("choices"):
            p.add_argument(flag, dest=f.name, choices=meta["choices"], default=default, help=text,
                           **({"nargs": "?", "const": meta["const"]} if meta.get("const") else {}))
        elif _on_off(f):
            p.add_argument(flag, dest=f.name, choices=("on", "off"), default="on", help=text)
        elif _base_type(f) is bool:
            p.add_argument(flag, dest=f.name, action="store_true", help=text)
        else:
            unit = meta.get("unit")
            metavar = meta.get("metavar") or {"seconds": "SECONDS", "bytes": "BYTES"}.get(unit) or (
                "N" if _base_type(f) is int else None)
            p.add_argument(flag, dest=f.name, type=_flag_type(cls, f, flag), metavar=metavar, help=text,
                           action="append" if meta.get("repeatable") else "store",
                           default=list(default) if meta.get("repeatable") else default)


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


def config_argv(config, names: tuple[str, ...] | None = None) -> list[str]:
    """The flags that give a command the values of `names` (None: every flag) in `config` (what `up` passes on to its
    stages); a field left unset (None) is left to the command's own default, a switch is given only when on."""
    argv = []
    for f in fields(config):
        flag, value = flag_of(f), getattr(config, f.name)
        if flag is None or (names is not None and f.name not in names) or value is None:
            continue
        if _base_type(f) is bool and not _on_off(f):
            argv += [flag] if value else []
        elif _on_off(f):
            argv += [flag, "on" if value else "off"]
        elif f.metadata.get("repeatable"):
            argv += [x for v in value for x in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return argv


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
