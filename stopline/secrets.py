"""Secrets: which values are secret, and keeping them out of every reach.

Why this module exists: DESIGN §5 says a secret never enters workflow
history, a log line, the ledger or a tool's reach. "Secret" means the values
configured for this process — the provider API keys, the payload codec keys
(current and previous) and the Temporal API key — and this module is the one
place that lists them (:func:`secret_values`). Everything that keeps them out
builds on it:

- :class:`Redactor` replaces each secret value in text and bytes with
  :data:`REDACTED`. It is applied at the choke points: the data converter
  (``stopline.worker.codec``: every payload and failure a worker or the CLI
  sends to the server), the ledger store's write path, the tool boundary
  and the log processors (``stopline.logging``).
- :func:`service_env` is the environment for processes stopline spawns that
  need no secret (the dev server, the scripted server): the parent's
  environment minus every secret variable.
- :func:`make_undumpable` makes a process's ``/proc/<pid>/environ`` and
  memory unreadable to other processes of the same user.

What it must never do: log, print or return a secret value (only names and
the redacted marker leave it), or treat a short value as a secret — a value
under :data:`MIN_SECRET_CHARS` characters (``OPENAI_API_KEY=ollama`` for a
local server) is not a credential, and replacing every occurrence of a common
word would garble every transcript.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, AnyStr, Generic

from stopline.core.policies import REDACTED
from stopline.settings import Settings

__all__ = [
    "MIN_SECRET_CHARS",
    "REDACTED",
    "SECRET_ENV_NAMES",
    "Redactor",
    "current_redactor",
    "is_secret_name",
    "make_undumpable",
    "secret_values",
    "service_env",
]

#: Values shorter than this are not treated as secrets (see the module docstring).
MIN_SECRET_CHARS = 8
#: Environment variables whose values are secrets stopline itself reads.
SECRET_ENV_NAMES = (
    "ANTHROPIC_API_KEY",
    "OPENAI_API_KEY",
    "STOPLINE_CODEC_KEY",
    "STOPLINE_CODEC_PREVIOUS_KEYS",
    "TEMPORAL_API_KEY",
)
#: Names that look like credentials of other software (cloud keys, database
#: URLs with passwords, tokens): also kept out of spawned processes.
_CREDENTIAL_NAME = re.compile(
    r"API_?KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_?KEY|ACCESS_?KEY|DATABASE_URL|DSN\b",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential.

    Args:
        name: The variable's name.

    Returns:
        ``True`` for stopline's own secret variables (:data:`SECRET_ENV_NAMES`)
        and names that look like credentials (``*_API_KEY``, ``*TOKEN*``,
        ``*SECRET*``, ``*PASSWORD*``, ``DATABASE_URL``, ...).
    """
    return name in SECRET_ENV_NAMES or bool(_CREDENTIAL_NAME.search(name))


def secret_values(settings: Settings) -> tuple[str, ...]:
    """Every configured secret value, longest first.

    Args:
        settings: Where the keys were read from (environment first).

    Returns:
        The provider API keys, the codec key and each previous codec key
        (comma-separated), and the Temporal API key — each at least
        :data:`MIN_SECRET_CHARS` long, without duplicates, longest first (so a
        key that contains another is replaced whole).
    """
    raw: list[str] = []
    for value in (
        settings.anthropic_api_key,
        settings.openai_api_key,
        settings.codec_key,
        settings.temporal_api_key,
    ):
        if value is not None:
            raw.append(value.get_secret_value().strip())
    if settings.codec_previous_keys is not None:
        raw.extend(k.strip() for k in settings.codec_previous_keys.get_secret_value().split(","))
    found = {v for v in raw if len(v) >= MIN_SECRET_CHARS}
    return tuple(sorted(found, key=lambda v: (-len(v), v)))


class Redactor:
    """Replace configured secret values with :data:`REDACTED`.

    Each secret is also matched in its JSON-escaped spelling (a key holding
    ``"`` or ``\\`` appears escaped inside a JSON payload).

    Args:
        secrets: The secret values (see :func:`secret_values`); values under
            :data:`MIN_SECRET_CHARS` characters are ignored.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        spellings: set[str] = set()
        for s in secrets:
            if len(s) >= MIN_SECRET_CHARS:
                spellings.add(s)
                spellings.add(json.dumps(s)[1:-1])
        self._text = tuple(sorted(spellings, key=lambda v: (-len(v), v)))
        self._bytes = tuple(s.encode("utf-8") for s in self._text)
        #: Bytes a stream must hold back so a secret split across two chunks
        #: is still found (the longest spelling, less one).
        self.overlap = max((len(b) for b in self._bytes), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self._text)

    def text(self, value: str) -> str:
        """``value`` with every secret replaced."""
        for s in self._text:
            if s in value:
                value = value.replace(s, REDACTED)
        return value

    def bytes(self, value: bytes) -> bytes:
        """``value`` (UTF-8 or any bytes) with every secret replaced."""
        for s in self._bytes:
            if s in value:
                value = value.replace(s, REDACTED.encode())
        return value

    def stream(self) -> StreamRedactor[bytes]:
        """A redactor for a byte stream fed in chunks (see :class:`StreamRedactor`)."""
        return StreamRedactor(self, b"")

    def text_stream(self) -> StreamRedactor[str]:
        """A redactor for text fed in pieces (a model's streamed output)."""
        return StreamRedactor(self, "")


class StreamRedactor(Generic[AnyStr]):
    """Redact a stream (bytes or text) piece by piece, finding secrets split
    across pieces.

    Holds back the last :attr:`Redactor.overlap` bytes (characters, for
    text: never fewer than needed) of what it was fed until more arrives or
    :meth:`flush` is called.

    Args:
        redactor: The secrets.
        empty: ``b""`` for a byte stream, ``""`` for text.
    """

    def __init__(self, redactor: Redactor, empty: AnyStr) -> None:
        self._redactor = redactor
        self._held: AnyStr = empty
        self._apply: Any = redactor.bytes if isinstance(empty, bytes) else redactor.text

    def feed(self, data: AnyStr) -> AnyStr:
        """Redact ``data`` (after what is held back); return what may be written now."""
        if not self._redactor:
            return data
        buf = self._apply(self._held + data)
        keep = self._redactor.overlap
        if keep <= 0 or len(buf) <= keep:
            self._held = buf
            return buf[:0]
        self._held = buf[-keep:]
        return buf[:-keep]

    def flush(self) -> AnyStr:
        """The rest, redacted (call once at the end)."""
        out, self._held = self._apply(self._held), self._held[:0]
        return out


@functools.lru_cache(maxsize=8)
def _redactor_for(secrets: tuple[str, ...]) -> Redactor:
    return Redactor(secrets)


def current_redactor(settings: Settings | None = None) -> Redactor:
    """The redactor for ``settings`` (default: the environment now), cached per key set."""
    if settings is None:
        from stopline.settings import load_settings

        settings = load_settings()
    return _redactor_for(secret_values(settings))


def service_env(
    base: Mapping[str, str] | None = None, *, settings: Settings | None = None
) -> dict[str, str]:
    """The environment for a process stopline spawns that needs no secret.

    The dev server and the scripted server get this: the parent's environment
    without stopline's secret variables, without names that look like
    credentials, and without any variable whose value is a configured secret
    (whatever its name). A process's initial environment stays readable in
    ``/proc/<pid>/environ`` for its whole life, so what is not passed cannot
    leak.

    Args:
        base: The environment to filter (default ``os.environ``).
        settings: Whose secret values to drop (default: from the environment).

    Returns:
        A new dict.
    """
    env = dict(os.environ if base is None else base)
    values = set(secret_values(settings if settings is not None else _settings_from(env)))
    return {
        k: v for k, v in env.items() if not is_secret_name(k) and v.strip() not in values
    }


def _settings_from(env: Mapping[str, str]) -> Settings:
    from pydantic import SecretStr

    def secret(name: str) -> SecretStr | None:
        value = env.get(name)
        return SecretStr(value) if value else None

    return Settings.model_construct(
        anthropic_api_key=secret("ANTHROPIC_API_KEY"),
        openai_api_key=secret("OPENAI_API_KEY"),
        codec_key=secret("STOPLINE_CODEC_KEY"),
        codec_previous_keys=secret("STOPLINE_CODEC_PREVIOUS_KEYS"),
        temporal_api_key=secret("TEMPORAL_API_KEY"),
    )


def make_undumpable() -> bool:
    """Make this process non-dumpable (Linux ``prctl(PR_SET_DUMPABLE, 0)``).

    A non-dumpable process's ``/proc/<pid>/environ``, ``mem`` and ``fd``
    belong to root, so a tool running as the same (non-root) user cannot read
    the keys in its environment. The worker and every CLI process call this
    first. A tool running as root is not stopped by it; the sandbox's own PID
    namespace hides other processes from sandboxed tools either way.

    Returns:
        ``True`` when the flag was set.
    """
    import sys

    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(4, 0, 0, 0, 0)) == 0  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        return False
