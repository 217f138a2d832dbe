"""A small OTLP/HTTP traces receiver for the benchmarks and the tests: an aiohttp server on 127.0.0.1, in its own thread,
accepting POST /v1/traces and decoding each protobuf ExportTraceServiceRequest with opentelemetry-proto's classes
(what a collector such as Jaeger or Tempo receives)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each link
    start_ns: int
    end_ns: int
    error: bool  # status code ERROR
    resource: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode_traces(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP/HTTP protobuf export request."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(ReceivedSpan(
                    str(resource.get("service.name", "")), s.name, s.trace_id.hex(), s.span_id.hex(),
                    s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                    tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links), s.start_time_unix_nano,
                    s.end_time_unix_nano, s.status.code == Status.STATUS_CODE_ERROR, resource))
    return spans


class OtlpReceiver:
    """`with OtlpReceiver() as rx:` serves on rx.url until the block ends; rx.spans() is every span received."""

    def __init__(self):
        self._spans: list[ReceivedSpan] = []
        self.requests = 0  # POSTs received, decodable or not
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="otlp-receiver", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        with self._lock:
            self.requests += 1
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        spans = decode_traces(body)
        with self._lock:
            self._spans.extend(spans)
        # an empty ExportTraceServiceResponse is an empty protobuf message
        return web.Response(body=b"", content_type="application/x-protobuf")

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the OTLP receiver did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
