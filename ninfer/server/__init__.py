"""The server room: startup, the composition root, the falcon app, HTTP helpers and the request lifecycle."""
