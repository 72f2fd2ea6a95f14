"""``ninfer serve`` of a tiny FP8 artifact (converted from a checkpoint in the official block-FP8 layout): one chat
request through the real HTTP server, on the CPU reference path."""

from __future__ import annotations

import pytest
from live_server import has_family, start_servers
from quantized_checkpoints import quantized_checkpoint, tiny_dense

from ninfer.core.artifact.container import Artifact
from ninfer.core.artifact.convert import convert_checkpoint

MODEL_ID = "tiny-fp8"


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory: pytest.TempPathFactory):
    if not has_family("qwen3_5"):
        pytest.skip("the 'qwen3_5' model family is not installed")
    root = tmp_path_factory.mktemp("fp8-serve")
    artifact = convert_checkpoint(quantized_checkpoint(root / MODEL_ID, tiny_dense(), "fp8"), root / "fp8.ninfer")
    with Artifact.open(artifact) as opened:
        assert opened.manifest.weight_format["quantization"] == {"fp8_block 128x128": len(opened.manifest.quantized)}
    [server] = start_servers(root, [(artifact, ["--no-thinking"], {})], [MODEL_ID])
    yield server
    server.stop()


def test_a_chat_request_is_served_from_fp8_weights(fp8_server):
    completion = fp8_server.client().chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens >= 1 and completion.usage.prompt_tokens > 1
