"""Artifacts: the ``.ninfer`` container, a Hugging Face directory seen through the same API, convert, tiny."""
