"""StageInfo: what a stage says of itself on GET /info, as one type -- built by the stage (services/stage/worker.py),
sent as a flat JSON object, parsed and validated once by whoever polls it (the gateway's Pipeline, `up`, the
benchmarks). Nothing reads /info by key anywhere else.

A field that is also a Prometheus metric of the stage has the metric's name without the `stagemesh_stage_` prefix
(kv_slots_used is stagemesh_stage_kv_slots_used; a histogram's sum and count are its _sum and _count samples), so one
quantity has one name in /info, in /metrics and in the gateway's mesh view. Counters are cumulative since the process
started, on its monotonic clock `clock_s`, so a poller takes exact rates between two polls."""

from __future__ import annotations

import json
import math
import types
import typing
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, fields

MAX_RECENT_MB = 1024  # micro-batch ids a stage lists as recently received and sent
MAX_INFO_BYTES = 4 << 20  # the most of one /info body any reader reads (a stage's own is tens of kB)


class InfoError(ValueError):
    """A stage's /info does not have the shape of a StageInfo: which field, and what it should be."""


@dataclass(frozen=True)
class StageInfo:
    # who it is
    model: str
    fingerprint: str  # the model file's fingerprint: every stage of a pipeline serves the same one
    layers: tuple[int, int]  # [start, stop) of the model's layers
    num_layers: int  # the model's, all stages together
    position: str  # first | middle | last | only (shared.files.layers.StagePosition)
    incarnation: str  # new each time the process starts: a new one means its K/V is gone
    listen: str  # the ZeroMQ address it receives micro-batches on
    device: str
    dtype: str  # activations
    kv_dtype: str  # its K/V cache's (--kv-dtype, resolved)
    weights_mode: str  # shared.models.linear.WEIGHT_MODES
    batch_invariant: bool
    threads: int  # torch threads per micro-batch with others in flight ...
    threads_alone: int  # ... and alone in the pipeline (--threads-alone)
    prefetch: bool
    weights: dict  # what each matmul runs as, bytes, the memory budget's decision (StageWorker._weights_info)
    compiled_decode: dict  # shared.models.compiled_decode.CompiledDecode.info(), or {"state": "off", "reason"}
    kernel_plans: dict  # the plans file and how many plans were read from it, measured (shared.kernels.plans)
    keys: dict | None  # its sockets' CURVE public keys (None: plaintext)
    # its KV cache
    kv_slots: int  # rows for live sequences
    kv_slots_used: int
    kv_slots_cached: int  # rows kept as cached prefixes
    kv_prefix_slots: int  # rows for cached prefixes beside kv_slots
    kv_max_seq_len: int
    # the context it serves and why: {"model": the trained context, "max_seq_len", "why"} (StageRuntime.fit_context);
    # "rope": the rope frequency factors that context chooses ("long", "short" for LongRoPE; None: one set for all)
    context: dict
    kv_slot_lease_s: float
    kv_prefix_memory_bytes: int  # the bound on cached prefixes' K/V (the gateway evicts by it)
    kv_live_memory_bytes: int  # the bound on live sequences' own K/V (the gateway admits by it; 0: none)
    kv_cached_bytes: int
    kv_position_bytes: int  # K/V bytes of one position, all its layers
    kv_resident_bytes: int  # committed by positions written (page by page)
    kv_reserved_bytes: int  # what every row could take
    kv_shared_bytes: int  # read from a cached prefix's pages rather than copies
    slots_reclaimed: int  # slots whose lease expired
    prefixes_evicted: int
    # counters
    clock_s: float
    microbatches: int
    busy_seconds: float
    head_seconds: float  # of busy_seconds, the last stage's final norm + lm_head + sampling (0 on the others)
    cpu_seconds: float  # CPU time of the stage process, every thread
    cpu_limit: float  # the cores its cgroup may use (a CPU limit: shared.cpu.cpu_limit); 0: no limit
    waiting_for_input_seconds: float
    sending_seconds: float
    hop_latency_seconds_sum: float
    hop_latency_seconds_count: int
    dropped_messages: int
    rejected_messages: dict[str, int]  # by reason (shared.wire.protocol.REJECT_REASONS)
    handshakes_failed: dict[str, int]  # by direction: in, out
    recent_mb_in: tuple[int, ...]  # the latest micro-batch ids received ...
    recent_mb_out: tuple[int, ...]  # ... and handed on (where a stalled one stopped: stalled_hop)
    # its speed and free memory measured at start (--calibrate: shared.runtime.calibrate), for --split auto; None: not
    # measured. Of the layers it served then: the split moves after it
    calibration: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> StageInfo:
        """Validate a decoded /info body; InfoError names the first field that is missing or wrong."""
        if not isinstance(data, dict):
            raise InfoError(f"a JSON {type(data).__name__}, not an object")
        values = {}
        for f in fields(cls):
            if f.name not in data:
                raise InfoError(f"field {f.name!r} is missing (a stage of another stagemesh version?)")
            values[f.name] = _check(f.name, _HINTS[f.name], data[f.name])
        if not values["layers"][0] < values["layers"][1] <= values["num_layers"]:
            raise InfoError(f"field 'layers' must be [start, stop) within {values['num_layers']} layers, "
                            f"got {list(values['layers'])}")
        if values["kv_slots"] < 1 or values["kv_max_seq_len"] < 1:
            raise InfoError("fields 'kv_slots' and 'kv_max_seq_len' must be at least 1")
        return cls(**values)

    @property
    def prefix_positions(self) -> int | None:
        """Positions its cached prefixes may hold (None: it states no bound)."""
        if self.kv_prefix_memory_bytes < 1 or self.kv_position_bytes < 1:
            return None
        return self.kv_prefix_memory_bytes // self.kv_position_bytes

    @property
    def live_positions(self) -> int | None:
        """Positions its live sequences may hold of their own (None: it states no bound)."""
        if self.kv_live_memory_bytes < 1 or self.kv_position_bytes < 1:
            return None
        return self.kv_live_memory_bytes // self.kv_position_bytes


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx is then raised as an HTTPError: read_info names it


_OPENER = urllib.request.build_opener(_NoRedirects)


def refused_redirect(url: str, status: int, location: str | None) -> str:
    """Why a /info that answered a redirect is not read (the gateway's reader says the same)."""
    return (f"{url}/info answered {status}, a redirect to {(location or '(no Location)')[:200]}: not followed; "
            "give the stage process's own HTTP address")


def too_large(url: str) -> str:
    """Why a /info over MAX_INFO_BYTES is not read (the gateway's reader says the same)."""
    return (f"{url}/info is larger than {MAX_INFO_BYTES >> 20} MiB, the most read of one (a stage's is tens of kB): "
            "not read; is that URL a stagemesh stage?")


def read_info(url: str, timeout: float) -> StageInfo:
    """The /info of the stage whose HTTP address is `url`, read the way every reader reads one: no redirect followed,
    at most MAX_INFO_BYTES read. InfoError (a ValueError) naming what was wrong; OSError when it cannot be reached.
    For the CLI's synchronous callers; the gateway reads /info on its own event loop (Pipeline._info), by the same
    rules."""
    url = url.rstrip("/")
    try:
        with _OPENER.open(f"{url}/info", timeout=timeout) as r:
            declared = r.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > MAX_INFO_BYTES:
                raise InfoError(too_large(url))
            body = r.read(MAX_INFO_BYTES + 1)
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            raise InfoError(refused_redirect(url, e.code, e.headers.get("Location"))) from None
        raise
    if len(body) > MAX_INFO_BYTES:
        raise InfoError(too_large(url))
    try:
        return StageInfo.from_json(json.loads(body))
    except ValueError as e:  # UnicodeDecodeError and InfoError included
        raise InfoError(f"{url}/info is malformed: {e}") from None


_HINTS = typing.get_type_hints(StageInfo)
_MAX_INT = 1 << 62


def _check(name: str, hint, value):
    """value as the field's type wants it (lists become tuples), or InfoError."""
    def bad(want: str):
        return InfoError(f"field {name!r} must be {want}, got {str(value)[:60]!r}")

    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is int:
        if type(value) is not int or not 0 <= value < _MAX_INT:
            raise bad("a non-negative integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad("a non-negative number")
        return float(value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:  # tuple[int, int] or tuple[int, ...]
        if not isinstance(value, list) or len(value) > MAX_RECENT_MB \
                or (args[-1] is not Ellipsis and len(value) != len(args)):
            raise bad(f"a list of {'integers' if args[-1] is Ellipsis else f'{len(args)} integers'}")
        return tuple(_check(name, int, v) for v in value)
    if origin is dict:  # dict[str, int]: counts by label
        if not isinstance(value, dict):
            raise bad("an object of counts")
        return {str(k): _check(name, int, v) for k, v in value.items()}
    if hint is dict:
        if not isinstance(value, dict):
            raise bad("an object")
        return value
    if origin in (types.UnionType, typing.Union):  # dict | None
        if value is None:
            return None
        if name == "calibration":
            return _check_calibration(value, bad)
        if not isinstance(value, dict) or not all(isinstance(v, (str, type(None))) for v in value.values()):
            raise bad("null or an object of public keys")
        return value
    raise TypeError(f"StageInfo field {name!r}: no check for {hint!r}")


def _check_calibration(value, bad) -> dict:
    """A --calibrate measurement as the gateway's --split auto reads it: one ms_per_step per batch size in rows."""
    want = ("null or {rows: [sizes >= 1], ms_per_step: [ms, one per size], seconds, free_bytes[, head_ms: [ms...]]"
            "[, bandwidth: bytes/s > 0]}")
    if not isinstance(value, dict):
        raise bad(want)
    rows, ms = value.get("rows"), value.get("ms_per_step")
    if not (isinstance(rows, list) and isinstance(ms, list) and rows and len(rows) == len(ms) <= MAX_RECENT_MB
            and all(type(r) is int and r >= 1 for r in rows)
            and all(not isinstance(m, bool) and isinstance(m, (int, float)) and math.isfinite(m) and m > 0 for m in ms)
            and type(value.get("free_bytes")) is int and value["free_bytes"] >= 0
            and (value.get("head_ms") is None or (isinstance(value["head_ms"], list) and len(value["head_ms"]) == len(rows)
                                                  and all(isinstance(h, (int, float)) and not isinstance(h, bool)
                                                          and math.isfinite(h) and h >= 0 for h in value["head_ms"])))
            and (value.get("bandwidth") is None or (not isinstance(value["bandwidth"], bool)
                                                    and isinstance(value["bandwidth"], (int, float))
                                                    and math.isfinite(value["bandwidth"]) and value["bandwidth"] > 0))):
        raise bad(want)
    return value
