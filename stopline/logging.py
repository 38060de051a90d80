"""structlog configuration: console or JSON, every line redacted, the SDK's lines included.

Log lines bind task id, round and tool where they are known. Two sources
end up in one format:

- stopline's own ``structlog`` loggers (stdout);
- everything that logs through the standard library — the Temporal SDK's
  ``temporalio.*`` loggers (an activity that failed is logged with its
  traceback), httpx, and the Temporal core's Rust logs, which the worker
  forwards to the ``temporalio.core`` logger (``stopline.worker.telemetry``)
  — through a root handler with ``structlog.stdlib.ProcessorFormatter``
  (stderr).

So with ``STOPLINE_LOG_FORMAT=json`` every line is one JSON object, and
tracebacks are a field (``exception``), not loose lines. The last processor
before rendering replaces every configured secret value
(``stopline.secrets``) in every string of the event — message, fields,
nested values and the formatted traceback — and blanks every field whose
name says it is a credential (``api_key``, ``authorization``, ...), so a key
can never reach a log line (DESIGN §5).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from stopline.secrets import REDACTED, Redactor, current_redactor
from stopline.settings import Settings

_SECRET_KEYS = ("api_key", "apikey", "authorization", "x-api-key", "secret", "token", "password")
#: Marks the root handler this module installed (replaced on reconfiguration).
_HANDLER_MARK = "_stopline_handler"
#: Level of standard-library records that are shown (the SDK's warnings and
#: errors; its and httpx's INFO chatter stay out).
STDLIB_LEVEL = logging.WARNING


def _scrub(value: Any, redactor: Redactor) -> Any:
    if isinstance(value, str):
        return redactor.text(value)
    if isinstance(value, dict):
        return {k: _scrub(v, redactor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub(v, redactor) for v in value)
    if isinstance(value, BaseException):
        return redactor.text(repr(value))
    return value


def redactor_processor(secrets: Redactor) -> Any:
    """A structlog processor that redacts secrets from every string of an event.

    Args:
        secrets: The configured secret values.

    Returns:
        ``processor(logger, method, event_dict) -> event_dict``.
    """

    def redact(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in list(event.items()):
            if any(s in key.lower() for s in _SECRET_KEYS):
                event[key] = REDACTED
            else:
                event[key] = _scrub(value, secrets)
        return event

    return redact


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the moment of each record
    (like the standard library's last-resort handler), not the stream of the
    moment it was configured."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure_logging(settings: Settings) -> None:
    """Configure structlog and the standard library's root logger for this process.

    Idempotent: a second call replaces what the first installed.

    Args:
        settings: ``log_format`` (``console`` | ``json``) and the secrets to
            redact.
    """
    redact = redactor_processor(current_redactor(settings))
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            # tracebacks become a string field first, so they are redacted too
            structlog.processors.format_exc_info,
            redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso"),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact,
            renderer,
        ],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    handler.setLevel(STDLIB_LEVEL)
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    if root.level > STDLIB_LEVEL or root.level == logging.NOTSET:
        root.setLevel(STDLIB_LEVEL)
