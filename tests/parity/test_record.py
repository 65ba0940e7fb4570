"""Recording: what a parity recording holds, when blocks run eagerly, and atomic writes."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from safetensors import safe_open

import omniloop_parity as op
from omniloop.request import TaskType
from omniloop_parity import recording as recording_mod


def test_recording_holds_taps_per_step_and_branch_and_the_final_video(h, recording_runtime):
    rt = recording_runtime()
    rec = op.record(rt, h.REQUEST)
    keys = rec.keys
    assert keys[:4] == ["step000/cond/noise_pred", "step000/uncond/noise_pred", "step000/guided", "step000/latents"]
    assert "step003/latents" in keys and keys[-2:] == ["final/video", "final/latents"]
    assert not any("blocks" in k for k in keys)
    assert rec["final/video"].dtype.is_floating_point is False and tuple(rec["final/video"].shape) == (3, 16, 16, 3)
    e = rec.entry("step002/uncond/noise_pred")
    assert (e.node, e.step, e.branch, e.name, e.kind) == ("denoise", 2, "uncond", "noise_pred", "tap")
    assert e.timestep == pytest.approx(500.0)


def test_manifest_holds_request_seed_deploy_versions_device(h, recording_runtime, tmp_path):
    rt = recording_runtime()
    out = tmp_path / "run.safetensors"
    op.record(rt, h.REQUEST, out=out)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    m = json.loads(meta["omniloop_parity"])
    assert m["format"] == op.FORMAT
    assert m["request"]["inputs"][0]["text"] == "a red cube rolling"
    assert m["seed"] == 7 and m["family"] == "toy" and m["task"] == "t2v"
    assert m["deploy"]["model"]["path"] == str(rt.deploy.model.path)
    assert m["device"] == "cpu" and m["dtype"] == "float32"
    assert m["torch"] and "omniloop" in m["versions"] and "torch" in m["versions"]
    assert m["taps"][0]["key"] == "step000/cond/noise_pred"
    loaded = op.Recording.load(out)
    assert loaded.keys == [t["key"] for t in m["taps"]]


def test_block_taps_are_recorded_only_when_asked_and_force_eager(h, recording_runtime, caplog):
    plain = recording_runtime()
    assert plain.pipeline(TaskType.T2V).eager is False
    assert plain.components_enabled["parity"][1].needs_eager is False
    with caplog.at_level(logging.INFO):
        rt = recording_runtime(blocks=r"blocks\.(1|3)$")
    assert rt.components_enabled["parity"][1].needs_eager is True
    assert "blocks run eagerly" in caplog.text
    assert rt.pipeline(TaskType.T2V).eager is True
    rec = op.record(rt, h.REQUEST)
    blocks = [k for k in rec.keys if "blocks" in k]
    assert blocks[:4] == [
        "step000/cond/blocks.1",
        "step000/cond/blocks.3",
        "step000/uncond/blocks.1",
        "step000/uncond/blocks.3",
    ]
    assert len(blocks) == 4 * 2 * 2
    assert rec.entry("step000/cond/blocks.3").block == 3


def test_taps_pattern_filters_what_is_recorded(h, recording_runtime):
    rec = op.record(recording_runtime(taps="^latents$", final=False), h.REQUEST)
    assert rec.keys == [f"step{i:03d}/latents" for i in range(4)]


def test_recorder_writes_per_request_files_from_a_deploy(h, recording_runtime, tmp_path):
    rt = recording_runtime(out=str(tmp_path / "rec-{request_id}.safetensors"))
    out = rt.generate({**h.REQUEST, "request_id": "abc123"})
    assert out.ok
    path = tmp_path / "rec-abc123.safetensors"
    assert path.is_file()
    rec = op.Recording.load(path)
    # enabled in a deploy (not through op.record): the deploy arrives with omniloop_request_start
    assert rec.manifest["deploy"]["model"]["path"].endswith("toy") and rec.manifest["device"] == "cpu"
    assert "parity" in rec.manifest["deploy"]["plugins"]


def test_interleaved_requests_do_not_mix(h, recording_runtime):
    rt = recording_runtime()
    recorder = op.recorder_of(rt)
    a = rt.prepare({**h.REQUEST, "request_id": "a"})
    b = rt.prepare({**h.REQUEST, "prompt": "a blue ball", "request_id": "b"})
    while not (a.done and b.done):
        a.advance()
        b.advance()
    ra, rb = recorder.take("a"), recorder.take("b")
    assert ra.manifest["request_id"] == "a" and rb.manifest["request"]["inputs"][0]["text"] == "a blue ball"
    solo = op.record(rt, {**h.REQUEST, "request_id": "a2"})
    assert op.compare(solo, ra).passed
    assert not op.compare(solo, rb).passed


def test_atomic_write_leaves_no_file_when_the_write_fails(h, tmp_path, monkeypatch, recording_runtime):
    rec = op.record(recording_runtime(), h.REQUEST)
    real = recording_mod.save_file

    def half_then_fail(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(recording_mod, "save_file", half_then_fail)
    target = tmp_path / "golden.safetensors"
    with pytest.raises(OSError, match="No space"):
        rec.save(target)
    assert list(tmp_path.iterdir()) == []  # neither the final file nor the temporary one


def test_a_failed_write_keeps_the_previous_complete_file(h, tmp_path, monkeypatch, recording_runtime):
    rt = recording_runtime()
    target = tmp_path / "r.safetensors"
    op.record(rt, h.REQUEST, out=target)
    before = target.read_bytes()

    def fail(*_a, **_k):
        raise KeyboardInterrupt  # an interrupt mid-write

    monkeypatch.setattr(recording_mod, "save_file", fail)
    rec = op.record(rt, h.REQUEST)
    with pytest.raises(KeyboardInterrupt):
        rec.save(target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.safetensors"]


def test_observer_write_failure_does_not_fail_the_request(h, tmp_path, monkeypatch, recording_runtime):
    monkeypatch.setattr(recording_mod, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    rt = recording_runtime(out=str(tmp_path / "x.safetensors"))
    out = rt.generate({**h.REQUEST, "request_id": "r1"})
    assert out.ok
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(op.ParityError, match="disk full"):
        op.recorder_of(rt).take("r1")


def test_a_run_that_fails_mid_loop_leaves_no_recording(h, tmp_path, recording_runtime):
    rt = recording_runtime(
        ("fail", h.InterceptorPlugin(h.FailAtStep(k=0, step=2))),
        plugins={"fail-at": {}},
        out=str(tmp_path / "x.safetensors"),
    )
    out = rt.generate(h.REQUEST)
    assert not out.ok and "boom at step 2" in out.error.message
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(op.ParityError, match="did not complete"):
        op.record(rt, h.REQUEST)


def test_load_rejects_files_that_are_not_recordings(tmp_path):
    import torch
    from safetensors.torch import save_file

    with pytest.raises(op.ParityError, match="not found"):
        op.Recording.load(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(op.ParityError, match="not a readable safetensors"):
        op.Recording.load(junk)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(op.ParityError, match="not a parity recording"):
        op.Recording.load(plain)


def test_invalid_regex_in_config_is_a_deploy_error(ckpt):
    from omniloop.errors import DeployError
    from omniloop.testing import toy_runtime
    from omniloop_parity import plugin

    with pytest.raises(DeployError, match="blocks"):
        toy_runtime(ckpt, ("parity", plugin), plugins={"parity": {"blocks": "blocks.(1"}})


# -- issue 14: request ids never choose where a recording goes -------------------------------------


@pytest.mark.parametrize("template, words", [
    ("/tmp/{request_id}/rec.safetensors", "file name"),
    ("/tmp/rec-{foo}.safetensors", "only placeholder"),
    ("/tmp/rec-{request_id.__class__}.safetensors", "only placeholder"),
    ("/tmp/rec-{0}.safetensors", "only placeholder"),
    ("/tmp/rec-{request_id.safetensors", "malformed"),
])
def test_out_templates_are_checked_at_deploy(ckpt, template, words):
    from omniloop.errors import DeployError
    from omniloop.testing import toy_runtime
    from omniloop_parity import plugin

    with pytest.raises(DeployError, match=words):
        toy_runtime(ckpt, ("parity", plugin), plugins={"parity": {"out": template}})


@pytest.mark.parametrize("rid", ["../../escape", "/abs/x", "..", "a/b\x00c", ".hidden", "\ud800"])
def test_a_hostile_request_id_stays_in_the_recording_folder(tmp_path, rid):
    """The recorder's own line of defence (the core already refuses these ids on every entry)."""
    from omniloop_parity.config import out_path

    folder = tmp_path / "recs"
    path = out_path(str(folder / "rec-{request_id}.safetensors"), rid)
    assert path.parent == folder and "/" not in path.name[len("rec-"):] and "\x00" not in str(path)
    assert path.name.startswith("rec-") and path.name.endswith(".safetensors")
    assert re.search(r"-[0-9a-f]{8}\.safetensors$", path.name)  # a changed id carries its hash


def test_ids_that_sanitise_alike_get_different_files(tmp_path):
    from omniloop_parity.config import out_path

    t = str(tmp_path / "rec-{request_id}.safetensors")
    assert out_path(t, "a_b").name == "rec-a_b.safetensors"  # a valid id is used as it is
    names = {out_path(t, rid).name for rid in ("a_b", "a/b", "a\\b", "a b")}
    assert len(names) == 4


def test_a_request_built_in_python_with_a_path_like_id_is_refused_before_anything_runs(h, recording_runtime, tmp_path):
    """An OmniRequest object skips the converter, but Runtime.prepare holds it to the same rules:
    the path-like id is refused naming request_id, and no recording is written anywhere."""
    import attrs

    from omniloop.errors import RequestError
    from omniloop.schema import request_from_dict

    folder = tmp_path / "recs"
    rt = recording_runtime(out=str(folder / "rec-{request_id}.safetensors"))
    req = attrs.evolve(request_from_dict(h.REQUEST), request_id="../../escaped")  # skips the schema
    with pytest.raises(RequestError) as err:
        rt.generate(req)
    assert err.value.path == "request_id" and "../../escaped" in str(err.value)
    assert not folder.exists() or not list(folder.iterdir())
    assert not list(tmp_path.glob("escaped*")) and not list(tmp_path.parent.glob("escaped*"))


def test_a_malformed_manifest_is_a_parity_error(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from omniloop_parity.recording import FORMAT, META_KEY

    for manifest in ([1], {"format": FORMAT, "taps": [{"node": "x"}]}, {"format": FORMAT, "taps": 5}):
        p = tmp_path / "m.safetensors"
        save_file({"x": torch.zeros(1)}, str(p), metadata={META_KEY: json.dumps(manifest)})
        with pytest.raises(op.ParityError, match="manifest"):
            op.Recording.load(p)


def test_stale_temp_files_of_killed_writes_are_cleaned_on_the_next_write(tmp_path):
    import os
    import time

    import torch

    from omniloop_parity.recording import STALE_TEMP_SECONDS, write_atomic

    stale, fresh, other = (tmp_path / n for n in (".a.safetensors.k2j_9xq1.tmp", ".b.safetensors.abcdefgh.tmp", ".c.tmp"))
    for p in (stale, fresh, other):
        p.write_bytes(b"partial")
    past = time.time() - 2 * STALE_TEMP_SECONDS
    for p in (stale, other):
        os.utime(p, (past, past))
    write_atomic(tmp_path / "r.safetensors", {"x": torch.zeros(1)}, {})
    assert not stale.exists() and fresh.exists() and other.exists()
