"""Optional distributed tracing: OpenTelemetry spans exported over OTLP/HTTP (protobuf) to a collector (Jaeger,
Tempo, an OpenTelemetry Collector...), one trace per request.

Off by default. With `--otlp-endpoint URL` a process builds one OtlpTracer; without it every holder keeps None, so
the hot path's whole cost is an `is None` check: no span objects, no header field. The SDK is imported here, lazily,
only when a tracer is built (INSTALL_HINT: stagemesh is not on PyPI, the extra installs from a checkout); nothing else in stagemesh imports opentelemetry.

The spans (names and attributes are what a tracing UI shows):
  stagemesh.request        gateway: arrival to finish; the root of the request's trace
  stagemesh.microbatch     gateway: send to result of one micro-batch; a child of one of the requests it carries
                           (the one that has parented fewest so far, so every request's trace gets its share) and
                           linked to the others
  stagemesh.stage.compute  each stage: computing that micro-batch; a child of the stagemesh.microbatch span (the
                           header's "tp") and linked to the other requests' spans (each sequence's "tp")
Export runs in the SDK's BatchSpanProcessor thread: a span's end only appends it to a bounded queue (spans beyond
it are dropped, never waited for).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shared.errors import StagemeshError
from shared.observe.log_throttle import LogThrottle

INSTALL_HINT = "from the stagemesh checkout: .venv/bin/pip install -e '.[otlp]'"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, appended to an endpoint given without a path
EXPORT_TIMEOUT_S = 5.0  # per export request, retries included: an unreachable collector never holds shutdown long
FLUSH_DELAY_MS = 1000  # how often the batch processor exports what has ended
MAX_QUEUE_SPANS = 8192  # ended spans waiting for export; more are dropped (the hot path never waits)
# The SDK's loggers that write a line per failed export attempt (several a second while the collector is down).
EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk._shared_internal")


class _PerTemplateThrottle(logging.Filter):
    """At most one line per logger and message template per interval (the formatted text differs every time: it
    names a fresh connection error), the count of the rest appended."""

    def __init__(self):
        super().__init__()
        self.throttle = LogThrottle()

    def filter(self, record: logging.LogRecord) -> bool:
        suppressed = self.throttle.should_log(f"{record.name}:{record.msg}")
        if suppressed is None:
            return False
        if suppressed:
            record.msg = f"{record.msg} (and {suppressed} more like it in the last {self.throttle.interval_s:g} s)"
        return True


def otlp_endpoint(url: str, flag: str = "--otlp-endpoint") -> str:
    """The OTLP/HTTP traces URL for `url` (http(s)://HOST[:PORT][/PATH]; no path means /v1/traces), or a
    StagemeshError that says what to fix."""
    example = f"e.g. http://127.0.0.1:4318 (the collector's OTLP/HTTP port; {TRACES_PATH} is added)"
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises ValueError when not a number in 0..65535
    except ValueError:
        raise StagemeshError(f"{flag} {url!r} is not a valid URL; {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment or port == 0:
        raise StagemeshError(f"{flag} {url!r} must be http(s)://HOST[:PORT][/PATH] without query or fragment; "
                             f"{example}")
    path = parts.path if parts.path not in ("", "/") else TRACES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def require_sdk(flag: str = "--otlp-endpoint") -> None:
    """Raise a one-line StagemeshError naming the install command when the OpenTelemetry SDK is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise StagemeshError(f"{flag} needs the OpenTelemetry SDK and OTLP exporter ({e.name or e} is not "
                             f"installed): {INSTALL_HINT}") from None


def trace_id_of(traceparent: str) -> str:
    """The 32-hex trace id of a W3C traceparent (validated by shared.wire.protocol on receipt)."""
    return traceparent[3:35]


class OtlpTracer:
    """One process's tracer: `service_name` (and `resource`) name the process in the tracing UI. Thread-safe."""

    def __init__(self, endpoint: str, service_name: str, resource: dict[str, Any] | None = None):
        require_sdk()
        from opentelemetry import trace as otel
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._otel = otel  # the API module: Link, SpanContext, Status... (imported here, never at module level)
        self.endpoint = endpoint
        self.service_name = service_name
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name, **(resource or {})}))
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S), max_queue_size=MAX_QUEUE_SPANS,
            schedule_delay_millis=FLUSH_DELAY_MS, export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000)))
        self._tracer = self._provider.get_tracer("stagemesh")
        for name in EXPORT_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _PerTemplateThrottle) for f in logger.filters):
                logger.addFilter(_PerTemplateThrottle())

    def _context(self, ref) -> Any:
        """A SpanContext from a span of this process or a W3C traceparent string received from another."""
        if not isinstance(ref, str):
            return ref.get_span_context()
        otel = self._otel
        return otel.SpanContext(int(ref[3:35], 16), int(ref[36:52], 16), is_remote=True,
                                trace_flags=otel.TraceFlags(int(ref[53:55], 16)))

    def start(self, name: str, parent=None, links=(), attributes: dict | None = None, start_ns: int | None = None):
        """A started span: a root when parent is None, else a child of `parent` (a span or a traceparent); linked
        to each of `links` (spans or traceparents)."""
        otel = self._otel
        context = None if parent is None else otel.set_span_in_context(
            parent if not isinstance(parent, str) else otel.NonRecordingSpan(self._context(parent)))
        return self._tracer.start_span(name, context=context, links=[otel.Link(self._context(r)) for r in links],
                                       attributes=attributes, start_time=start_ns)

    def end(self, span, attributes: dict | None = None, error: str | None = None) -> None:
        """End `span` with these attributes added; `error` marks it failed with that description."""
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_status(self._otel.Status(self._otel.StatusCode.ERROR, error))
        span.end()

    @staticmethod
    def traceparent(span) -> str:
        """The W3C traceparent naming `span`, to carry in a message header."""
        c = span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    def shutdown(self) -> None:
        """Export what has ended (bounded by EXPORT_TIMEOUT_S) and stop the export thread."""
        self._provider.shutdown()
