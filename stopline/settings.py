"""One settings model for stopline: environment variables and CLI flags.

Read by the CLI, the worker and activities — never by workflow code (the
sandbox forbids ``os.environ``; workflow inputs carry what a task needs).
API keys live here only as ``SecretStr`` so they are redacted when printed
and never serialized into a workflow input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stopline.core.contracts import DEFAULT_TASK_QUEUE


class Settings(BaseSettings):
    """stopline configuration (environment first, flags override).

    Attributes:
        home: State directory (``$STOPLINE_HOME``, default ``~/.stopline``):
            ledgers, blobs, background-shell logs, the embedded server's
            SQLite file and PID files.
        temporal_address: ``host:port`` of a Temporal frontend
            (``$TEMPORAL_ADDRESS``). Unset: the embedded dev server.
        temporal_namespace: Namespace (``$TEMPORAL_NAMESPACE``).
        temporal_profile: Profile of the ``temporal`` CLI's config file
            (``$TEMPORAL_PROFILE``); the connection (address, TLS, mTLS, API
            key) is read the way that CLI reads it
            (:func:`stopline.worker.runtime.connect_config`).
        task_queue: Task queue of workflows and sampling activities.
        host_capacity: Tasks this host holds at once (DESIGN §7); a full
            pool makes a new task wait, visibly, for a host.
        host_lost_after_s: Default bound after which a silent host is lost
            (its sessions' heartbeat timeout); per task in ``TaskLimits``.
        home_slots: When > 0, ``home`` holds that many host homes
            (``slot-1`` …): a worker takes the first one no live worker
            holds. For replicas sharing one volume (``docker compose --scale``):
            a recreated replica takes over a free slot — and with it a dead
            replica's host id, so that host's tasks come back at once.
        dev_server_port: Port of the embedded dev server's frontend.
        dev_server_ui_port: Port of its web UI.
        interrupt_grace_s: Seconds between an interrupt's cancel request and
            the hard abort (seed 002: 100 ms).
        heartbeat_timeout_s: Activity heartbeat timeout in seconds (the
            tasks the CLI starts): a worker that dies is noticed after this
            long (default 30 s; the placement bound is 60 s). Costs nothing
            by itself; activities heartbeat at least every third of it.
        heartbeat_throttle_s: Seconds between one running activity's
            heartbeats: the interval of the activities' heartbeat loop and
            the worker's ``max_heartbeat_throttle_interval``. Heartbeats
            only prove liveness (cancels are pushed, DESIGN §3); each one
            that reaches the server is a Temporal Cloud Action. Default 5 s:
            0.2 RPC/s, 720 Actions/hour, $0.036/hour per running call at
            $50 per million Actions. ``0.02`` is the old heartbeat-borne
            cancel mode: 50 RPC/s, 180,000 Actions/hour, $9/hour per call.
        push_cancel: Register this worker's ``stopline.cancel_calls``
            activity, through which interrupts reach running calls at once
            (``$STOPLINE_PUSH_CANCEL``, default on). Off: a cancel reaches a
            call only on its next heartbeat, and an interrupt's hard abort
            runs on the grace timer.
        tool_output_cap_bytes: Inline cap on tool output the model sees.
        sampling_timeout_s: start-to-close timeout of one sampling attempt.
        sampling_total_timeout_s: schedule-to-close timeout of one sampling
            call, every attempt and retry wait included (default 900 s: a
            hung provider fails the task within 15 minutes).
        sampling_idle_timeout_s: A provider that sends no byte for this long
            (before its status line, or between stream events) fails the
            attempt, retryably. Read by the worker.
        max_tokens: Default output token limit per sampling call
            (``$STOPLINE_MAX_TOKENS``; ``--max-tokens`` overrides).
        temperature: Default sampling temperature (``$STOPLINE_TEMPERATURE``);
            unset: the provider's default.
        top_p: Default nucleus sampling (``$STOPLINE_TOP_P``); unset: the
            provider's default.
        worker_shutdown_grace_s: Seconds in-flight activities get to finish
            when the worker is asked to stop (SIGTERM); shorter than a
            container's usual 30 s termination grace.
        stream_deltas_s: Seconds between the sampling activity's publishes
            of text and tool-argument deltas to the task's workflow stream
            (``stopline.activities.deltas``); each publish is a Signal (a
            billed Action on Temporal Cloud). ``0``: no deltas; watchers
            see whole messages.
        anthropic_api_key: ``$ANTHROPIC_API_KEY``.
        openai_api_key: ``$OPENAI_API_KEY``.
        anthropic_base_url: ``$ANTHROPIC_BASE_URL``.
        openai_base_url: ``$OPENAI_BASE_URL`` (OpenAI-compatible servers:
            vLLM, llama.cpp server, Ollama).
        log_format: ``console`` or ``json`` (structlog).
        metrics_bind: ``host:port`` where the worker serves the Temporal
            SDK's metrics for Prometheus at ``/metrics``
            (``$STOPLINE_METRICS_BIND``, e.g. ``127.0.0.1:9464``). Unset: no
            metrics endpoint. Only the worker binds it, so CLI commands never
            compete for the port.
        otel: Trace through OpenTelemetry (``$STOPLINE_OTEL=1``): the
            ``TracingInterceptor`` on every client, when the ``otel`` extra
            is installed; without it a warning is logged and nothing traced.
        codec_key: Base64 of a 32-byte AES-256 key (``$STOPLINE_CODEC_KEY``).
            Set: every payload (inputs, results, ledger rows, failure
            messages) is encrypted before it reaches the Temporal server.
            Every process of a deployment (workers, CLI, replay) needs it.
        codec_previous_keys: Comma-separated base64 keys still accepted for
            decrypting, after a rotation (``$STOPLINE_CODEC_PREVIOUS_KEYS``);
            new payloads always use ``codec_key``.
        temporal_api_key: ``$TEMPORAL_API_KEY`` (Temporal Cloud API key, as
            the ``temporal`` CLI reads it): a secret, redacted wherever text
            leaves a process (``stopline.secrets``).
        sandbox: ``auto`` (default): run tool commands in a bubblewrap
            sandbox when it works on this host; when it does not, each task's
            ``allow_unconfined`` decides (refuse, or run unconfined with a
            ledger row saying so). ``off``: the operator runs tools
            unconfined on purpose (every call still gets that ledger row).
        bwrap: The bubblewrap program (``$STOPLINE_BWRAP``, default ``bwrap``
            on ``PATH``).
        sandbox_ro_paths: Extra host paths the sandbox shows read-only,
            colon-separated (e.g. a toolchain in ``/home/me/.cargo``); the
            system directories (``/usr``, ``/etc``, ``/opt``, ...) always are.
        sandbox_tmp_bytes: Size limit of the sandbox's private ``/tmp`` (a
            tmpfs, so memory), in bytes.
        allow_unconfined: Default of a task's ``allow_unconfined`` for tasks
            started from the CLI (``--allow-unconfined``).
        tool_network: Default of a task's ``tool_network`` for tasks started
            from the CLI (``--network``).
        tool_output_store_cap_bytes: The most bytes of one call's output
            stored beside the ledger (the whole output when it is smaller);
            the result says where it was cut.
        shell_log_cap_bytes: The most bytes a background shell's log keeps on
            disk (the newest output; older output is dropped and
            ``shell_status`` says how much).
        retention_days: The worker removes finished tasks' full outputs,
            staged rows and background-shell logs this many days after their
            ledger last changed (``0``: never); ``stopline gc`` does it on
            demand.
    """

    model_config = SettingsConfigDict(env_prefix="STOPLINE_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".stopline")
    temporal_address: str | None = Field(default=None, validation_alias="TEMPORAL_ADDRESS")
    temporal_namespace: str = Field(default="default", validation_alias="TEMPORAL_NAMESPACE")
    temporal_profile: str | None = Field(default=None, validation_alias="TEMPORAL_PROFILE")
    task_queue: str = DEFAULT_TASK_QUEUE
    host_capacity: int = 8
    host_lost_after_s: float = 30.0
    home_slots: int = 0
    dev_server_port: int = 7233
    dev_server_ui_port: int = 8233
    interrupt_grace_s: float = 0.1
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    heartbeat_throttle_s: float = Field(default=5.0, gt=0)
    push_cancel: bool = True
    tool_output_cap_bytes: int = 16_384
    sampling_timeout_s: float = 600.0
    sampling_total_timeout_s: float = Field(default=900.0, gt=0)
    sampling_idle_timeout_s: float = Field(default=300.0, gt=0)
    max_tokens: int = Field(default=4096, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    worker_shutdown_grace_s: float = 10.0
    stream_deltas_s: float = Field(default=0.25, ge=0)
    anthropic_api_key: SecretStr | None = Field(default=None, validation_alias="ANTHROPIC_API_KEY")
    openai_api_key: SecretStr | None = Field(default=None, validation_alias="OPENAI_API_KEY")
    anthropic_base_url: str = Field(
        default="https://api.anthropic.com", validation_alias="ANTHROPIC_BASE_URL"
    )
    openai_base_url: str = Field(
        default="https://api.openai.com/v1", validation_alias="OPENAI_BASE_URL"
    )
    log_format: str = "console"
    metrics_bind: str | None = None
    otel: bool = False
    codec_key: SecretStr | None = None
    codec_previous_keys: SecretStr | None = None
    temporal_api_key: SecretStr | None = Field(default=None, validation_alias="TEMPORAL_API_KEY")
    sandbox: Literal["auto", "off"] = "auto"
    bwrap: str = "bwrap"
    sandbox_ro_paths: str = ""
    sandbox_tmp_bytes: int = Field(default=512 * 1024 * 1024, gt=0)
    allow_unconfined: bool = False
    tool_network: bool = False
    tool_output_store_cap_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    shell_log_cap_bytes: int = Field(default=16 * 1024 * 1024, ge=4096)
    retention_days: float = Field(default=7.0, ge=0)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``STOPLINE_TEMPERATURE=`` (set but empty) means the provider's default."""
        return None if value == "" else value

    @field_validator("otel", "allow_unconfined", "tool_network", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        """A flag set but empty (``STOPLINE_OTEL=``, as compose passes it) means off."""
        return False if value == "" else value

    @property
    def ledger_dir(self) -> Path:
        """Directory of the per-task JSONL ledgers and their blobs."""
        return self.home / "ledger"

    @property
    def shells_dir(self) -> Path:
        """Directory of background-shell logs and process-group records."""
        return self.home / "shells"

    @property
    def procs_dir(self) -> Path:
        """Directory of per-call process-group records (for the hard abort)."""
        return self.home / "procs"

    def extra_ro_paths(self) -> list[Path]:
        """:attr:`sandbox_ro_paths` as absolute paths (empty entries skipped)."""
        return [Path(p).expanduser() for p in self.sandbox_ro_paths.split(":") if p.strip()]


#: The last settings built from the environment alone, keyed by that
#: environment: activities ask for settings on every call, and building them
#: (pydantic-settings reads and validates every variable) cost ~1 ms of CPU
#: each time — a tenth of a worker's CPU per round (bench/bench_throughput.py).
_from_env: tuple[dict[Any, Any], Settings] | None = None


def _environment() -> dict[Any, Any]:
    """A copy of the process environment, to compare with the last one.

    ``os.environ`` decodes every name and value each time it is iterated
    (~27 µs for 35 variables, and settings are asked for several times a
    round); CPython keeps the undecoded mapping in ``os.environ._data``,
    which copies and compares in ~2 µs. Anything else falls back to the
    decoded items.
    """
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else dict(os.environ)


def load_settings(**overrides: object) -> Settings:
    """Build :class:`Settings` from the environment, then apply ``overrides``.

    Without overrides the result is reused while the environment is
    unchanged (a changed variable — a test's ``STOPLINE_HOME`` — builds
    anew); treat it as read-only.

    Args:
        **overrides: Field values that win over the environment (CLI flags);
            ``None`` values are ignored.

    Returns:
        The settings.
    """
    global _from_env
    clean = {k: v for k, v in overrides.items() if v is not None}
    if clean:
        return Settings(**clean)  # type: ignore[arg-type]
    env = _environment()
    if _from_env is None or _from_env[0] != env:
        _from_env = (env, Settings())
    return _from_env[1]
