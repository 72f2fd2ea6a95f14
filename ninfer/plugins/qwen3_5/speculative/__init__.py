"""Qwen drafters: MTP, DFlash, DFlash2, and the DFlash companion checkpoint format."""
