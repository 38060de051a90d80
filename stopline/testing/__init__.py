"""Testing helpers for stopline users: the scripted provider server.

:class:`ScriptedServer` serves recorded provider responses (Anthropic
Messages, OpenAI Chat Completions, OpenAI Responses) over real HTTP, in
order, and records every request it receives; the builders make scenarios.
"""

from stopline.testing.scripted import (
    ScriptedServer,
    anthropic_message,
    entry,
    load_scenario,
    openai_chat_completion,
    openai_response,
    scenario,
    serve,
)

__all__ = [
    "ScriptedServer",
    "anthropic_message",
    "entry",
    "load_scenario",
    "openai_chat_completion",
    "openai_response",
    "scenario",
    "serve",
]
