"""``scripted:FILE`` models, served on the host that samples them.

Why it exists: a scripted scenario (``stopline.testing.scripted``) is a
"model" for demos and tests, and a task's model calls run on the task's host
(DESIGN §7) — for a sub-task started with ``task_start(model="scripted:…")``
that is its parent's host, which the machine that ran ``stopline run`` may
not even be. So the host itself serves the scenario: the first sampling call
of a task with model ``scripted:/abs/path.json`` starts a
:class:`~stopline.testing.scripted.ScriptedServer` for that task in this
worker process, and every later call of the task talks to the same server
(a scenario's answers are served in order, so its position is per task).

What it must never do: share one scenario's position between two tasks, or
start anything that outlives the worker process (the servers are threads of
this process; they end with it). A task whose worker restarts starts its
scenario over: scripted scenarios are for demos and tests, not durability.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from stopline.testing.scripted import ScriptedServer

#: Prefix of a scripted model reference.
SCRIPTED_PREFIX = "scripted:"
#: A server no call used for this long is stopped (its task has ended, or
#: it is a long way from its next call); seconds.
IDLE_STOP_S = 1800.0

_lock = threading.Lock()
_servers: dict[tuple[str, str], tuple[ScriptedServer, float]] = {}


def is_scripted(model: str) -> bool:
    """Whether ``model`` names a scripted scenario (``scripted:FILE``)."""
    return model.startswith(SCRIPTED_PREFIX)


def scenario_path(model: str) -> str:
    """The file of a ``scripted:FILE`` reference (as written)."""
    return model[len(SCRIPTED_PREFIX):]


def resolve(task_id: str, model: str) -> tuple[str, str]:
    """This task's scripted server for ``model``, started on first use.

    Args:
        task_id: The task (each task gets its own server and position).
        model: ``scripted:/absolute/path/to/scenario.json``.

    Returns:
        ``(provider model ref, base URL)``, e.g.
        ``("anthropic:scripted", "http://127.0.0.1:41234")``.

    Raises:
        ValueError: The path is not absolute, the file is missing on this
            host, or it is not a valid scenario (the message says which).
    """
    from stopline.activities.providers.registry import WIRE_TO_PROVIDER

    path = scenario_path(model)
    if not Path(path).is_absolute():
        raise ValueError(f"scripted model {model!r}: the scenario path must be absolute on the host")
    if not Path(path).is_file():
        raise ValueError(f"scripted model {model!r}: no scenario file {path} on this host")
    key = (task_id, path)
    now = time.monotonic()
    stale: list[ScriptedServer] = []
    with _lock:
        for k, (server, used) in list(_servers.items()):
            if k != key and now - used > IDLE_STOP_S:
                stale.append(server)
                del _servers[k]
        found = _servers.get(key)
        if found is None:
            server = ScriptedServer(path).start()  # ValueError for a malformed scenario
        else:
            server = found[0]
        _servers[key] = (server, now)
    for old in stale:
        old.stop()
    return f"{WIRE_TO_PROVIDER[server.wire]}:scripted", server.url
