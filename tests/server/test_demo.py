"""The embedded demo: ``ninfer serve`` with no artifact serves a tiny random-weight Qwen model on CPU."""

from __future__ import annotations

from pathlib import Path

from ninfer.server.demo import DEMO_OPTIONS, demo_artifact_path
from ninfer.core.plugins import load_plugin_manager

from live_server import start_servers

DEMO_MODEL = DEMO_OPTIONS.model_id


def test_demo_artifact_is_generated_deterministically(tmp_path, monkeypatch):
    registries = load_plugin_manager(entry_points=False).registries
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "one"))
    first = demo_artifact_path(registries)
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "two"))
    second = demo_artifact_path(registries)
    assert first != second and first.read_bytes() == second.read_bytes()
    stamp = second.stat().st_mtime_ns
    assert demo_artifact_path(registries) == second and second.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_serve_without_artifact_serves_the_demo(tmp_path: Path):
    cache = tmp_path / "cache"
    [server] = start_servers(tmp_path, [(None, ["--max-context", "512"], {"NINFER_CACHE_DIR": str(cache)})], [DEMO_MODEL])
    try:
        assert "its weights are random" in server.log()
        assert len(list(cache.glob("demo-*.ninfer"))) == 1
        client = server.client()
        assert [model.id for model in client.models.list()] == [DEMO_MODEL]
        reply = client.chat.completions.create(
            model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
        assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    finally:
        assert server.stop() == 0
