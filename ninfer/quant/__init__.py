"""Quantization formats as exact pure-torch codecs (CPU and CUDA alike): the element conversions
(``elements``), Hugging Face block-FP8 weights (``fp8``), NVFP4 weights (``nvfp4``) and the KV-cache codecs with
their Hadamard rotation (``kv_codecs``). Each function's docstring states its rounding, clamping, zero handling and
layout, and the source the convention was read from."""
