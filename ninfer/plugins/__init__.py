"""Built-in plugins. Each module listed here registers through the same hooks a third-party plugin uses."""

BUILTIN_PLUGINS = (
    "ninfer.plugins.qwen3_5",
    "ninfer.plugins.speculative",
    "ninfer.plugins.kv_dtypes",
    "ninfer.protocols.builtin",
)
