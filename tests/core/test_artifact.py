"""The .ninfer container: round trip, zero-copy views, and clear errors for truncated, corrupt or foreign files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ninfer.core.artifact.container import Artifact, Identity, Manifest, tensor_entries, write_artifact
from ninfer.core.errors import ArtifactError

MANIFEST = Manifest(
    identity=Identity("tiny-test"),
    architecture="Qwen3_5ForConditionalGeneration",
    config={"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"model_type": "qwen3_5_text"}},
    companions=("mtp",),
    generation_defaults={"eos_token_ids": [1, 2]},
)


@pytest.fixture()
def artifact_path(tmp_path):
    tensors = {
        "model.language_model.embed_tokens.weight": torch.randn(10, 4, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(10, 4),
        "mtp.fc.weight": torch.arange(8, dtype=torch.int64).reshape(2, 4),
    }
    resources = {"frontend/chat_template.jinja": "{{ messages }} ✓".encode(), "tokenizer/tokenizer.json": b"{}"}
    path = write_artifact(tmp_path / "m.ninfer", MANIFEST, tensor_entries(tensors), resources)
    return path, tensors


def test_round_trip_and_independent_reader(artifact_path):
    path, tensors = artifact_path
    with Artifact.open(path) as artifact:
        assert artifact.manifest == MANIFEST
        assert artifact.manifest.text_model_type == "qwen3_5_text"
        assert artifact.tensor_names == list(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(artifact.tensor(name), tensor)
        assert artifact.resource_text("frontend/chat_template.jinja") == "{{ messages }} ✓"
        assert sorted(artifact.resource_names) == ["frontend/chat_template.jinja", "tokenizer/tokenizer.json"]
    with safe_open(str(path), "pt") as reader:  # any safetensors reader can open it
        assert torch.equal(reader.get_tensor("lm_head.weight"), tensors["lm_head.weight"])
        assert json.loads(reader.metadata()["ninfer.manifest"])["identity"]["model_id"] == "tiny-test"


def test_tensors_are_zero_copy_views_of_the_mapping(artifact_path):
    path, _ = artifact_path
    with Artifact.open(path) as artifact:
        first = artifact.tensor("lm_head.weight")
        second = artifact.tensor("lm_head.weight")
        assert first.data_ptr() == second.data_ptr()  # both views of the same mapped bytes, no copy


def test_truncated_file_names_file_and_tensor(artifact_path):
    path, _ = artifact_path
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(ArtifactError, match=rf"{path.name}.*truncated.*'mtp\.fc\.weight'|{path.name}.*truncated"):
        Artifact.open(path)
    path.write_bytes(data[:4])
    with pytest.raises(ArtifactError, match="truncated"):
        Artifact.open(path)


def test_corrupt_header(tmp_path):
    path = tmp_path / "bad.ninfer"
    header = b"{not json"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ArtifactError, match="bad.ninfer.*not valid JSON"):
        Artifact.open(path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ArtifactError, match="bad.ninfer"):
        Artifact.open(path)


def test_foreign_safetensors_file_is_rejected(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ArtifactError, match="not a ninfer artifact"):
        Artifact.open(path)


def test_malformed_manifest(tmp_path):
    path = tmp_path / "m.ninfer"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"ninfer.manifest": json.dumps({"format": "ninfer", "format_version": 1})})
    with pytest.raises(ArtifactError, match="manifest is incomplete or malformed"):
        Artifact.open(path)
    save_file({"w": torch.zeros(2)}, str(path), metadata={"ninfer.manifest": json.dumps({"format": "ninfer", "format_version": 99})})
    with pytest.raises(ArtifactError, match="format_version 99"):
        Artifact.open(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        Artifact.open(tmp_path / "missing.ninfer")
    with pytest.raises(ArtifactError, match="directory"):
        Artifact.open(tmp_path)


def test_missing_resource_and_tensor(artifact_path):
    path, _ = artifact_path
    with Artifact.open(path) as artifact:
        with pytest.raises(ArtifactError, match="no resource 'frontend/missing'"):
            artifact.resource("frontend/missing")
        with pytest.raises(ArtifactError, match="no tensor named 'nope'"):
            artifact.tensor("nope")
