"""stopline: durable LLM agent tasks on Temporal, where every way a turn can
end is a clean, recorded, honest outcome.

The public API (``docs/library.md`` shows each piece in use):

- plug into your own Temporal client and worker: :class:`StoplinePlugin`,
  :func:`connect`, :func:`build_workers`;
- your activities as the agent's tools: :func:`activity_tool`,
  :class:`ActivityTool`, :class:`FatalToolError`;
- start agent tasks from your own workflows: :func:`start_agent_task`,
  :func:`execute_agent_task`; from a client: ``client.start_workflow(
  AGENT_TASK_WORKFLOW, AgentTaskInput(...))`` and :func:`task_result`;
- the contracts: :class:`AgentTaskInput`, :class:`ChatThreadInput`,
  :class:`TaskLimits`, :class:`AgentTaskResult`, :class:`TaskStatus`,
  :class:`InterruptResult`;
- one exception root: :class:`StoplineError`;
- ``stopline.testing``: the scripted provider server for your own tests.

Names are imported on first use: ``import stopline`` itself loads nothing
heavy, so workflow code (which the sandbox re-imports) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: name -> module it lives in (imported on first access).
_EXPORTS: dict[str, str] = {
    "AGENT_TASK_WORKFLOW": "stopline.core.contracts",
    "CHAT_THREAD_WORKFLOW": "stopline.core.contracts",
    "ActivityTool": "stopline.core.contracts",
    "AgentTaskInput": "stopline.core.contracts",
    "AgentTaskResult": "stopline.core.contracts",
    "ChatThreadInput": "stopline.core.contracts",
    "InterruptResult": "stopline.core.contracts",
    "TaskLimits": "stopline.core.contracts",
    "TaskStatus": "stopline.core.contracts",
    "FatalToolError": "stopline.core.errors",
    "StoplineError": "stopline.core.errors",
    "activity_tool": "stopline.core.tools",
    "execute_agent_task": "stopline.workflows.child",
    "start_agent_task": "stopline.workflows.child",
    "StoplinePlugin": "stopline.worker.plugin",
    "build_workers": "stopline.worker.runtime",
    "connect": "stopline.worker.runtime",
    "task_result": "stopline.worker.runtime",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stopline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
