"""Observability helpers: OTLP tracing export and throttled logging."""
