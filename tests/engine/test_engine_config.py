"""EngineConfig: validation, the serve-option mapping, pool sizing."""

from __future__ import annotations

import pytest

from ninfer.core.config import ServeConfig
from ninfer.core.descriptors import SamplingPreset
from ninfer.engine import Engine, EngineConfig
from ninfer.core.errors import ConfigError
from ninfer.core.plugins import load_plugin_manager
from engine_fakes import ChecksumRuntime


@pytest.mark.parametrize(
    "options, param",
    [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": 9}, "max_concurrency"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"kv_capacity": "lots"}, "kv_capacity"),
        ({"pending_timeout_ms": 0}, "pending_timeout_ms"),
        ({"device_state_slots": -1}, "device_state_slots"),
        ({"sampling_overrides": {"temprature": 1.0}}, "sampling_overrides"),
    ],
)
def test_invalid_engine_options(options, param):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**options)
    assert info.value.param == param


def test_from_serve_config_maps_every_engine_option():
    registries = load_plugin_manager(entry_points=False).registries
    serve = ServeConfig.build(
        registries,
        max_concurrency=3,
        max_pending_requests=5,
        pending_timeout_ms=1234,
        prefill_chunk=77,
        max_context=4096,
        device_state_slots=2,
        default_max_tokens=99,
        temperature=0.3,
        seed=-7,
        greedy=True,
    )
    config = EngineConfig.from_serve_config(serve)
    assert (config.max_concurrency, config.max_pending_requests, config.pending_timeout_ms) == (3, 5, 1234)
    assert (config.prefill_chunk, config.max_context, config.kv_capacity) == (77, 4096, 4096)
    assert (config.checkpoint_slots, config.default_max_tokens, config.greedy, config.prefix_reuse) == (2, 99, True, True)
    assert config.sampling_overrides["temperature"] == 0.3 and config.sampling_overrides["seed"] == -7
    assert config.sampling_overrides["top_p"] is None
    off = EngineConfig.from_serve_config(ServeConfig.build(registries, no_prefix_reuse=True, kv_capacity="auto"))
    assert off.checkpoint_slots == 0 and off.kv_capacity == "auto"


def test_pools_follow_the_config():
    config = EngineConfig(max_concurrency=3, device_state_slots=2, kv_capacity=100, page_size=16, max_context=64)
    with Engine(ChecksumRuntime(), config) as engine:
        memory = engine.stats().memory
        assert memory.total_slots == 5 and memory.total_pages == 7 and memory.kv_capacity_tokens == 100
    with Engine(ChecksumRuntime(), EngineConfig(max_concurrency=2, max_context=64)) as engine:
        assert engine.kv_capacity_tokens == 128  # CPU auto: max_context * max_concurrency
        assert engine.stats().memory.total_slots == 4  # H defaults to C


def test_engine_resolve_sampling_applies_process_overrides():
    config = EngineConfig(max_context=64, sampling_overrides={"top_p": 0.5, "seed": 9}, greedy=False)
    with Engine(ChecksumRuntime(), config) as engine:
        params = engine.resolve_sampling(SamplingPreset(1.0, 0.95, 20, 0.0, 0.0), {"min_p": 0.1})
    assert (params.temperature, params.top_p, params.min_p, params.seed) == (1.0, 0.5, 0.1, 9)
