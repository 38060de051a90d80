"""structlog configuration: console or JSON, with secrets redacted.

Log lines bind task id, round and tool where they are known. A processor
redacts every value of a key that looks like a secret (``api_key``,
``authorization``, ...) and any occurrence of the configured API keys'
values, so a key can never reach a log line (DESIGN §5).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

from stopline.settings import Settings

_SECRET_KEYS = ("api_key", "apikey", "authorization", "x-api-key", "secret", "token", "password")


def _redactor(secrets: list[str]) -> Any:
    def redact(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in list(event.items()):
            if any(s in key.lower() for s in _SECRET_KEYS):
                event[key] = "***"
            elif isinstance(value, str) and secrets:
                for secret in secrets:
                    if secret and secret in value:
                        value = value.replace(secret, "***")
                event[key] = value
        return event

    return redact


def configure_logging(settings: Settings) -> None:
    """Configure structlog once for this process.

    Args:
        settings: ``log_format`` (``console`` | ``json``) and the API keys to
            redact.
    """
    secrets = [
        s.get_secret_value()
        for s in (settings.anthropic_api_key, settings.openai_api_key, settings.codec_key)
        if s is not None
    ]
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
            _redactor(secrets),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
