"""Turning generated token ids into streamed text: UTF-8-safe deltas, stop strings, held-back text.

Text that might be the beginning of a stop string is held back until it is known not to be one, so a client
never sees a stop string (or half of one). The final text equals what one decode of all tokens gives, cut at
the first stop string."""

from __future__ import annotations

from dataclasses import dataclass

from shared.text.tokenizer import GgufTokenizer, IncrementalDetokenizer


@dataclass
class StreamStep:
    text: str  # safe to show now (may be empty while text is held back)
    stopped: bool  # a stop string was found; nothing after it is ever shown


class TextStream:
    def __init__(self, tokenizer: GgufTokenizer, stop: list[str] | None = None):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.held = ""  # decoded but not yet shown: could begin a stop string
        self.shown: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (the earliest one found)

    def _emit(self, new_text: str, final: bool) -> StreamStep:
        buf = self.held + new_text
        cut, first = min(((i, s) for s in self.stop if (i := buf.find(s)) >= 0), default=(-1, None))
        if cut >= 0:
            self.held, self.stopped, self.stop_string = "", True, first
            return self._show(buf[:cut], True)
        keep = 0 if final else self._longest_stop_prefix_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return self._show(buf[: len(buf) - keep], False)

    def _show(self, text: str, stopped: bool) -> StreamStep:
        self.shown.append(text)
        return StreamStep(text, stopped)

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, token_id: int) -> StreamStep:
        if self.stopped:
            return StreamStep("", True)
        return self._emit(self.detok.push(token_id), final=False)

    def finish(self) -> str:
        """End of generation: release what was held back (no stop string completed)."""
        if self.stopped:
            return ""
        return self._emit(self.detok.flush(), final=True).text

    @property
    def text(self) -> str:
        return "".join(self.shown)
