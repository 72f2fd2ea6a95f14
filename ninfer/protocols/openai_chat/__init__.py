"""OpenAI Chat Completions: request parsing (``request``, ``messages``) and the resource (``adapter``)."""
