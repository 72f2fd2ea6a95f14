"""The Qwen frontend: templates, vocabulary, prompt lowering, sampling presets, the output decoder."""
