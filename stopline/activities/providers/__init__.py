"""Provider adapters: Anthropic Messages, OpenAI Chat Completions, OpenAI
Responses (and any OpenAI-compatible server through a base URL)."""
