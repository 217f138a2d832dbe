"""The output processor: turns what the scheduler reports for one request (RequestOutput) into the events a client
sees. It owns detokenizing (UTF-8-safe deltas), stop strings (text that could begin one is held back, a completed
one is never shown), usage, timings and the trace JSON. The scheduler never touches text.

Events are typed (TokenEvent, DoneEvent, ErrorEvent), made once here; the websocket sends each one's to_json() (plus
the client's id for the stream) and the OpenAI handlers turn them into chunks. Their JSON:
  {"type": "token", "index", "text", "token_id", "logprob"}    text may be "" while text is held back
    with logprobs also "token_text" (the token's own text), with top_logprobs k also "top_logprobs":
    [{"token_id", "text", "logprob"}] x k, most likely first
  {"type": "done", "finish_reason", "usage", "timings"[, "stop_string"][, "trace"]}
  {"type": "error", "code", "message"}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from services.gateway.engine.request import Request, RequestOutput
from shared.batch.sampling import TopLogprobs
from shared.runtime.trace import HookCapture, TraceRecorder
from shared.text.streaming import TextStream
from shared.text.tokenizer import GgufTokenizer


@dataclass(frozen=True)
class TokenEvent:
    """One generated token's text (index: its place in the answer; text "" while held back for a stop string; a
    token_id of None: held-back text released at the end)."""

    index: int
    text: str
    token_id: int | None
    logprob: float | None
    token_text: str | None = None  # the token's own text, when logprobs were asked
    top_logprobs: tuple[dict, ...] | None = None  # ({"token_id", "text", "logprob"}, ...), most likely first
    type: ClassVar[str] = "token"

    def to_json(self) -> dict:
        out = {"type": self.type, "index": self.index, "text": self.text, "token_id": self.token_id,
               "logprob": self.logprob}
        if self.token_text is not None:
            out["token_text"] = self.token_text
        if self.top_logprobs is not None:
            out["top_logprobs"] = list(self.top_logprobs)
        return out


@dataclass(frozen=True)
class Usage:
    """One request's token counts, made once here from the engine's request (`of`); each API surface writes them in
    its own names (OpenAI's below, as the websocket and chat/completions show them; Messages' and Responses' in
    their modules). cached_tokens: prompt tokens the prefix cache supplied (<= prompt_tokens). The prediction's
    counts only for a request that sent one."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    accepted_prediction_tokens: int | None = None  # drafted tokens of the prediction that stood ...
    rejected_prediction_tokens: int | None = None  # ... and that did not

    @classmethod
    def of(cls, seq: Request, completion_tokens: int) -> Usage:
        predicted = seq.prediction_ids is not None
        return cls(len(seq.prompt_ids), seq.cached_tokens, completion_tokens,
                   seq.drafts.prediction_stood if predicted else None,
                   seq.drafts.prediction_rejected if predicted else None)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict:
        """OpenAI's usage object."""
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.accepted_prediction_tokens is not None:
            out["completion_tokens_details"] = {"accepted_prediction_tokens": self.accepted_prediction_tokens,
                                                "rejected_prediction_tokens": self.rejected_prediction_tokens}
        return out


@dataclass(frozen=True)
class DoneEvent:
    """The answer ended: why, its usage and timings (the stop string that ended it, if one did; its trace, when it
    asked for one)."""

    finish_reason: str
    usage: Usage
    timings: dict
    trace: dict | None = None
    stop_string: str | None = None
    type: ClassVar[str] = "done"

    def to_json(self) -> dict:
        out = {"type": self.type, "finish_reason": self.finish_reason, "usage": self.usage.to_json(),
               "timings": self.timings}
        for key in ("stop_string", "trace"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed (code: a finish reason such as timeout or error, or a refusal's code)."""

    code: str
    message: str
    type: ClassVar[str] = "error"

    def to_json(self) -> dict:
        return {"type": self.type, "code": self.code, "message": self.message}


ClientEvent = Union[TokenEvent, DoneEvent, ErrorEvent]
END_EVENTS = (DoneEvent, ErrorEvent)  # a request's events end with exactly one of these


def _ms(a: float | None, b: float | None) -> float | None:
    return round((b - a) * 1000, 2) if a is not None and b is not None else None


def timings(req: Request) -> dict:
    n, t = len(req.output_ids), req.times
    per_token = _ms(t.first_token, t.last_token) / (n - 1) if n > 1 and t.last_token else None
    return {"queued_ms": _ms(t.arrival, t.admitted), "ttft_ms": _ms(t.arrival, t.first_token),
            "per_token_ms": per_token and round(per_token, 2), "total_ms": _ms(t.arrival, t.last_token)}


class OutputProcessor:
    """One request's outputs -> client events. `stop_string_hit` turns true on the token that completes a stop
    string; the caller then ends the sequence (Engine.finish(seq, "stop")), whose final RequestOutput brings the
    done event. Tokens the scheduler reports after that are counted nowhere and shown never."""

    def __init__(self, seq: Request, tokenizer: GgufTokenizer, stop: list[str] | None = None):
        self.seq = seq
        self.tokenizer = tokenizer
        self.stream = TextStream(tokenizer, stop)
        self.completion_tokens = 0

    @property
    def stop_string_hit(self) -> bool:
        return self.stream.stopped

    def process(self, out: RequestOutput) -> list[ClientEvent]:
        events: list[ClientEvent] = []
        if out.token is not None and not self.stream.stopped:
            self.completion_tokens += 1
            if out.finish_reason != "stop":  # a stop id (EOS) ends the text; it is not part of it
                step = self.stream.push(out.token)
                events.append(self._token(step.text, out.token, out.logprob, out.top_logprobs))
        if out.finish_reason is None:
            return events
        if out.error is not None:
            events.append(ErrorEvent(out.code or out.finish_reason, out.error))
            return events
        tail = self.stream.finish()  # text held back for a stop string that never completed
        if tail:
            events.append(self._token(tail, None, None))
        events.append(self._done("stop" if self.stream.stopped else out.finish_reason))  # a stop string wins
        return events

    def _token(self, text: str, token_id: int | None, logprob: float | None,
               top: TopLogprobs | None = None) -> TokenEvent:
        alternatives = None if top is None else tuple({"token_id": t, "text": self._own_text(t), "logprob": lp}
                                                      for t, lp in top)
        return TokenEvent(self.completion_tokens - 1, text, token_id, logprob,
                          self._own_text(token_id) if logprob is not None else None, alternatives)

    def _own_text(self, token_id: int) -> str:
        """One token's text by itself (not a UTF-8-safe delta: a token holding part of a character decodes to
        U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special=False)

    def _done(self, reason: str) -> DoneEvent:
        seq = self.seq
        trace = None
        if seq.capture is not None:
            captures = [HookCapture.from_wire(c) for c in seq.capture.captures]
            trace = TraceRecorder(captures, seq.output_ids, len(seq.prompt_ids)).to_json(seq.prompt_ids)
            # over its budget: the captures stop at some step; say so rather than look like a complete trace
            trace["truncated"] = seq.capture.truncated
        return DoneEvent(reason, Usage.of(seq, self.completion_tokens), timings(seq), trace,
                         self.stream.stop_string)
