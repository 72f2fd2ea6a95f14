"""The Qwen3.5/3.6/3.8 text model: config, weights, layers, the eager runtime, tiny and synthetic checkpoints."""
