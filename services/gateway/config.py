"""The gateway's configuration, its defaults and edge limits: plain values, no aiohttp, so `services/cli_args.py`
builds its flags (and `stagemesh trace` finds the API key's variable) without importing the app."""

from __future__ import annotations

from dataclasses import dataclass

API_KEY_ENV = "STAGEMESH_API_KEY"  # when set, /v1/* requires `Authorization: Bearer <key>`

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_STALL_S = 30.0  # a micro-batch not back after this long is lost: far above any one micro-batch's compute

# Edge limits (README "Security / At the HTTP edge" lists them with these defaults).
DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0  # idle keep-alive, and (aiohttp >= 3.10) the time to send a first request's headers
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # SIGTERM: running streams get this long to finish
BODY_READ_TIMEOUT_S = 30.0  # a request body must arrive within this (a trickled body is cut with 408)
SMALL_PROMPT_CHARS = 8192  # prompts up to this tokenize in the small lane; longer ones queue in the big lane
MAX_BIG_PROMPTS_WAITING = 32  # big prompts waiting for the big lane before 429
FLUSH_AFTER_DRAIN_S = 5.0  # after the drain, how long handlers get to send their final error event


@dataclass
class GatewayConfig:
    model_id: str
    api_key: str | None = None
    default_max_tokens: int | None = None  # a request without max_tokens: at most this many (None: the context)
    request_timeout_s: float = DEFAULT_TIMEOUT_S
    allow_origins: tuple[str, ...] = ()  # browser origins besides the gateway's own; "*" = any
    allow_hosts: tuple[str, ...] = ()  # Host names besides IP addresses, localhost and bind_host; ".dom" = dom and below
    bind_host: str | None = None  # the address it listens on (serve_until_signal sets it)
    metrics_require_key: bool = False  # /metrics needs the API key too
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    allow_trace: bool = False  # answer "trace": true (an operator's tool: every layer's activations of the request)
    trace_budget: int = 64 << 20  # activation bytes one traced request may collect
