"""Operational stderr log, request JSONL and throughput records."""
