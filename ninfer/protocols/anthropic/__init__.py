"""Anthropic Messages: request and history lowering, context editing and the resources (``adapter``)."""
