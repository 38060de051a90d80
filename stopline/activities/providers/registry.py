"""Which adapter speaks for which provider id.

Why it exists: a task names its model as ``provider:model`` (e.g.
``anthropic:claude-sonnet-4-5``, ``openai-compat:llama3.1:8b``); this module
is the one place that splits such a reference and maps the provider id onto
an adapter. It decides nothing about base URLs or keys (the sampling activity
reads those from settings) and must never pick a *different* provider than
the one named: switching model is a policy decision (DESIGN §4), never a
fallback here.
"""

from __future__ import annotations

from stopline.activities.providers.anthropic import AnthropicAdapter
from stopline.activities.providers.base import ProviderAdapter
from stopline.activities.providers.openai_chat import OpenAIChatAdapter
from stopline.activities.providers.openai_responses import OpenAIResponsesAdapter

#: Provider ids a model reference may name.
PROVIDERS: tuple[str, ...] = ("anthropic", "openai", "openai-compat", "openai-responses")

#: The scripted server's wire names (``stopline.testing.scripted.WIRES``) → the
#: provider id whose adapter speaks that wire.
WIRE_TO_PROVIDER: dict[str, str] = {
    "anthropic": "anthropic",
    "openai-chat": "openai",
    "openai-responses": "openai-responses",
}


def parse_model_ref(ref: str) -> tuple[str, str]:
    """Split ``provider:model`` at the first colon.

    The model part may itself hold colons (Ollama tags:
    ``openai-compat:llama3.1:8b`` → ``("openai-compat", "llama3.1:8b")``).

    Args:
        ref: The model reference.

    Returns:
        ``(provider, model)``.

    Raises:
        ValueError: No colon, an empty model, or an unknown provider; the
            message lists the known providers.
    """
    provider, sep, model = ref.partition(":")
    known = ", ".join(PROVIDERS)
    if not sep:
        raise ValueError(f"model reference {ref!r} must be 'provider:model' (providers: {known})")
    provider = provider.strip()
    model = model.strip()
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r} in model reference {ref!r} (providers: {known})")
    if not model:
        raise ValueError(f"model reference {ref!r} names no model after {provider + ':'!r}")
    return provider, model


def get_adapter(provider: str) -> ProviderAdapter:
    """The adapter for a provider id.

    ``openai`` and ``openai-compat`` share the Chat Completions adapter (the
    caller passes the compatible server's base URL); ``openai-responses`` is
    the Responses API. Adapters hold no state, so a new one is cheap.

    Args:
        provider: One of :data:`PROVIDERS`.

    Returns:
        The adapter; its ``provider`` attribute is ``provider``.

    Raises:
        ValueError: Unknown provider.
    """
    if provider == "anthropic":
        return AnthropicAdapter()
    if provider in ("openai", "openai-compat"):
        return OpenAIChatAdapter(provider)
    if provider == "openai-responses":
        return OpenAIResponsesAdapter(provider)
    raise ValueError(f"unknown provider {provider!r} (providers: {', '.join(PROVIDERS)})")
