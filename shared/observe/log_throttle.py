"""Throttled logging: at most one line per reason per interval, carrying how many events it stands for.

A hostile or broken peer can trigger the same warning thousands of times a second; the log must stay readable
and cheap. `LogThrottle.log(logger, level, reason, msg, *args)` emits the first event of a reason at once, then at
most one line per `interval_s` for that reason, suffixed with "(N similar in the last T s)". No tracebacks: the
caller passes the one-line cause."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Window:
    opened: float  # monotonic time the current window's line was emitted
    suppressed: int = 0  # events of this reason not logged since `opened`


@dataclass
class LogThrottle:
    interval_s: float = 10.0
    max_reasons: int = 256  # bounds memory when reasons are attacker-chosen: the oldest window is forgotten
    _windows: dict[str, _Window] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def should_log(self, reason: str, now: float | None = None) -> int | None:
        """None when this event is suppressed; else how many earlier events of `reason` were suppressed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            w = self._windows.get(reason)
            if w is not None and now - w.opened < self.interval_s:
                w.suppressed += 1
                return None
            suppressed = w.suppressed if w is not None else 0
            if w is None and len(self._windows) >= self.max_reasons:
                self._windows.pop(next(iter(self._windows)))
            self._windows[reason] = _Window(opened=now)
            return suppressed

    def log(self, logger: logging.Logger, level: int, reason: str, msg: str, *args, exc_info=None) -> bool:
        """Log `msg % args` unless `reason` was logged within the interval; True when a line was written.
        `exc_info` (a traceback) goes only with a written line, so at most one traceback per reason per interval."""
        suppressed = self.should_log(reason)
        if suppressed is None:
            return False
        if suppressed:
            msg += f" (and {suppressed} more like it in the last {self.interval_s:g} s)"
        logger.log(level, msg, *args, exc_info=exc_info)
        return True


class OneLineThrottleFilter(logging.Filter):
    """For a library logger that logs a traceback per bad input (aiohttp's server logger logs one per malformed
    HTTP request): each record becomes one line naming the exception, throttled per exception type."""

    def __init__(self, throttle: LogThrottle | None = None):
        super().__init__()
        self.throttle = throttle or LogThrottle()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        reason = f"{record.getMessage().split(' from ')[0]}:{type(exc).__name__ if exc else '-'}"
        suppressed = self.throttle.should_log(reason)
        if suppressed is None:
            return False
        line = record.getMessage() + (f": {type(exc).__name__}: {str(exc)[:200]}" if exc else "")
        if suppressed:
            line += f" (and {suppressed} more like it in the last {self.throttle.interval_s:g} s)"
        record.msg, record.args, record.exc_info, record.exc_text = line, None, None, None
        return True


DEFAULT = LogThrottle()


def throttled(logger: logging.Logger, level: int, reason: str, msg: str, *args, exc_info=None) -> bool:
    """`DEFAULT.log(...)`: the process-wide throttle most callers want."""
    return DEFAULT.log(logger, level, reason, msg, *args, exc_info=exc_info)
