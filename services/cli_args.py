"""Argument helpers shared by the `stagemesh` subcommands: every flag that more than one command takes is
declared here, once, with its default from shared.config where it has one."""

from __future__ import annotations

import argparse

from shared.config import SERVING_DEFAULTS, ServingConfig
from shared.device import DTYPES
from shared.errors import StagemeshError
from shared.sampling import SamplingParams


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--model", default="smollm2", help="alias (smollm2) or path to a .gguf file (default: smollm2)")
    if dtype:
        p.add_argument("--dtype", choices=list(DTYPES), default=None,
                       help="compute dtype (default: bfloat16 where the CPU/GPU supports it, else float32)")


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


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """A stage's KV capacity (`stage`, and `up` for each of its stages)."""
    d = SERVING_DEFAULTS
    p.add_argument("--kv-slots", type=int, default=d.kv_slots, help=f"concurrent sequences per stage (default {d.kv_slots})")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help=f"tokens per sequence (default {d.max_seq_len}, capped by the model's context)")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The gateway's scheduling knobs (`gateway`, `up`)."""
    d = SERVING_DEFAULTS
    p.add_argument("--max-inflight", type=int, default=None,
                   help="micro-batches in flight at once (default: number of stages, at least 2)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests waiting for admission before 429 (default {d.max_queue})")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help=f"prompt tokens per prefill chunk (default {d.prefill_chunk})")
    p.add_argument("--token-budget", type=int, default=d.token_budget,
                   help=f"tokens per micro-batch (default {d.token_budget})")


def serving_from_args(args) -> ServingConfig:
    """The ServingConfig these arguments describe (flags a command lacks keep their defaults); validated."""
    d = SERVING_DEFAULTS
    return ServingConfig(**{name: getattr(args, name, getattr(d, name))
                            for name in ("prefill_chunk", "token_budget", "max_queue", "kv_slots", "max_seq_len")})


def parse_host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise StagemeshError(f"{flag} {text!r} must be HOST:PORT, e.g. 127.0.0.1:8101")
    return host.strip("[]"), int(port)
