"""The gateway's configuration, its defaults and edge limits: plain values, no aiohttp, so `services/process/args.py`
builds its flags from GatewayConfig's fields (and `stagemesh trace` finds the API key's variable) without importing
the app. Field conventions (knob, flag names, validation naming the flag) are shared/config.py's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit, urlunsplit

from shared.config import check, check_int, check_seconds, flag_for, knob, not_a_flag, parse_bytes
from shared.errors import StagemeshError

API_KEY_ENV = "STAGEMESH_API_KEY"  # when set, /v1/* requires `Authorization: Bearer <key>`
# when set, the routes that change the mesh (OPERATOR_PATHS) require it instead of the API key; where an API key is set
# and this is not, they are refused: a client with the API key generates, it does not move layers between hosts
OPERATOR_KEY_ENV = "STAGEMESH_OPERATOR_KEY"
OPERATOR_PATHS = ("/v1/mesh/resplit", "/v1/mesh/replace")

# Edge limits that are not flags (README "Security / At the HTTP edge" lists them with the flags' defaults).
BODY_READ_TIMEOUT_S = 30.0  # a request body must arrive within this (a trickled body is cut with 408)
SMALL_PROMPT_CHARS = 8192  # prompts up to this tokenize in the small lane; longer ones queue in the big lane
MAX_BIG_PROMPTS_WAITING = 32  # big prompts waiting for the big lane before 429
FLUSH_AFTER_DRAIN_S = 5.0  # after the drain, how long handlers get to send their final error event


def _origin(text: str) -> str:
    """An --allow-origin value, normalized: '*' or SCHEME://HOST[:PORT] in lower case without a trailing slash."""
    o = text.strip().lower().rstrip("/")
    if o != "*" and not (o.startswith(("http://", "https://")) and "/" not in o.split("://", 1)[1]):
        raise ValueError(f"{o!r} must be '*' or SCHEME://HOST[:PORT], e.g. https://app.example.com (no path)")
    return o


def _host(text: str) -> str:
    """An --allow-host value, normalized: a host name, .domain or *, lower case, no trailing dot."""
    h = text.strip().lower().rstrip(".")
    if not h or "/" in h or ":" in h:
        raise ValueError(f"{h!r} must be a host name such as gateway.example.com, .example.com (a domain and the "
                         "names below it) or * (no scheme, port or path)")
    return h


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's HTTP edge and request defaults (`gateway`, `up`)."""

    model_id: str = not_a_flag("the model's name in the API: --model")
    api_key: str | None = not_a_flag(f"from ${API_KEY_ENV}", default=None)
    operator_key: str | None = not_a_flag(f"from ${OPERATOR_KEY_ENV}", default=None)
    bind_host: str | None = not_a_flag("the address it listens on (serve_until_signal sets it)", default=None)
    default_max_tokens: int | None = knob(
        None, "a request that leaves out max_tokens generates at most N tokens", metavar="N",
        unset="until a stop or the context is full, as OpenAI's API defines it")
    request_timeout_s: float = knob(600.0, "a request that sets no timeout of its own ends with finish_reason "
                                           "'timeout' after this long", unit="seconds")
    allow_origins: tuple[str, ...] = knob(
        (), "let web pages of ORIGIN (e.g. https://app.example.com; repeatable; * = any) call the API and the "
            "websocket", flag="--allow-origin", repeatable=True, parse=_origin, metavar="ORIGIN",
        unset="only pages the gateway serves itself")
    allow_hosts: tuple[str, ...] = knob(
        (), "also answer requests whose Host is NAME (repeatable; .example.com = that domain and every name below "
            "it; * = any)", flag="--allow-host", repeatable=True, parse=_host, metavar="NAME",
        unset="IP addresses, localhost and the --listen/--host address only, so a page on another name that resolves "
              "here (DNS rebinding) is refused with 403")
    metrics_require_key: bool = knob(False, f"require the API key (${API_KEY_ENV}) on /metrics too")
    drain_timeout_s: float = knob(30.0, "on SIGTERM, how long running requests may finish", unit="seconds")
    keepalive_timeout_s: float = knob(15.0, "close a connection idle this long, or that has not sent its request "
                                            "headers within it", unit="seconds")
    allow_trace: bool = knob(False, "answer requests with \"trace\": true (every layer's activations of that request: "
                                    "an operator's debugging tool; `stagemesh trace` needs it)")
    chat_template: str | None = knob(
        None, "render chat requests with this template: a built-in name (chatml, gemma, llama3, phi3, mistral) or "
              "a Jinja file; none: serve text completion only (a base model)", metavar="NAME|FILE|none",
        unset="the model file's own; for a file without one, its family's (by its turn markers)")
    state_dir: str | None = knob(None, "where resumable requests are logged, so that a restarted gateway takes them "
                                       "back and their clients read on: a directory (SQLite), or a Redis URL "
                                       "redis://[:PASSWORD@]HOST:PORT/DB[?prefix=NAME] that several gateways share "
                                       "(one takes over another's requests when it stops); off: keep no log",
                                 metavar="DIR|URL|off", unset="$XDG_DATA_HOME/stagemesh/gateway-PORT (~/.local/share/...)")
    state_keep_s: float = knob(600.0, "a logged request is taken back (after a restart, by a peer) for this long after "
                                      "it began", unit="seconds")
    max_detached_per_user: int = knob(16, "requests one client may have running with no connection waiting for them "
                                          "(background responses, and resumable requests whose connection went): "
                                          "past it 429 with Retry-After; a client is its API `user` (with one API "
                                          "key, the only name it has), and requests without one count as one client",
                                      metavar="N")
    state_max_requests: int = knob(4096, "resumable requests logged at once; past it a request runs unlogged (it "
                                         "still resumes after a disconnect, not after a restart)", metavar="N")
    served_model_name: str | None = knob(None, "the model's name in the API (/v1/models, each response's model)",
                                         metavar="NAME", unset="--model's alias, or the file's name without .gguf")
    trace_budget: int = knob(64 << 20, "activation bytes one traced request may collect (e.g. 16M); beyond it the "
                                       "trace stops and says so", unit="bytes", parse=parse_bytes)
    stored_responses: int = knob(1024, "/v1/responses keeps at most N ended responses (the most recently ended; "
                                       "running ones always), in memory", metavar="N")
    stored_responses_ttl_s: float = knob(600.0, "/v1/responses forgets an ended response this long after it ended",
                                         unit="seconds")
    join_ready_timeout_s: float = knob(180.0, "with --join-token: a host placed in the mesh (`stagemesh join`) that "
                                              "has not loaded its layers and said it is ready within this long is "
                                              "dropped (nothing waited for it; it may join again)", unit="seconds")

    def __post_init__(self):
        for name, normal in (("allow_origins", _origin), ("allow_hosts", _host)):
            try:
                object.__setattr__(self, name, tuple(normal(v) for v in getattr(self, name)))  # frozen: set once here
            except ValueError as e:
                raise StagemeshError(f"{flag_for(self, name)} {e}") from None
            except (TypeError, AttributeError):
                check(self, name, False, "a list of strings")
        for name in ("metrics_require_key", "allow_trace"):
            check(self, name, isinstance(getattr(self, name), bool), "given or left out (a switch)")
        for name in ("chat_template", "served_model_name", "state_dir"):
            value = getattr(self, name)
            check(self, name, value is None or (isinstance(value, str) and bool(value.strip())), "a non-empty name")
        if self.state_dir is not None and is_url(self.state_dir):
            parse_redis_url(self.state_dir)  # a typo is an error now, not a directory named after the URL
        check_int(self, "default_max_tokens", 1, none_ok=True)
        check_seconds(self, "request_timeout_s", 0, strict=True)
        check_seconds(self, "drain_timeout_s", 0, strict=False)
        check_seconds(self, "keepalive_timeout_s", 0, strict=True)
        check_int(self, "trace_budget", 1)
        check_int(self, "stored_responses", 0)
        check_seconds(self, "stored_responses_ttl_s", 0, strict=False)
        check_seconds(self, "join_ready_timeout_s", 0, strict=True)
        check_seconds(self, "state_keep_s", 0, strict=True)
        check_int(self, "state_max_requests", 0)
        check_int(self, "max_detached_per_user", 1)
        if self.metrics_require_key and not self.api_key:
            raise StagemeshError(f"--metrics-require-key needs an API key: set {API_KEY_ENV}")


REDIS_URL_FORM = "redis://[:PASSWORD@]HOST:PORT/DB[?prefix=NAME]"


def is_url(where: str) -> bool:
    """--state-dir names a URL (only redis:// and rediss:// are served; parse_redis_url says so), not a directory."""
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", where) is not None


@dataclass(frozen=True)
class RedisTarget:
    """A checked --state-dir Redis URL."""

    url: str  # what the client connects to (its password kept, ?prefix= dropped): never shown
    prefix: str  # the log's keys begin <prefix>:<mesh>:
    shown: str  # the URL as messages show it: no password


def parse_redis_url(url: str) -> RedisTarget:
    """redis://[:PASSWORD@]HOST:PORT/DB[?prefix=NAME] (rediss:// for TLS), checked at the edge (GatewayConfig) so a
    typo is an error before the model loads, not a log in a directory named after the URL."""
    parts = urlsplit(url)
    shown = url.replace(parts.netloc, parts.netloc.rpartition("@")[2], 1) if "@" in parts.netloc else url

    def bad(what: str) -> StagemeshError:
        return StagemeshError(f"--state-dir {shown}: {what}; a Redis log is {REDIS_URL_FORM} (rediss:// for TLS), "
                              "a directory is an SQLite log, off keeps none")

    if parts.scheme not in ("redis", "rediss"):
        raise bad(f"{parts.scheme}:// is not a log this gateway can keep")
    if not parts.hostname:
        raise bad("no host")
    try:
        parts.port  # noqa: B018 -- urllib checks it only when read
    except ValueError:
        raise bad("the port must be a number from 1 to 65535") from None
    if parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise bad(f"the path is the database number (/0), not {parts.path!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"prefix"})
    if unknown:
        raise bad(f"only ?prefix= is read, not {', '.join(unknown)}")
    prefix = query.get("prefix", ["stagemesh"])[-1]
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
        raise bad(f"?prefix={prefix!r} must be a non-empty name of letters, digits, '_', '.' and '-'")
    return RedisTarget(urlunsplit(parts._replace(query="")), prefix, shown)
