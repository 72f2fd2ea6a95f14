"""Benchmarks: ``ninfer bench`` through the engine, synthetic real-shape steps, speculative rounds."""
