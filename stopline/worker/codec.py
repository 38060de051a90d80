"""Encryption of payloads at rest: an AES-256-GCM ``PayloadCodec``.

Temporal stores every workflow input, activity input and result, update
argument and query answer in its database as payloads. A task's payloads hold
the prompt, the model's text and tool output (DESIGN §5 keeps API keys out of
them, but not the user's code or data). With ``STOPLINE_CODEC_KEY`` set, each
payload is encrypted in the client — worker, CLI and replay alike — before it
leaves the process, so the server, its database and its UI see only
ciphertext. The ledger JSONL file on the worker host is not affected (it is
the host's own disk).

Failure messages and stack traces are plain strings in history by default;
with the codec on, :func:`data_converter` also moves them into an encoded
payload (``DefaultFailureConverterWithEncodedAttributes``) so a provider
error quoting the prompt is not left readable.

Wire format of an encrypted payload (compatible with Temporal's encryption
samples): metadata ``encoding: binary/encrypted`` and ``encryption-key-id:
<id>``; data ``nonce (12 bytes) || AES-GCM(serialized inner Payload)`` with
the key id as associated data. The key id names the key without revealing
it, so after a rotation old payloads still find their key
(``STOPLINE_CODEC_PREVIOUS_KEYS``). Payloads that are not encrypted (written
before the codec was turned on) decode unchanged.

Needs the ``cryptography`` package; it is imported only when a codec is
built, so nothing here costs anything while no key is set.

Redaction (DESIGN §5) rides on the same chain, because it is the one place
everything a worker or the CLI sends to the server passes through: workflow
and activity inputs and results, heartbeat details, update and query
answers, events. :class:`RedactingCodec` replaces every configured secret
value (``stopline.secrets``) in a payload before it is encrypted, and the
failure converter does the same to failure messages and stack traces (a
provider 401 whose body echoes the API key). With no secret configured and
no codec key, the plain pydantic converter is used unchanged.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import os
from collections.abc import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverter,
    FailureConverter,
    PayloadCodec,
    PayloadConverter,
)

from stopline.core.errors import ConfigError
from stopline.secrets import Redactor, current_redactor
from stopline.settings import Settings

#: Payload encodings whose data is text (JSON) or raw bytes, safe to edit.
#: ``binary/protobuf`` is left alone: replacing bytes would corrupt it.
REDACTABLE_ENCODINGS = (b"json/plain", b"json/protobuf", b"binary/plain")

#: ``encoding`` metadata of an encrypted payload.
ENCODING = b"binary/encrypted"
#: Metadata key naming the key that encrypted a payload.
KEY_ID_METADATA = "encryption-key-id"
#: AES-256: 32-byte keys.
KEY_BYTES = 32
#: AES-GCM nonce length (bytes); random per payload.
NONCE_BYTES = 12

KEYGEN_HINT = (
    "python -c 'import base64, os; print(base64.b64encode(os.urandom(32)).decode())'"
)


class CodecKeyError(ConfigError):
    """A codec key is malformed, or a payload's key is not available."""


def parse_key(text: str) -> bytes:
    """Decode a base64 (standard or URL-safe) AES-256 key.

    Args:
        text: The key as base64 text.

    Returns:
        The 32 key bytes.

    Raises:
        CodecKeyError: If it is not base64 of exactly 32 bytes (the error
            says how to make one).
    """
    raw = text.strip()
    url_safe = "-" in raw or "_" in raw
    try:
        key = base64.b64decode(raw, altchars=b"-_" if url_safe else None, validate=True)
    except (binascii.Error, ValueError) as err:
        raise CodecKeyError(f"codec key is not base64 ({err}); make one with: {KEYGEN_HINT}") from None
    if len(key) != KEY_BYTES:
        raise CodecKeyError(
            f"codec key must be {KEY_BYTES} bytes, got {len(key)}; make one with: {KEYGEN_HINT}"
        )
    return key


def key_id(key: bytes) -> str:
    """A stable, non-secret name for a key: ``sl-`` + 12 hex of its SHA-256.

    48 bits of a hash of a 256-bit random key reveal nothing usable about
    it, and are enough to tell a handful of rotated keys apart.
    """
    return "sl-" + hashlib.sha256(key).hexdigest()[:12]


def _aesgcm() -> type:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as err:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "STOPLINE_CODEC_KEY is set but the `cryptography` package is missing: "
            "pip install 'cryptography>=43'"
        ) from err
    return AESGCM


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM payload codec with key ids (see the module docstring).

    Args:
        key: The current key (32 bytes): encrypts every new payload.
        previous_keys: Older keys, for decrypting payloads written before a
            rotation.

    Raises:
        CodecKeyError: If a key is not 32 bytes.
        RuntimeError: If ``cryptography`` is not installed.
    """

    def __init__(self, key: bytes, previous_keys: Sequence[bytes] = ()) -> None:
        aesgcm = _aesgcm()
        for k in (key, *previous_keys):
            if len(k) != KEY_BYTES:
                raise CodecKeyError(f"codec key must be {KEY_BYTES} bytes, got {len(k)}")
        self.key_id = key_id(key)
        self._ciphers = {key_id(k): aesgcm(k) for k in (*previous_keys, key)}

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Encrypt each payload (a fresh random nonce per payload)."""
        return [self._encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Decrypt encrypted payloads; pass others through unchanged.

        Raises:
            CodecKeyError: If a payload names a key this process lacks, or
                does not authenticate under it (tampered or wrong key).
        """
        return [self._decrypt(p) for p in payloads]

    def _encrypt(self, payload: Payload) -> Payload:
        nonce = os.urandom(NONCE_BYTES)
        kid = self.key_id.encode()
        sealed = self._ciphers[self.key_id].encrypt(nonce, payload.SerializeToString(), kid)
        return Payload(
            metadata={"encoding": ENCODING, KEY_ID_METADATA: kid}, data=nonce + sealed
        )

    def _decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        kid = payload.metadata.get(KEY_ID_METADATA, b"").decode()
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise CodecKeyError(
                f"payload is encrypted with key {kid or '(none)'}, which this process does not have "
                f"(have: {', '.join(sorted(self._ciphers))}); set STOPLINE_CODEC_KEY or "
                f"STOPLINE_CODEC_PREVIOUS_KEYS"
            )
        from cryptography.exceptions import InvalidTag

        data = payload.data
        try:
            plain = cipher.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], kid.encode())
        except InvalidTag:
            raise CodecKeyError(f"payload under key {kid} does not authenticate") from None
        return Payload.FromString(plain)


class RedactingCodec(PayloadCodec):
    """Replace configured secret values in every outgoing payload, then encode further.

    Args:
        redactor: The secret values to replace.
        inner: The codec applied after redaction (encryption), if any.
    """

    def __init__(self, redactor: Redactor, inner: PayloadCodec | None = None) -> None:
        self.redactor = redactor
        self.inner = inner

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Redact, then apply the inner codec."""
        redacted = [self._redact(p) for p in payloads]
        if self.inner is not None:
            return await self.inner.encode(redacted)
        return redacted

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """The inner codec's decode (what came from the server was redacted when sent)."""
        if self.inner is not None:
            return await self.inner.decode(payloads)
        return list(payloads)

    def _redact(self, payload: Payload) -> Payload:
        if not self.redactor or payload.metadata.get("encoding") not in REDACTABLE_ENCODINGS:
            return payload
        data = self.redactor.bytes(payload.data)
        if data == payload.data:
            return payload
        out = Payload()
        out.CopyFrom(payload)
        out.data = data
        return out


def _redact_failure(failure: Failure, redactor: Redactor) -> None:
    while failure is not None and failure.ByteSize():
        failure.message = redactor.text(failure.message)
        failure.stack_trace = redactor.text(failure.stack_trace)
        if not failure.HasField("cause"):
            break
        failure = failure.cause


def redacting_failure_converter(redactor: Redactor, *, encode_attributes: bool) -> type[FailureConverter]:
    """A failure converter class that redacts messages and stack traces.

    ``DataConverter`` takes a class (it instantiates it without arguments),
    hence a class built per redactor.

    Args:
        redactor: The secret values to replace.
        encode_attributes: Also move message and stack trace into an encoded
            payload (with the encryption codec: they are encrypted too).

    Returns:
        A ``DefaultFailureConverter`` subclass.
    """

    class RedactingFailureConverter(DefaultFailureConverter):
        def __init__(self) -> None:
            super().__init__(encode_common_attributes=encode_attributes)

        def to_failure(
            self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure
        ) -> None:
            # redact first: with encode_attributes the text moves into a payload
            super().to_failure(exception, payload_converter, failure)
            _redact_failure(failure, redactor)

    return RedactingFailureConverter


def codec_from_settings(settings: Settings) -> EncryptionCodec | None:
    """The codec ``settings`` ask for, or ``None`` when no key is set.

    Raises:
        CodecKeyError: If a configured key is malformed.
    """
    if settings.codec_key is None or not settings.codec_key.get_secret_value().strip():
        return None
    previous: list[bytes] = []
    if settings.codec_previous_keys is not None:
        listed = settings.codec_previous_keys.get_secret_value().split(",")
        previous = [parse_key(k) for k in listed if k.strip()]
    return EncryptionCodec(parse_key(settings.codec_key.get_secret_value()), previous)


def data_converter(settings: Settings) -> DataConverter:
    """stopline's data converter: pydantic, redaction of secrets, encryption when a key is set.

    Every client and the replayer take their converter from here, so a
    worker, the CLI and ``stopline replay`` always agree on the encoding.
    """
    codec = codec_from_settings(settings)
    redactor = current_redactor(settings)
    if codec is None and not redactor:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=RedactingCodec(redactor, codec) if redactor else codec,
        failure_converter_class=redacting_failure_converter(
            redactor, encode_attributes=codec is not None
        ),
    )
