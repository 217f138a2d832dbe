"""Wire format between gateway and stages: a ZMQ multipart message.

frame 0: msgpack header {"v": version, "kind": ..., kind-specific fields, "tensors": [{name, dtype, shape, frame}]}
frame 1..: one raw buffer per tensor, sent and received without copies (bf16 included: it travels as raw bytes).

Every field is validated before use; a bad message raises ProtocolError with a counted `reason`. Never pickle.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import torch

from shared.batch.sampling import (
    MAX_TOP_LOGPROBS,
    WIRE_FIELDS,
    LogitInputs,
    SamplingParams,
    TopLogprobs,
    one_position_a_step,
)
from shared.batch.steps import MAX_DECODE_TOKENS, Decode, InferenceStep, Prefill
from shared.errors import ERROR_CODES, BadBatch

PROTOCOL_VERSION = 9  # 2: BatchError carries a machine-readable code; 3: cached prefixes (prefill "attach", release "keep");
# 4: per-step logit inputs (grammar mask, penalties' history), penalty and top_logprobs sampling fields, the
# result's top alternatives ("top"); 5: decode steps of several positions ("n"), the result's per-sequence "counts";
# 6: the live re-split ("resplit" phases and the "kv" parcels of moved layers' K/V)
# 7: membership phases ("load", "accept", "route": a re-split to another number of stages, the
# resplit's "members" and "gateway": each place's process, layers, address and CURVE key)
# 8: replicas of a stage: a forward's "route" (the instance ids after this hop, only in a mesh with replicas) and the
# resplit phase "hops" (each range's instances, "hops": what a stage may send to)
# 9: the membership phase "give" (a stage that gave layers to a joiner sends their K/V as "kv" parcels, which may
# carry "kept": a cached prefix, kept as one where it lands)
MAX_HEADER_BYTES = 8 << 20  # room for a traced request's captures (each stage adds at most 1 MiB)
MAX_TENSOR_BYTES = 256 << 20  # per message; also the ZMQ MAXMSGSIZE of every receiving socket
MAX_SEQS_PER_BATCH = 4096
MAX_TOKENS_PER_BATCH = 1 << 16
MAX_SEQ_ID_LEN = 128
MAX_IN_FLIGHT = 1 << 16  # a forward header's "inflight" (micro-batches in flight in the pipeline)
MAX_STAGES = 256  # stages of one pipeline a re-split names
MAX_LAYERS = 1 << 12  # a layer index a re-split or a K/V parcel names
MAX_REPORT_CHARS = 1000  # a re-split's error text
# W3C trace context (https://www.w3.org/TR/trace-context/#traceparent-header), version 00: trace id, span id (neither
# all zeros), flags. Present in a header only when the gateway runs with --otlp-endpoint (shared.observe.otlp).
TRACEPARENT_LEN = 55
TRACEPARENT_RE = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")

# The only dtypes that may cross the wire (name -> torch dtype).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
    "int32": torch.int32,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}

CAPTURE_KEYS = frozenset({"stage", "layer", "point", "position", "shape", "summary", "data"})  # shared.runtime.trace.HookCapture

REJECT_REASONS = ("msgpack", "oversize", "version", "kind", "schema", "dtype", "shape", "length", "frames",
                  "auth", "handshake")  # auth: a CURVE handshake with a key other than the upstream peer's; handshake:
# one that failed before that (another server key, plaintext against CURVE) -- both in shared.wire.transport

# torch.frombuffer warns on read-only buffers; received frames are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class ProtocolError(Exception):
    """A received message refused before use; `reason` (one of REJECT_REASONS) is the label it is counted under."""

    def __init__(self, reason: str, message: str):
        if reason not in REJECT_REASONS:  # a caller's bug, not a peer's: checked under python -O too
            raise ValueError(f"reject reason {reason!r} is not one of {', '.join(REJECT_REASONS)}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason


# ---- messages -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SeqEntry:
    """One sequence's work in a micro-batch, carried through every stage (the last one samples); also what a
    StageRuntime runs (it reads seq_id and step), so the wire and the runtime share one type."""

    seq_id: str
    step: InferenceStep
    sampling: SamplingParams = SamplingParams()
    traceparent: str | None = None  # W3C traceparent of this sequence's request span (None: tracing off)
    logit_inputs: LogitInputs | None = None  # penalties' history and grammar mask for this step's sample

    @property
    def sample_positions(self) -> list[int]:
        """The positions the sampled tokens will occupy (the step's `samples` last rows' next positions)."""
        end = self.step.start_position + self.step.num_tokens
        return list(range(end - self.step.samples + 1, end + 1))


def sampling_rows(entries: list[SeqEntry]) -> tuple[list[SeqEntry], list[int], list[SamplingParams], list[int],
                                                   list[LogitInputs | None]]:
    """What the last stage samples for a micro-batch, one row per sampled token in batch order: (the entries that
    sample, each one's count of rows, then per row its params, position and logit inputs). A step of several rows
    carries no logit inputs (one_position_a_step: a grammar mask or a penalties' history holds for one position)."""
    producing = [e for e in entries if e.step.samples]
    counts, params, positions, inputs = [], [], [], []
    for e in producing:
        n = e.step.samples
        constrained = e.logit_inputs is not None and e.logit_inputs.allowed is not None
        if n > 1 and one_position_a_step(e.sampling, constrained):
            raise BadBatch(f"sequence {e.seq_id!r}: a {n}-token decode step of a sequence with a grammar mask or "
                           "penalties (they hold for one position); send one-token steps for it")
        counts.append(n)
        params += [e.sampling] * n
        positions += e.sample_positions
        inputs += [e.logit_inputs] * n
    return producing, counts, params, positions, inputs


@dataclass
class ForwardBatch:
    mb_id: int
    seqs: list[SeqEntry]
    tokens: torch.Tensor | None = None  # [N] int64, into the first stage
    hidden: torch.Tensor | None = None  # [N, D], between stages
    trace: dict | None = None  # on-demand capture request (None: off)
    captures: list = field(default_factory=list)  # accumulated captures travelling to the client
    hop_s: float | None = None  # set on receipt: receive time - the sender's send time (header "sent", wall clock)
    traceparent: str | None = None  # W3C traceparent of the gateway's span for this micro-batch (None: tracing off)
    received: float | None = None  # set on receipt: wall-clock time.time() of decoding
    # micro-batches the gateway had in flight in this pipeline when it sent this one, this one included: 1 means the
    # other stages are idle, so a stage sharing a host with them may use their cores too (StageConfig.threads_alone)
    in_flight: int = 1
    # in a mesh whose ranges have replicas (several stage processes for one range): the instance ids (their
    # incarnations) this micro-batch goes through after the stage that receives it, one per remaining range, in order;
    # the receiver sends to route[0] with route[1:]. None in a mesh without replicas (the header carries none).
    route: tuple[str, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.step.num_tokens for s in self.seqs)


@dataclass
class ReleaseSeqs:
    seq_ids: list[str]
    everything: bool = False  # also release every other sequence the stage holds (a gateway starting afresh)
    keep: list[str] = field(default_factory=list)  # finished sequences whose slots stay, as cached prefixes (no lease)
    spare: list[str] = field(default_factory=list)  # with everything: sequences that stay live (a restarted gateway
    # re-adopts them where they are, services/gateway/frontend/frontend.py Gateway.readopt)


Sample = tuple[int, "float | None", "TopLogprobs | None"]  # one sampled token: (id, logprob, top alternatives)


@dataclass
class BatchResult:
    """Last stage -> client: the sampled tokens of each sequence that produced any (in batch order), counts[i] of
    them for seq_ids[i] (1 each unless a step carried several positions); tokens, logprobs and top are flat, one
    entry per sampled token."""

    mb_id: int
    seq_ids: list[str]
    tokens: list[int]
    logprobs: list[float | None]
    captures: list = field(default_factory=list)
    hop_s: float | None = None  # set on receipt, as ForwardBatch.hop_s
    top: list[TopLogprobs | None] = field(default_factory=list)  # per token: its top_logprobs alternatives
    counts: list[int] = field(default_factory=list)  # per sequence: its sampled tokens ([] = one each)

    def __post_init__(self):
        self.top = self.top or [None] * len(self.tokens)
        self.counts = self.counts or [1] * len(self.seq_ids)

    def by_sequence(self) -> dict[str, list[Sample]]:
        """seq_id -> its sampled tokens in position order."""
        out, i = {}, 0
        for seq_id, n in zip(self.seq_ids, self.counts):
            out[seq_id] = list(zip(self.tokens[i:i + n], self.logprobs[i:i + n], self.top[i:i + n]))
            i += n
        return out


@dataclass
class BatchError:
    """A micro-batch failed on `stage`. `code` (one of shared.errors.ERROR_CODES) says what kind of failure it was,
    so the receiver never interprets the human-readable message."""

    mb_id: int
    stage: str
    code: str
    message: str
    seq_ids: list[str] = field(default_factory=list)


@dataclass
class ReleaseDone:
    seq_ids: list[str]


RESPLIT_PHASES = ("prepare", "move", "commit", "abort", "reroute", "probe", "hops")
ROUTED_PHASES = ("reroute", "probe")  # the phases that carry a `route` (and only they)


# a change of the mesh's membership (services/gateway/engine/membership.py, services/stage/membership.py): `members`
# names each place of the pipeline after it (its process by incarnation, its layers, address and public key), so the
# stages may be more or fewer than before. load: a stage whose layers change loads them beside the ones it serves;
# accept: each stage's receiver lets in its upstream after the change as well as its upstream now; route: each stage
# serves its new layers (the layers it keeps keep their K/V; a stage that gained layers holds none of them), sends to
# the next member and accepts only its upstream member (and the one before that, so a member that vanishes can be
# routed around), then passes this on; give (new route, micro-batches still held): a stage that gave layers to a
# member holding nothing yet (a joiner) sends that member their K/V (KVParcel, to: its place) ahead of this message
# -- where no K/V was given (a leave, a loss) the gateway replays the running requests instead
MEMBERSHIP_PHASES = ("load", "accept", "route", "give")
MAX_KEY_CHARS = 40  # a CURVE public key in Z85
MAX_INSTANCE_CHARS = 64  # an instance id (a stage process's incarnation) a route or a hop names
MAX_HOPS = 1024  # instances a "hops" phase names


@dataclass
class Resplit:
    """The gateway's live re-split, one phase at a time (shared/runtime/resplit.py): it travels the pipeline like a
    micro-batch, each stage doing its part and passing it on, and comes back to the gateway. `old`: each stage's
    layers now, (start, stop) in pipeline order (a stage finds itself there); `new`: each one's layers after.
    prepare: each stage whose layers change loads the new range from its own copy of the file; move: each stage
    sends the K/V of the layers it gives away (KVParcel) ahead of this message; commit: each stage takes its new
    layers and K/V and serves with them; abort: a stage drops what it prepared; reroute (old == new, `route` set):
    the stage before place route[0] sends to the address route[1] from now on (a stage process there replaces the
    one serving that place: Engine.replace_stage), and that new stage to route[2] (the next place's address, None
    for the last place), each before it passes this on along the new route; probe (`route` set as for reroute):
    the same two hops tried on sockets of their own while the mesh serves on -- the stage before the place (or the
    gateway) hands this message to route[1] only once a CURVE handshake with the place's public key completed there,
    proof that the process holds the place's secret key, and that process hands it to route[2] the same way; no
    stage's route changes. `error`: the first stage that
    refused, and why (the stages after it do nothing but pass it on). `report`: one map per stage that did its part
    (numbers only, for the gateway's log)."""

    rid: int
    phase: str
    old: list[tuple[int, int]]
    new: list[tuple[int, int]]
    error: str | None = None
    report: list[dict] = field(default_factory=list)
    # reroute: (the place in the pipeline, its new stage's address, the address that stage sends to: None for the
    # last place, which keeps the result address it was started with)
    route: tuple[int, str, str | None] | None = None
    # membership phases: [{"incarnation", "layers": [a, b], "address", "key": Z85 or None}] in pipeline order
    members: list[dict] | None = None
    # membership phases: the gateway's ends {"address": its result address, "key": its result socket's public key,
    # "sends": the public key it sends into the first stage with} (keys None in plaintext)
    gateway: dict | None = None
    # hops (old == new): every instance of every range but the first, [{"id", "layers": [a, b], "address", "key"}];
    # a stage serving a range that ends at a sends to those whose range starts at a, by the route's id, from now on
    # (and to no other: an instance it held and this does not name is dropped)
    hops: list[dict] | None = None


@dataclass
class KVParcel:
    """K/V of one sequence's moved layers [start, stop), positions [0, length), on its way to stage `to` of re-split
    `rid` (a parcel for an upstream stage travels on around the ring through the gateway). k, v: [layers, kv_heads,
    length, head_dim] in the KV cache's dtype. `kept`: the sequence is a cached prefix where it comes from (a
    membership change's parcel; the receiver keeps it as one)."""

    rid: int
    to: int
    seq_id: str
    start: int
    stop: int
    k: torch.Tensor
    v: torch.Tensor
    kept: bool = False

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


Message = Union[ForwardBatch, ReleaseSeqs, BatchResult, BatchError, ReleaseDone, Resplit, KVParcel]


# ---- encoding -------------------------------------------------------------------------------------------------

def _step_to_wire(step: InferenceStep) -> dict:
    if isinstance(step, Prefill):
        wire = {"t": "prefill", "n": step.chunk_tokens, "start": step.chunk_start_position,
                "total": step.total_prompt_tokens, "final": step.is_final_chunk}
        if step.attach is not None:
            wire["attach"] = step.attach
        return wire
    wire = {"t": "decode", "pos": step.current_position}
    if step.num_tokens != 1:
        wire["n"] = step.num_tokens
    return wire


def _seq_to_wire(s: SeqEntry) -> dict:
    d = {"id": s.seq_id, "step": _step_to_wire(s.step), "sampling": s.sampling.to_wire()}
    if s.traceparent is not None:
        d["tp"] = s.traceparent
    if s.logit_inputs is not None and not s.logit_inputs.empty:
        d["li"] = s.logit_inputs.to_wire()
    return d


def _tensor_frame(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, shared with the tensor (no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def encode(msg: Message) -> list:
    """Message -> ZMQ frames: [header, *tensor buffers]. Send with copy=False."""
    tensors: list[tuple[str, torch.Tensor]] = []
    if isinstance(msg, ForwardBatch):
        header: dict[str, Any] = {
            "kind": "forward", "mb": msg.mb_id,
            "seqs": [_seq_to_wire(s) for s in msg.seqs],
        }
        if msg.traceparent is not None:
            header["tp"] = msg.traceparent
        if msg.in_flight != 1:
            header["inflight"] = msg.in_flight
        if msg.route is not None:
            header["route"] = list(msg.route)
        if msg.trace is not None:
            header["trace"] = msg.trace
            header["captures"] = msg.captures
        for name in ("tokens", "hidden"):
            t = getattr(msg, name)
            if t is not None:
                tensors.append((name, t))
    elif isinstance(msg, ReleaseSeqs):
        header = {"kind": "release", "seq_ids": list(msg.seq_ids)}
        if msg.everything:
            header["all"] = True
        if msg.keep:
            header["keep"] = list(msg.keep)
        if msg.spare:
            header["spare"] = list(msg.spare)
    elif isinstance(msg, ReleaseDone):
        header = {"kind": "released", "seq_ids": list(msg.seq_ids)}
    elif isinstance(msg, BatchResult):
        header = {"kind": "result", "mb": msg.mb_id, "seq_ids": msg.seq_ids, "tokens": msg.tokens,
                  "logprobs": msg.logprobs, "captures": msg.captures}
        if any(t is not None for t in msg.top):  # only when some sequence asked for alternatives
            header["top"] = msg.top  # [[id, logprob], ...] or null per token
        if any(n != 1 for n in msg.counts):  # only when some step sampled several positions
            header["counts"] = msg.counts
    elif isinstance(msg, BatchError):
        header = {"kind": "error", "mb": msg.mb_id, "stage": msg.stage, "code": msg.code, "message": msg.message,
                  "seq_ids": msg.seq_ids}
    elif isinstance(msg, Resplit):
        header = {"kind": "resplit", "rid": msg.rid, "phase": msg.phase, "old": [list(r) for r in msg.old],
                  "new": [list(r) for r in msg.new], "report": msg.report}
        if msg.error is not None:
            header["error"] = msg.error
        if msg.route is not None:
            header["route"] = list(msg.route)
        if msg.members is not None:
            header["members"], header["gateway"] = msg.members, msg.gateway
        if msg.hops is not None:
            header["hops"] = msg.hops
    elif isinstance(msg, KVParcel):
        header = {"kind": "kv", "rid": msg.rid, "to": msg.to, "seq": msg.seq_id, "start": msg.start, "stop": msg.stop}
        if msg.kept:
            header["kept"] = True
        tensors += [("k", msg.k), ("v", msg.v)]
    else:
        raise TypeError(f"cannot encode {type(msg).__name__}")
    header["v"] = PROTOCOL_VERSION
    if isinstance(msg, (ForwardBatch, BatchResult)):
        header["sent"] = time.time()  # the receiver's hop latency; exact on one host, clock skew across hosts
    frames: list = [None]
    descs = []
    for name, t in tensors:
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, not allowed on the wire")
        descs.append({"name": name, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "frame": len(frames)})
        frames.append(_tensor_frame(t))
    header["tensors"] = descs
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


# ---- decoding (validation first) ---------------------------------------------------------------------------

def _buffer(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _need(cond: bool, reason: str, message: str | Callable[[], str]) -> None:
    """Raise ProtocolError(reason, message) unless cond; a message that formats values comes as a lambda, formatted
    only when it is raised (decode runs for every micro-batch at every hop)."""
    if not cond:
        raise ProtocolError(reason, message() if callable(message) else message)


def _int(d: dict, key: str, lo: int = 0, hi: int = 2**62) -> int:
    v = d.get(key)
    _need(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, "schema",
          lambda: f"field {key!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _str_list(d: dict, key: str) -> list[str]:
    v = d.get(key)
    _need(isinstance(v, list) and len(v) <= MAX_SEQS_PER_BATCH
          and all(isinstance(s, str) and 0 < len(s) <= MAX_SEQ_ID_LEN for s in v), "schema",
          lambda: f"field {key!r} must be a list of sequence ids (strings of 1..{MAX_SEQ_ID_LEN} chars)")
    return v


def _step_from_wire(d: Any) -> InferenceStep:
    _need(isinstance(d, dict), "schema", "step must be a map")
    try:
        if d.get("t") == "prefill":
            final = d.get("final")
            _need(isinstance(final, bool), "schema", "prefill.final must be a boolean")
            attach = d.get("attach")
            _need(attach is None or (isinstance(attach, str) and 0 < len(attach) <= MAX_SEQ_ID_LEN), "schema",
                  lambda: f"prefill.attach must be a sequence id (a string of 1..{MAX_SEQ_ID_LEN} chars)")
            return Prefill(_int(d, "n", 1, MAX_TOKENS_PER_BATCH), _int(d, "start"), _int(d, "total", 1), final, attach)
        if d.get("t") == "decode":
            return Decode(_int(d, "pos", 1), _int(d, "n", 1, MAX_DECODE_TOKENS) if "n" in d else 1)
    except ValueError as e:
        raise ProtocolError("schema", f"invalid step: {e}") from None
    raise ProtocolError("schema", f"step type {d.get('t')!r} is neither 'prefill' nor 'decode'")


# Validated sampling parameters by their wire form: a sequence carries the same ones at every step and hop, and
# building them (SamplingParams' checks) was a tenth of decoding a one-sequence micro-batch. Keyed by each value's
# type too (1, 1.0 and True are equal keys otherwise); a form with a list (logit_bias) is built every time. Bounded:
# emptied when full, so a peer sending ever new values costs only the rebuilds.
_SAMPLING_MEMO: dict[tuple, SamplingParams] = {}
SAMPLING_MEMO_SIZE = 4096


def _sampling_from_wire(d: Any) -> SamplingParams:
    _need(isinstance(d, dict) and WIRE_FIELDS.issuperset(d), "schema",
          lambda: f"sampling must be a map with keys from {sorted(WIRE_FIELDS)}")
    key = tuple((k, type(v), v) for k, v in d.items())
    try:
        return _SAMPLING_MEMO[key]
    except TypeError:  # an unhashable value (a list): not memoized
        key = None
    except KeyError:
        pass
    try:
        params = SamplingParams(**d)
    except (TypeError, ValueError) as e:
        raise ProtocolError("schema", f"invalid sampling parameters: {e}") from None
    if key is not None:
        if len(_SAMPLING_MEMO) >= SAMPLING_MEMO_SIZE:
            _SAMPLING_MEMO.clear()
        _SAMPLING_MEMO[key] = params
    return params


def _logit_inputs_from_wire(s: dict) -> LogitInputs | None:
    if "li" not in s:
        return None
    try:
        return LogitInputs.from_wire(s["li"])
    except (TypeError, ValueError) as e:
        raise ProtocolError("schema", f"invalid logit inputs: {e}") from None


def _top(header: dict, n: int) -> list[TopLogprobs | None]:
    """The result's optional "top": per token null or up to MAX_TOP_LOGPROBS [token id, logprob] pairs."""
    if "top" not in header:
        return [None] * n
    top = header["top"]
    _need(isinstance(top, list) and len(top) == n and all(
        t is None or (isinstance(t, list) and len(t) <= MAX_TOP_LOGPROBS and all(
            isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
            and isinstance(pair[1], float) for pair in t)) for t in top), "schema",
          lambda: f"result top must be one entry per token: null or at most {MAX_TOP_LOGPROBS} [token id, logprob] pairs")
    return [t if t is None else [(i, lp) for i, lp in t] for t in top]


def _captures(header: dict) -> list:
    caps = header.get("captures", [])
    _need(isinstance(caps, list) and all(isinstance(c, dict) and set(c) == CAPTURE_KEYS for c in caps), "schema",
          lambda: f"captures must be a list of maps with keys {sorted(CAPTURE_KEYS)}")
    return caps


def _tensors(header: dict, frames: list, names: tuple[str, ...] = ("tokens", "hidden")) -> dict[str, torch.Tensor]:
    descs = header.get("tensors")
    _need(isinstance(descs, list), "schema", "field 'tensors' must be a list")
    _need(len(frames) == 1 + len(descs), "frames",
          lambda: f"{len(frames) - 1} data frames for {len(descs)} tensor descriptors")
    out: dict[str, torch.Tensor] = {}
    used: set[int] = set()
    total = 0
    for d in descs:
        name, tensor = _tensor(d, frames, used, out, names)
        total += tensor.nbytes
        _need(total <= MAX_TENSOR_BYTES, "oversize", lambda: f"tensors exceed {MAX_TENSOR_BYTES} bytes")
        out[name] = tensor
    return out


def _tensor(d: Any, frames: list, used: set[int], seen: dict, names: tuple[str, ...]) -> tuple[str, torch.Tensor]:
    """One tensor descriptor of the header -> (its name, the tensor over its frame's bytes); marks its frame used."""
    _need(isinstance(d, dict) and isinstance(d.get("name"), str), "schema", "tensor descriptor needs a name")
    name = d["name"]
    _need(name in names and name not in seen, "schema", lambda: f"unexpected or repeated tensor {name!r}")
    dtype = d.get("dtype")
    _need(dtype in WIRE_DTYPES, "dtype", lambda: f"tensor {name} dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    shape = d.get("shape")
    _need(type(shape) is list and 1 <= len(shape) <= 4  # type(s) is int: no bool, no int subclass
          and all(type(s) is int and 0 <= s <= MAX_TENSOR_BYTES for s in shape),
          "shape", lambda: f"tensor {name} shape {shape!r} must be 1..4 non-negative integers")
    index = d.get("frame")
    _need(isinstance(index, int) and 1 <= index < len(frames) and index not in used, "frames",
          lambda: f"tensor {name} frame index {index!r} is out of range or reused")
    used.add(index)
    dt = WIRE_DTYPES[dtype]
    nbytes = math.prod(shape) * dt.itemsize
    buf = _buffer(frames[index])
    _need(nbytes == buf.nbytes, "length",
          lambda: f"tensor {name}: shape {shape} x {dtype} is {nbytes} bytes, frame has {buf.nbytes}")
    return name, torch.frombuffer(buf, dtype=dt).view(*shape) if nbytes else torch.empty(shape, dtype=dt)


def _hop_s(header: dict, now: float | None = None) -> float | None:
    """Seconds from the sender's stamp on the header to `now` (default: time.time()); absent stamp gives None."""
    sent = header.get("sent")
    if sent is None:
        return None
    _need(isinstance(sent, float) and math.isfinite(sent), "schema", "field 'sent' must be a finite float")
    return (time.time() if now is None else now) - sent


def _traceparent(d: dict) -> str | None:
    """The optional "tp" field of a map: None when absent, else a W3C traceparent (version 00, lowercase hex)."""
    tp = d.get("tp")
    if tp is None:
        return None
    _need(isinstance(tp, str) and len(tp) == TRACEPARENT_LEN and TRACEPARENT_RE.fullmatch(tp) is not None, "schema",
          "field 'tp' must be a W3C traceparent 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>")
    return tp


def decode(frames: list) -> Message:
    """ZMQ frames (bytes or zmq.Frame) -> Message. Raises ProtocolError naming the reason and the field."""
    _need(len(frames) >= 1, "frames", "empty message")
    raw = _buffer(frames[0])
    _need(raw.nbytes <= MAX_HEADER_BYTES, "oversize", lambda: f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                                 max_str_len=MAX_HEADER_BYTES,
                                 max_bin_len=MAX_HEADER_BYTES, max_array_len=1 << 17, max_map_len=1 << 12,
                                 max_ext_len=0)
    except (ValueError, msgpack.UnpackException, UnicodeDecodeError, RecursionError) as e:  # ExtraData, FormatError, StackError...
        raise ProtocolError("msgpack", f"header is not valid msgpack ({type(e).__name__})") from None
    _need(isinstance(header, dict), "msgpack", "header is not a map")
    _need(header.get("v") == PROTOCOL_VERSION, "version", lambda: f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}")
    kind = header.get("kind")
    if kind == "forward":
        seqs_raw = header.get("seqs")
        _need(isinstance(seqs_raw, list) and 0 < len(seqs_raw) <= MAX_SEQS_PER_BATCH, "schema",
              lambda: f"field 'seqs' must be a list of 1..{MAX_SEQS_PER_BATCH} sequences")
        seqs = []
        for s in seqs_raw:
            _need(isinstance(s, dict), "schema", "each sequence must be a map")
            sid = s.get("id")
            _need(isinstance(sid, str) and 0 < len(sid) <= MAX_SEQ_ID_LEN, "schema", "sequence id must be a short string")
            seqs.append(SeqEntry(sid, _step_from_wire(s.get("step")), _sampling_from_wire(s.get("sampling", {})),
                                 _traceparent(s), _logit_inputs_from_wire(s)))
        _need(len({s.seq_id for s in seqs}) == len(seqs), "schema", "a sequence appears twice in one micro-batch")
        tensors = _tensors(header, frames)
        batch = ForwardBatch(_int(header, "mb"), seqs, tensors.get("tokens"), tensors.get("hidden"),
                             in_flight=_int(header, "inflight", 1, MAX_IN_FLIGHT) if "inflight" in header else 1,
                             route=_route(header))
        n = batch.num_tokens
        _need(n <= MAX_TOKENS_PER_BATCH, "oversize", lambda: f"{n} tokens exceed {MAX_TOKENS_PER_BATCH} per micro-batch")
        if batch.tokens is not None:
            _need(batch.tokens.dtype == torch.int64 and tuple(batch.tokens.shape) == (n,), "shape",
                  lambda: f"tokens must be int64 [{n}], got {batch.tokens.dtype} {list(batch.tokens.shape)}")
        if batch.hidden is not None:
            _need(batch.hidden.dim() == 2 and batch.hidden.shape[0] == n and batch.hidden.dtype.is_floating_point,
                  "shape", lambda: f"hidden must be floating [{n}, D], got {batch.hidden.dtype} {list(batch.hidden.shape)}")
        if "trace" in header:
            _need(isinstance(header["trace"], dict), "schema", "trace must be a map")
            batch.trace, batch.captures = header["trace"], _captures(header)
        batch.traceparent = _traceparent(header)
        batch.received = time.time()
        batch.hop_s = _hop_s(header, batch.received)
        return batch
    if kind in ("release", "released"):
        ids = _str_list(header, "seq_ids")
        if kind == "released":
            return ReleaseDone(ids)
        everything = header.get("all", False)
        _need(isinstance(everything, bool), "schema", "field 'all' must be a boolean")
        spare = _str_list(header, "spare") if "spare" in header else []
        _need(everything or not spare, "schema", "field 'spare' goes only with 'all' (what a release of all keeps)")
        return ReleaseSeqs(ids, everything, _str_list(header, "keep") if "keep" in header else [], spare)
    if kind == "result":
        ids = _str_list(header, "seq_ids")
        counts = header.get("counts", [1] * len(ids))
        _need(isinstance(counts, list) and len(counts) == len(ids)
              and all(type(n) is int and 1 <= n <= MAX_DECODE_TOKENS for n in counts), "schema",
              lambda: f"result counts must be one integer in 1..{MAX_DECODE_TOKENS} per sequence")
        toks, lps = header.get("tokens"), header.get("logprobs")
        _need(isinstance(toks, list) and all(type(t) is int for t in toks) and len(toks) == sum(counts), "schema",
              "result tokens must be one integer per sampled token (counts, one per sequence if absent)")
        _need(isinstance(lps, list) and len(lps) == len(toks), "schema", "result logprobs must be one entry per token")
        return BatchResult(_int(header, "mb"), ids, toks, lps, _captures(header), _hop_s(header),
                           _top(header, len(toks)), counts)
    if kind == "error":
        msg = header.get("message")
        _need(isinstance(msg, str) and isinstance(header.get("stage"), str), "schema", "error needs stage and message")
        _need(header.get("code") in ERROR_CODES, "schema", lambda: f"error code must be one of {sorted(ERROR_CODES)}")
        return BatchError(_int(header, "mb"), header["stage"], header["code"], msg, _str_list(header, "seq_ids"))
    if kind == "resplit":
        return _resplit(header)
    if kind == "kv":
        return _parcel(header, frames)
    raise ProtocolError("kind", f"message kind {kind!r} is not one of forward, release, released, result, error, "
                                "resplit, kv")


def _ranges(header: dict, key: str) -> list[tuple[int, int]]:
    """A re-split's "old" / "new": 1..MAX_STAGES [start, stop] pairs of layer indices with start < stop. (Whether
    they form a split the stages can move to is shared.files.layers.check_resplit's question, asked where the
    model's layer count is known.)"""
    v = header.get(key)
    _need(isinstance(v, list) and 0 < len(v) <= MAX_STAGES and all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] < r[1] <= MAX_LAYERS
        for r in v), "schema", lambda: f"field {key!r} must be 1..{MAX_STAGES} [start, stop] layer ranges")
    return [(a, b) for a, b in v]


def _resplit(header: dict) -> Resplit:
    phase = header.get("phase")
    phases = RESPLIT_PHASES + MEMBERSHIP_PHASES
    _need(phase in phases, "schema", lambda: f"resplit phase must be one of {', '.join(phases)}")
    old, new = _ranges(header, "old"), _ranges(header, "new")
    members = _members(header, new) if phase in MEMBERSHIP_PHASES else None
    _need(len(old) == len(new) or members is not None, "schema",
          "a resplit's old and new splits must name as many stages (but in a membership phase)")
    error = header.get("error")
    _need(error is None or (isinstance(error, str) and len(error) <= MAX_REPORT_CHARS), "schema",
          lambda: f"resplit error must be a string of at most {MAX_REPORT_CHARS} characters")
    report = header.get("report", [])
    _need(isinstance(report, list) and len(report) <= MAX_STAGES and all(
        isinstance(r, dict) and len(r) <= 16 and all(
            isinstance(k, str) and len(k) <= 32 and type(v) in (int, float) for k, v in r.items()) for r in report),
          "schema", lambda: f"resplit report must be at most {MAX_STAGES} maps of up to 16 numbers")
    route = header.get("route")
    _need((route is None) == (phase not in ROUTED_PHASES) and (route is None or (
        isinstance(route, list) and len(route) == 3 and type(route[0]) is int and 0 <= route[0] < len(old)
        and _is_address(route[1]) and (route[2] is None or _is_address(route[2])))), "schema",
          "a resplit's route (reroute and probe only) must be [a stage index of its split, a tcp:// or ipc:// address, "
          "another or null]")
    msg = Resplit(_int(header, "rid"), phase, old, new, error, report, None if route is None else tuple(route))
    if members is not None:
        msg.members, msg.gateway = members, _gateway_ends(header)
    _need((phase == "hops") == ("hops" in header) and (phase != "hops" or old == new), "schema",
          "a resplit's hops go with its hops phase (and only there), whose old and new split are the same")
    if phase == "hops":
        msg.hops = _hops(header)
    return msg


def _is_instance(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_INSTANCE_CHARS


def _route(header: dict) -> tuple[str, ...] | None:
    """A forward's optional "route": at most MAX_STAGES instance ids (None when absent: a mesh without replicas)."""
    if "route" not in header:
        return None
    route = header["route"]
    _need(isinstance(route, list) and len(route) <= MAX_STAGES and all(_is_instance(i) for i in route), "schema",
          lambda: f"a forward's route must be a list of at most {MAX_STAGES} instance ids (strings of 1.."
                  f"{MAX_INSTANCE_CHARS} characters)")
    return tuple(route)


def _hops(header: dict) -> list[dict]:
    """A hops phase's "hops": at most MAX_HOPS {id, layers, address, key}, ids distinct."""
    v = header.get("hops")
    _need(isinstance(v, list) and len(v) <= MAX_HOPS and all(
        isinstance(h, dict) and set(h) == {"id", "layers", "address", "key"} and _is_instance(h["id"])
        and isinstance(h["layers"], list) and len(h["layers"]) == 2 and all(type(x) is int for x in h["layers"])
        and 0 < h["layers"][0] < h["layers"][1] <= MAX_LAYERS and _is_address(h["address"]) and _is_key(h["key"])
        for h in v) and len({h["id"] for h in v}) == len(v), "schema",
          lambda: f"a resplit's hops must be at most {MAX_HOPS} {{id, layers, address, key}} with distinct ids, "
                  "each range after the first")
    return v


def _is_key(value) -> bool:
    return value is None or (isinstance(value, str) and len(value) == MAX_KEY_CHARS)


def _members(header: dict, new: list[tuple[int, int]]) -> list[dict]:
    """A membership phase's "members": one {incarnation, layers, address, key} per place of `new`, in its order."""
    v = header.get("members")
    _need(isinstance(v, list) and len(v) == len(new) and all(
        isinstance(m, dict) and set(m) == {"incarnation", "layers", "address", "key"}
        and isinstance(m["incarnation"], str) and 0 < len(m["incarnation"]) <= 64 and m["layers"] == list(r)
        and _is_address(m["address"]) and _is_key(m["key"]) for m, r in zip(v, new)), "schema",
          "a membership resplit's members must be one {incarnation, layers, address, key} per place of its new split")
    return v


def _gateway_ends(header: dict) -> dict:
    g = header.get("gateway")
    _need(isinstance(g, dict) and set(g) == {"address", "key", "sends"} and _is_address(g["address"])
          and _is_key(g["key"]) and _is_key(g["sends"]), "schema",
          "a membership resplit's gateway must be {address, key, sends}")
    return g


def _is_address(value) -> bool:
    """A ZeroMQ address a stage may be told to send to: tcp:// or ipc://, at most 256 characters."""
    return isinstance(value, str) and len(value) <= 256 and value.startswith(("tcp://", "ipc://"))


def _parcel(header: dict, frames: list) -> KVParcel:
    seq = header.get("seq")
    _need(isinstance(seq, str) and 0 < len(seq) <= MAX_SEQ_ID_LEN, "schema", "kv parcel needs a sequence id")
    start, stop = _int(header, "start", 0, MAX_LAYERS), _int(header, "stop", 1, MAX_LAYERS)
    _need(start < stop, "schema", "kv parcel's layers must be start < stop")
    tensors = _tensors(header, frames, names=("k", "v"))
    k, v = tensors.get("k"), tensors.get("v")
    _need(k is not None and v is not None, "schema", "kv parcel needs tensors k and v")
    _need(k.dim() == 4 and k.shape == v.shape and k.dtype == v.dtype and k.dtype.is_floating_point
          and k.shape[0] == stop - start, "shape",
          lambda: f"kv parcel's k and v must both be floating [{stop - start} layers, kv_heads, length, head_dim], "
                  f"got {k.dtype} {list(k.shape)} and {v.dtype} {list(v.shape)}")
    kept = header.get("kept", False)
    _need(type(kept) is bool, "schema", "kv parcel's kept must be true or false")
    return KVParcel(_int(header, "rid"), _int(header, "to", 0, MAX_STAGES - 1), seq, start, stop, k, v, kept)
