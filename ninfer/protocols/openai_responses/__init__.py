"""OpenAI Responses: Items, request parsing, tools, the local store and the resources (``adapter``)."""
