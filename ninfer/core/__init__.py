"""The contracts of ninfer: hook specs, descriptors, the request and runtime contracts, config, errors, artifacts.

Nothing here imports the engine, the server, a protocol, observability or a plugin (tests/house checks it).
"""
