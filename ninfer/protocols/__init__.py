"""HTTP layer: the falcon ASGI app and one adapter module per wire protocol."""
