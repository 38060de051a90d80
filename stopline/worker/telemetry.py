"""Metrics (Prometheus) and tracing (OpenTelemetry) for teams on Temporal.

Metrics: the Temporal SDK's own metrics — workflow/activity task latencies,
poll counts, sticky cache, activity failures, ``temporal_``-prefixed — served
for Prometheus at ``http://$STOPLINE_METRICS_BIND/metrics`` by the worker.
They come from the SDK's Rust core through a :class:`temporalio.runtime.
Runtime` built with a ``PrometheusConfig``; a runtime owns a thread pool and
its HTTP listener, so the worker process builds exactly one
(:func:`build_runtime`) and hands it to ``stopline.worker.runtime.connect``. CLI
commands never bind the port: two processes cannot share it.

Tracing: with ``STOPLINE_OTEL=1`` and the ``otel`` extra installed, every
client (and so every worker built on it) gets
``temporalio.contrib.opentelemetry.TracingInterceptor``: spans for starting
a task, its workflow run, each sampling and tool activity, linked across
processes through Temporal headers. Spans go to the global tracer provider:
if the process has none (e.g. not run under ``opentelemetry-instrument``),
:func:`tracing_interceptors` installs an SDK provider exporting over OTLP/HTTP
(configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables). Without the
extra, a warning is logged and the task runs untraced — tracing is never a
reason for a task not to run.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

from stopline.settings import Settings

log = structlog.get_logger("stopline.worker.telemetry")

#: OpenTelemetry service name of stopline's spans.
SERVICE_NAME = "stopline"


def build_runtime(settings: Settings) -> Runtime | None:
    """A Temporal runtime serving Prometheus metrics, if ``metrics_bind`` is set.

    Args:
        settings: ``metrics_bind`` (``host:port``; port 0 is not useful —
            Prometheus must know where to scrape).

    Returns:
        A new runtime to pass to ``connect(runtime=...)``, or ``None`` (the
        SDK's default runtime, no metrics endpoint).

    Raises:
        ValueError: If ``metrics_bind`` is not ``host:port``.
        RuntimeError: If the core cannot start the listener (the message
            names the address).
    """
    bind = (settings.metrics_bind or "").strip()
    if not bind:
        return None
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"STOPLINE_METRICS_BIND must be host:port, got {bind!r}")
    try:
        return Runtime(
            telemetry=TelemetryConfig(
                logging=core_logging(), metrics=PrometheusConfig(bind_address=bind)
            )
        )
    except Exception as err:  # the core raises a plain exception for a taken port
        raise RuntimeError(f"cannot serve metrics on {bind}: {err}") from err


def core_logging() -> LoggingConfig:
    """The Temporal core's (Rust) log lines, forwarded to the ``temporalio.core`` logger.

    Left to itself the core writes its warnings straight to stderr, in its
    own format and unredacted; forwarded, they pass through
    ``stopline.logging``'s formatter (JSON when asked, secrets redacted)
    like every other line. Same levels as the SDK's default: core WARN,
    other crates ERROR.
    """
    return LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
    )


def worker_runtime(settings: Settings) -> Runtime:
    """The worker's one runtime: :func:`build_runtime`'s, or one that only forwards core logs.

    Raises:
        ValueError, RuntimeError: As :func:`build_runtime`.
    """
    return build_runtime(settings) or Runtime(telemetry=TelemetryConfig(logging=core_logging()))


def tracing_interceptors(settings: Settings) -> list[Any]:
    """Client interceptors for OpenTelemetry tracing, when asked for and possible.

    Args:
        settings: ``otel``.

    Returns:
        ``[TracingInterceptor()]`` when ``settings.otel`` is on and
        ``opentelemetry`` is importable; else ``[]`` (with a warning when it
        was asked for).
    """
    if not settings.otel:
        return []
    try:
        import opentelemetry.trace  # noqa: F401
        from temporalio.contrib.opentelemetry import TracingInterceptor
    except ImportError as err:
        log.warning(
            "otel_unavailable",
            error=str(err),
            hint="pip install 'stopline[otel]' to trace; continuing without tracing",
        )
        return []
    _ensure_tracer_provider()
    return [TracingInterceptor()]


def _ensure_tracer_provider() -> None:
    """Install an OTLP-exporting SDK tracer provider unless one is set.

    A provider set by the host application or ``opentelemetry-instrument``
    wins. Without ``opentelemetry-sdk`` (API only), spans are no-ops until
    the application installs a provider itself.
    """
    import opentelemetry.trace as trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("otel_no_sdk", hint="install opentelemetry-sdk to export spans")
        return
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("otel_no_exporter", hint="install opentelemetry-exporter-otlp-proto-http")
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
