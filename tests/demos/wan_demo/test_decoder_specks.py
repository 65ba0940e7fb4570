"""training/decoder_specks.py: the speck targets (a speck replaced by the static background of the
nearest free frame; duplicates and clean clips left out) and one CPU run of the fine-tune on a tiny
random VAE (the decoder trains, the encoder does not move, the result loads)."""

import json

import numpy as np
import pytest
import torch

from omniloop_wan_demo.evaluate import detect
from omniloop_wan_demo_training import decoder_specks
from omniloop_wan_demo_training.common import VAE_CONFIG, build_vae

torch.set_num_threads(2)


def _clip(*, speck_frames=(), duplicate=False):
    """17 frames of a red 10x10 square moving right over a textured static grey background; a green
    4x4 speck 20 px above the square in ``speck_frames``; a second square throughout if ``duplicate``."""
    rng = np.random.default_rng(0)
    bg = 0.45 + 0.03 * rng.standard_normal((64, 64, 1)).repeat(3, -1)
    v = np.repeat(bg[None], 17, 0)
    for t in range(17):
        x = 8 + 2 * t
        v[t, 30:40, x : x + 10] = (0.9, 0.15, 0.12)
        if duplicate:
            v[t, 5:15, x : x + 10] = (0.9, 0.15, 0.12)
        if t in speck_frames:
            v[t, 10:14, x : x + 4] = (0.25, 0.75, 0.4)
    return (v.clip(0, 1) * 255).round().astype(np.uint8), bg


def test_speck_target_puts_back_the_static_background():
    clip, bg = _clip(speck_frames=(16,))
    assert detect(clip).ghost_frames == 1
    target, mask = decoder_specks.speck_target(clip)
    assert mask[16].sum() >= 16 and mask[:16].sum() == 0          # the speck (dilated) in frame 16 only
    assert detect((target * 255).round().astype(np.uint8)).ghost_frames == 0
    ys, xs = np.nonzero(mask[16])
    # the speck's pixels are the background's (taken from an earlier frame where they are free)
    np.testing.assert_allclose(target[16, ys, xs], np.round(bg[ys, xs].clip(0, 1) * 255) / 255, atol=1e-6)
    keep = ~mask
    np.testing.assert_array_equal(target[keep], (clip[keep] / 255.0).astype(target.dtype))  # nothing else changes


def test_speck_target_leaves_out_clean_clips_and_duplicates():
    assert decoder_specks.speck_target(_clip()[0]) is None
    assert decoder_specks.speck_target(_clip(duplicate=True)[0]) is None


def test_main_trains_the_decoder_only(tmp_path):
    torch.manual_seed(0)
    vae = build_vae({**VAE_CONFIG, "base_dim": 4})
    (tmp_path / "v").mkdir()
    vae.save_pretrained(str(tmp_path / "v" / "vae"))
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    lat = torch.randn(4, 16, 5, 16, 16)
    torch.save({"latents": lat}, tmp_path / "lat.pt")
    # a random decoder's clips: make sure at least one is a speck clip by patching the target builder
    real = decoder_specks.speck_target
    calls = []

    def fake(video):
        calls.append(1)
        if len(calls) == 1:
            mask = np.zeros(video.shape[:3], dtype=bool)
            mask[3, :4, :4] = True
            return video / 255.0, mask
        return None

    decoder_specks.speck_target = fake
    try:
        rc = decoder_specks.main(["--latents", str(tmp_path / "lat.pt"), "--out", str(tmp_path / "out"),
                                  "--vae-from", str(tmp_path / "v" / "vae"), "--max-steps", "2", "--batch", "1",
                                  "--lr", "0.05", "--recon-check", "0", "--examples", str(tmp_path / "ex.pt")])
    finally:
        decoder_specks.speck_target = real
    assert rc == 0
    info = json.loads((tmp_path / "out" / "decoder_specks.json").read_text())
    assert info["steps"] == 2 and info["speck_clips"] == 1 and info["other_clips"] == 3
    ex = torch.load(tmp_path / "ex.pt")  # the decoded examples, kept for a second run on the same latents
    assert ex["speck_z"].shape == (1, 16, 5, 16, 16) and ex["ok_x"].shape[0] == 3
    from diffusers import AutoencoderKLWan

    after = AutoencoderKLWan.from_pretrained(str(tmp_path / "out" / "vae"), torch_dtype=torch.float32).state_dict()
    moved = {k for k in before if not torch.equal(before[k].half().float(), after[k])}
    assert moved and all(not k.startswith(("encoder.", "quant_conv.")) for k in moved)
    assert any(k.startswith("decoder.") for k in moved)


def test_render_batch_draws_the_focus_label_and_is_unchanged_without_it():
    from omniloop_wan_demo.evaluate import detect as read
    from omniloop_wan_demo_training.render import render, sample_params, to_uint8_frames

    x, cov = decoder_specks.render_batch(4, 7, focus=("red", "star"), focus_frac=0.5)
    assert x.shape[0] == cov.shape[0] == 4 and float(x.min()) >= -1 and float(x.max()) <= 1
    got = [read(to_uint8_frames((x[k] + 1) / 2)) for k in range(4)]
    assert all(d.color == "red" and d.shape == "star" for d in got[:2])
    x0, cov0 = decoder_specks.render_batch(3, 11)
    ref, ref_cov = render(sample_params(3, 11), return_mask=True)
    torch.testing.assert_close(x0, ref * 2 - 1, rtol=0, atol=0)
    torch.testing.assert_close(cov0, ref_cov, rtol=0, atol=0)
    assert decoder_specks.parse_focus("red") == ("red", None) and decoder_specks.parse_focus("red:star") == ("red", "star")


def test_misread_clips_are_left_out_and_focus_trains_without_specks(tmp_path, monkeypatch):
    """With the latents' prompts, a decode whose shape the detector misreads is not kept (it would
    teach the decoder its miss); with no speck clip at all, --focus still trains on rendered clips."""
    import omniloop_wan_demo.evaluate as ev

    torch.manual_seed(0)
    vae = build_vae({**VAE_CONFIG, "base_dim": 4})
    vae.save_pretrained(str(tmp_path / "vae"))
    torch.save({"latents": torch.randn(3, 16, 5, 16, 16), "prompts": ["a red star moving up"] * 3}, tmp_path / "lat.pt")
    reads = iter(["star", "circle", "star"])

    class Read:
        def __init__(self, shape):
            self.shape = shape

    monkeypatch.setattr(decoder_specks, "speck_target", lambda video: None)
    monkeypatch.setattr(ev, "detect", lambda video, **kw: Read(next(reads)))
    argv = ["--latents", str(tmp_path / "lat.pt"), "--out", str(tmp_path / "out"), "--vae-from", str(tmp_path / "vae"),
            "--max-steps", "1", "--batch", "2", "--recon-check", "0"]
    with pytest.raises(SystemExit, match="--focus"):   # nothing to learn without a speck clip or a focus
        decoder_specks.main(argv)
    reads = iter(["star", "circle", "star"])
    assert decoder_specks.main([*argv, "--focus", "red:star"]) == 0
    info = json.loads((tmp_path / "out" / "decoder_specks.json").read_text())
    assert (info["speck_clips"], info["other_clips"], info["misread_clips_left_out"], info["steps"]) == (0, 2, 1, 1)


@pytest.mark.parametrize("argv, msg", [
    (["--seconds", "nan"], "--seconds"),
    (["--lr", "0"], "--lr"),
    (["--batch", "0"], "--batch"),
    (["--focus", "purple"], "--focus"),
    (["--focus", "red:hexagon"], "--focus"),
    (["--focus", "red", "--focus-frac", "1.5"], "--focus-frac"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, argv, msg):
    (tmp_path / "lat.pt").write_bytes(b"")
    with pytest.raises(SystemExit):
        decoder_specks.main(["--latents", str(tmp_path / "lat.pt"), "--out", str(tmp_path / "o"), *argv])
    assert msg in capsys.readouterr().err


def test_dmd_fast_vae_from_must_be_a_vae_folder(tmp_path, capsys):
    from omniloop_wan_demo_training import dmd_fast

    with pytest.raises(SystemExit):
        dmd_fast.parse_args(["--out", str(tmp_path / "o"), "--eval-only", "v2", "--vae-from", str(tmp_path)])
    assert "--vae-from" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert dmd_fast.parse_args(["--out", str(tmp_path / "o"), "--eval-only", "v2", "--vae-from", str(tmp_path)]).vae_from


def _tiny_package(tmp_path):
    """A package folder with checkpoint/vae (a tiny VAE) and the students' links to it."""
    import os

    torch.manual_seed(0)
    vae = build_vae({**VAE_CONFIG, "base_dim": 4})
    pkg = tmp_path / "pkg"
    vae.save_pretrained(str(pkg / "checkpoint" / "vae"))
    for student in ("checkpoint_causal", "checkpoint_fast"):
        (pkg / student).mkdir()
        (pkg / student / "vae").symlink_to(os.path.relpath(pkg / "checkpoint" / "vae", pkg / student))
    return pkg, vae


def _decoder_tuned(vae, out, *, touch="decoder."):
    sd = vae.state_dict()
    name = next(k for k in sd if k.startswith(touch) and k.endswith("weight"))
    with torch.no_grad():
        sd[name] += 0.5
    vae.load_state_dict(sd)
    vae.save_pretrained(str(out / "vae"))
    return name


def test_ship_installs_the_decoder_and_the_causal_preset_keeps_its_own(tmp_path):
    from safetensors.torch import load_file

    from omniloop_wan_demo_training.ship import VAE_WEIGHTS

    pkg, vae = _tiny_package(tmp_path)
    old = (pkg / "checkpoint" / "vae" / VAE_WEIGHTS).read_bytes()
    name = _decoder_tuned(vae, tmp_path / "new")
    from omniloop_wan_demo_training import ship

    (pkg / "checkpoint" / "omniloop.json").write_text(json.dumps({"training": {"history": [{"phase": "dit"}]}}))
    (tmp_path / "new" / "decoder_specks.json").write_text(json.dumps(
        {"steps": 3, "seconds": 1.5, "speck_clips": 2, "other_clips": 5, "args": {"lr": "2e-05", "batch": "4", "focus": "red", "focus_frac": "0.5"},
         "recon_after": {"psnr": 30.1, "shape_by_colour": {"red": "44/45"}}}))
    done = ship.ship_decoder(tmp_path / "new", pkg)  # decoder_specks' --out folder (vae/ inside) is accepted
    history = json.loads((pkg / "checkpoint" / "omniloop.json").read_text())["training"]["history"]
    assert [h["phase"] for h in history] == ["dit", "decoder_specks"]
    assert history[-1]["steps"] == 3 and history[-1]["lr"] == 2e-5 and history[-1]["recon_psnr"] == 30.1
    assert history[-1]["focus"] == "red" and history[-1]["focus_frac"] == 0.5  # a focused run says so
    assert history[-1]["recon_shape_by_colour"] == {"red": "44/45"}
    assert done["kept_old_decoder"] == ["checkpoint_causal"]
    causal = pkg / "checkpoint_causal" / "vae"
    assert not causal.is_symlink() and (causal / VAE_WEIGHTS).read_bytes() == old
    assert (pkg / "checkpoint_fast" / "vae").is_symlink()  # wan-demo-fast decodes with the new decoder
    got = load_file(str(pkg / "checkpoint" / "vae" / VAE_WEIGHTS))
    assert torch.equal(got[name], vae.state_dict()[name].to(got[name].dtype))
    # a second decoder later: the causal copy is left as it is
    assert ship.ship_decoder(tmp_path / "new" / "vae", pkg)["kept_old_decoder"] == []
    assert (causal / VAE_WEIGHTS).read_bytes() == old


def test_ship_refuses_a_changed_encoder_or_config(tmp_path, capsys):
    pkg, vae = _tiny_package(tmp_path)
    before = (pkg / "checkpoint" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    _decoder_tuned(vae, tmp_path / "enc", touch="encoder.")
    from omniloop_wan_demo_training import ship

    with pytest.raises(ValueError, match="changes the encoder"):
        ship.ship_decoder(tmp_path / "enc", pkg)
    cfg = json.loads((tmp_path / "enc" / "vae" / "config.json").read_text())
    cfg["z_dim"] = 8
    (tmp_path / "enc" / "vae" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="z_dim"):
        ship.ship_decoder(tmp_path / "enc", pkg)
    with pytest.raises(ValueError, match="is missing"):
        ship.ship_decoder(tmp_path / "nothing", pkg)
    # nothing was touched by the refusals
    assert (pkg / "checkpoint_causal" / "vae").is_symlink()
    assert (pkg / "checkpoint" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() == before
    # the CLI says it in one line
    with pytest.raises(SystemExit):
        decoder_specks.main(["--ship", str(tmp_path / "nothing")])
    assert "is missing" in capsys.readouterr().err


def test_speck_probe_recon_reads_shapes_back_per_colour(tmp_path, capsys):
    """scripts/speck_probe.py recon: rendered clips round-tripped through a VAE, the shape read per
    colour; a tiny random VAE reads shapes wrongly, so the misses account for every clip it misses."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "demos" / "wan-demo" / "scripts" / "speck_probe.py"
    spec = importlib.util.spec_from_file_location("speck_probe_test", script)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    torch.manual_seed(0)
    vae = build_vae({**VAE_CONFIG, "base_dim": 4})
    vae.save_pretrained(str(tmp_path / "vae"))
    r = probe.recon_by_colour(vae.eval(), 6, batch=4)
    counts = [tuple(int(x) for x in v.split("/")) for v in r["shape_by_colour"].values()]
    assert r["n"] == 6 and sum(t for _, t in counts) == 6
    assert sum(t - ok for ok, t in counts) == sum(r["misses"].values())
    assert probe.main(["recon", "--n", "2", "--variants", f"vae:{tmp_path / 'vae'}", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())[f"vae:{tmp_path / 'vae'}"]["n"] == 2
