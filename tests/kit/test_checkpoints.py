"""omniloop_kit.checkpoints (omniloop.checkpoints before 0.2): the family-independent checks of a diffusers-format checkpoint folder."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from omniloop.errors import CheckpointError
from omniloop_kit import checkpoints


def write_safetensors(path: Path, n_floats: int = 4, *, cut: int = 0) -> None:
    """A float32 safetensors file with one tensor ``w`` of ``n_floats`` values, ``cut`` bytes short."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}).encode()
    data = struct.pack("<Q", len(header)) + header + bytes(4 * n_floats)
    path.write_bytes(data[: len(data) - cut])


def test_check_safetensors_reads_the_header(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    write_safetensors(f)
    assert checkpoints.check_safetensors(f)["w"]["shape"] == [4]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"abc", "weight file is truncated (3 bytes, no safetensors header)"),
        (struct.pack("<Q", 10**9) + b"{}", "not a safetensors file (header length 1000000000 is not plausible)"),
        (struct.pack("<Q", 50) + b"{}", "weight file is truncated (10 bytes, shorter than its 50-byte header); re-download it"),
        (struct.pack("<Q", 2) + b"[]", "safetensors header is not a JSON object"),
        (struct.pack("<Q", 2) + b"{x", "safetensors header is unreadable"),
        (struct.pack("<Q", 11) + b'{"w": null}', "safetensors header entry 'w' is malformed"),
    ],
)
def test_check_safetensors_refuses_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(content)
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{f}: {message}")):
        checkpoints.check_safetensors(f)


def test_check_safetensors_truncated_data_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    write_safetensors(f, cut=3)
    with pytest.raises(CheckpointError, match=r"weight file is truncated \(\d+ bytes, the header declares \d+\); re-download it"):
        checkpoints.check_safetensors(f)
    link = tmp_path / "gone.safetensors"
    link.symlink_to(tmp_path / "blob")
    with pytest.raises(CheckpointError, match=r"weight file is missing \(a link to a missing blob"):
        checkpoints.check_safetensors(link)


def test_read_json(tmp_path: Path) -> None:
    f = tmp_path / "config.json"
    with pytest.raises(CheckpointError, match=r"config\.json: vae config is missing$"):
        checkpoints.read_json(f, "vae config")
    f.write_text("[1]")
    with pytest.raises(CheckpointError, match="vae config must be a JSON object, not list"):
        checkpoints.read_json(f, "vae config")
    f.write_text("{")
    with pytest.raises(CheckpointError, match="vae config is not valid JSON"):
        checkpoints.read_json(f, "vae config")
    f.write_text('{"a": 1}')
    assert checkpoints.read_json(f, "vae config") == {"a": 1}


def test_weight_files_sharded_single_and_bin(tmp_path: Path) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=r"transformer: no weights \(m\.safetensors or m\.safetensors\.index\.json\)"):
        checkpoints.weight_files(folder, "m")
    (folder / "a.bin").write_bytes(b"")
    assert checkpoints.weight_files(folder, "m") == [folder / "a.bin"]
    with pytest.raises(CheckpointError, match="no weights"):
        checkpoints.weight_files(folder, "m", allow_bin=False)
    index = folder / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "m-1.safetensors", "v": "m-2.safetensors"}}))
    write_safetensors(folder / "m-1.safetensors")
    write_safetensors(folder / "m-2.safetensors")
    assert checkpoints.weight_files(folder, "m") == [folder / "m-1.safetensors", folder / "m-2.safetensors"]
    index.write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"weight_map names an invalid shard '\.\./outside\.safetensors'"):
        checkpoints.weight_files(folder, "m")
    index.write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match="weight index has no weight_map"):
        checkpoints.weight_files(folder, "m")
    write_safetensors(folder / "m.safetensors")
    assert checkpoints.weight_files(folder, "m") == [folder / "m.safetensors"]


def test_model_index_component_folder_and_model_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint folder does not exist"):
        checkpoints.read_model_index(tmp_path / "nope")
    (tmp_path / "model_index.json").write_text('{"_class_name": "X", "vae": ["diffusers", "AutoencoderKL"]}')
    assert checkpoints.read_model_index(tmp_path)["vae"] == ["diffusers", "AutoencoderKL"]
    with pytest.raises(CheckpointError, match=r"vae: folder of component 'vae' is missing"):
        checkpoints.component_folder(tmp_path, "vae")
    (tmp_path / "vae").mkdir()
    folder = checkpoints.component_folder(tmp_path, "vae")
    (folder / "config.json").write_text('{"latent_channels": 4}')
    write_safetensors(folder / "diffusion_pytorch_model.safetensors")
    assert checkpoints.model_folder(folder, "vae", "diffusion_pytorch_model") == {"latent_channels": 4}
    v1 = checkpoints.weight_version(tmp_path, ["vae"])
    write_safetensors(folder / "diffusion_pytorch_model.safetensors", n_floats=8)
    assert checkpoints.weight_version(tmp_path, ["vae"]) != v1


def test_resolve_root_follows_a_hf_cache_folder(tmp_path: Path) -> None:
    cache = tmp_path / "models--Org--Name"
    (cache / "snapshots" / "abc").mkdir(parents=True)
    (cache / "snapshots" / "def").mkdir()
    assert checkpoints.resolve_root(cache) == cache  # two snapshots, no ref: unchanged
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("def\n")
    assert checkpoints.resolve_root(cache) == cache / "snapshots" / "def"
    (tmp_path / "plain").mkdir()
    assert checkpoints.resolve_root(tmp_path / "plain") == tmp_path / "plain"


def test_peek_json_and_looks_like(tmp_path: Path) -> None:
    assert checkpoints.peek_json(tmp_path / "model_index.json") is None
    assert not checkpoints.looks_like(tmp_path, ("XPipeline",), "XModel")
    assert not checkpoints.looks_like(tmp_path / "nope", ("XPipeline",), "XModel")
    (tmp_path / "model_index.json").write_text("[]")
    assert checkpoints.peek_json(tmp_path / "model_index.json") is None
    (tmp_path / "model_index.json").write_text('{"_class_name": "XPipeline"}')
    assert checkpoints.looks_like(tmp_path, ("XPipeline",), "XModel")
    (tmp_path / "model_index.json").write_text('{"_class_name": "OtherPipeline"}')
    assert not checkpoints.looks_like(tmp_path, ("XPipeline",), "XModel")  # no transformer config
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"_class_name": "XModel", "in_channels": "wide"}')
    assert checkpoints.looks_like(tmp_path, ("XPipeline",), "XModel")
    assert not checkpoints.looks_like(tmp_path, ("XPipeline",), "YModel")
    assert not checkpoints.looks_like(tmp_path, ("XPipeline",), "XModel", lambda root, index, tf: int(tf["in_channels"]) > 0)
    assert checkpoints.looks_like(tmp_path, ("XPipeline",), "XModel", lambda root, index, tf: index["_class_name"] == "OtherPipeline")
