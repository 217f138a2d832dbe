"""Chat templates from GGUF, rendered in jinja2's ImmutableSandboxedEnvironment with a time and an output cap.

The sandbox refuses attribute walking (`''.__class__.__mro__...`); the caps stop templates that loop or grow
without bound. The time cap is enforced by a trace function in the rendering thread, so even a loop that
produces no output is stopped."""

from __future__ import annotations

import sys
import time
from datetime import datetime

from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import ChatTemplateError

DEFAULT_TIME_LIMIT_S = 1.0
DEFAULT_OUTPUT_LIMIT = 1 << 20  # characters
_MAX_REPEAT = 1 << 20  # `'x' * n` and `n ** m` are capped too


class _Capped(Exception):
    pass


class _CappedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and right > 64:
            raise SecurityError("exponent too large in chat template")
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > _MAX_REPEAT:
                    raise SecurityError("repetition too large in chat template")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused these messages: {message}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, output_limit: int = DEFAULT_OUTPUT_LIMIT):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.time_limit_s, self.output_limit = time_limit_s, output_limit
        env = _CappedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        deadline = time.monotonic() + self.time_limit_s
        previous = sys.gettrace()

        def tracer(frame, event, arg):  # runs on calls/lines in this thread only
            if time.monotonic() > deadline:
                raise _Capped(f"chat template ran longer than {self.time_limit_s:.1f} s")
            return tracer

        parts, size = [], 0
        sys.settrace(tracer)
        try:
            for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                size += len(chunk)
                if size > self.output_limit:
                    raise _Capped(f"chat template output exceeded {self.output_limit} characters")
                parts.append(chunk)
        except _Capped as e:
            raise ChatTemplateError(f"{e}; the template loops or grows without bound") from None
        except SecurityError as e:
            raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from None
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            sys.settrace(previous)
        return "".join(parts)

