"""training/vae_decoder.py: the decoder-only VAE fine-tune (encoder frozen, so a DiT trained on the
encoder's latents stays valid) and ``--join``, on CPU with a tiny random VAE (a few seconds)."""

import json
import tarfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop_wan_demo_training import vae_decoder
from omniloop_wan_demo_training.common import VAE_CONFIG, build_vae

torch.set_num_threads(2)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A pipeline folder with a tiny fp16 VAE (as save_pipeline stores it) and a 2-step --smoke run on it."""
    root = tmp_path_factory.mktemp("vae_decoder")
    torch.manual_seed(0)
    vae = build_vae({**VAE_CONFIG, "base_dim": 4})
    vae.half().save_pretrained(str(root / "pipeline" / "vae"))
    out = root / "out"
    # a large learning rate so that two steps move the decoder past fp16 rounding
    assert vae_decoder.main(["--from", str(root / "pipeline"), "--out", str(out), "--smoke", "--device", "cpu",
                             "--lr", "0.5"]) == 0
    return root, out


def _tar_weights(tar, tmp_path):
    with tarfile.open(tar) as t:
        t.extractall(tmp_path / "x", filter="data")
    return load_file(str(tmp_path / "x" / "vae" / WEIGHTS))


def test_smoke_trains_the_decoder_only_and_writes_vae_tar(session, tmp_path):
    root, out = session
    info = json.loads((out / "vae_decoder.json").read_text())
    assert info["steps"] == 2 and info["final"]["n"] == 4 and info["final"]["fp16_rounded"]
    old = load_file(str(root / "pipeline" / "vae" / WEIGHTS))
    new = _tar_weights(out / "vae.tar", tmp_path)
    assert old.keys() == new.keys()
    enc = [k for k in old if k.startswith(vae_decoder.ENCODER_PREFIXES)]
    dec = [k for k in old if k.startswith(("decoder.", "post_quant_conv."))]
    assert enc and dec
    assert all(torch.equal(old[k], new[k]) for k in enc)  # the latent space is untouched
    assert any(not torch.equal(old[k], new[k]) for k in dec)  # the decoder was trained


def test_join_replaces_vae_and_refuses_a_vae_whose_encoder_differs(session, tmp_path):
    import shutil

    root, out = session
    pipe = tmp_path / "pipeline"
    shutil.copytree(root / "pipeline", pipe)
    (pipe / "transformer").mkdir()  # the rest of the pipeline is left alone
    assert vae_decoder.main(["--join", str(pipe), "--vae-tar", str(out / "vae.tar")]) == 0
    tuned = _tar_weights(out / "vae.tar", tmp_path)
    joined = load_file(str(pipe / "vae" / WEIGHTS))
    assert joined.keys() == tuned.keys() and all(torch.equal(joined[k], tuned[k]) for k in tuned)
    assert (pipe / "transformer").is_dir()

    # a VAE whose encoder was changed (e.g. a whole-VAE fine-tune) is refused, and vae/ is kept
    bad = dict(tuned)
    key = next(k for k in bad if k.startswith("encoder."))
    bad[key] = bad[key] + 1
    (tmp_path / "bad" / "vae").mkdir(parents=True)
    shutil.copy(tmp_path / "x" / "vae" / "config.json", tmp_path / "bad" / "vae" / "config.json")
    save_file(bad, str(tmp_path / "bad" / "vae" / WEIGHTS))
    with tarfile.open(tmp_path / "bad.tar", "w") as t:
        t.add(str(tmp_path / "bad" / "vae"), arcname="vae")
    before = (pipe / "vae" / WEIGHTS).read_bytes()
    with pytest.raises(SystemExit, match=f"encoder weight {key} differs"):
        vae_decoder.main(["--join", str(pipe), "--vae-tar", str(tmp_path / "bad.tar")])
    assert (pipe / "vae" / WEIGHTS).read_bytes() == before


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    for argv, msg in ((["--join", str(tmp_path)], "--join needs --vae-tar"),
                      (["--join", str(tmp_path), "--vae-tar", str(tmp_path / "none.tar")], "no such file"),
                      (["--out", str(tmp_path)], "--from and --out are required"),
                      (["--from", str(tmp_path), "--out", str(tmp_path), "--seconds", "nan"], "--seconds must be a finite"),
                      (["--from", str(tmp_path), "--out", str(tmp_path), "--batch", "0"], "--batch must be >= 1"),
                      (["--from", str(tmp_path), "--out", str(tmp_path), "--trail-weight", "-2"],
                       "--trail-weight must be a finite number >= 0")):
        with pytest.raises(SystemExit) as e:
            vae_decoder.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"no pipeline/, vae/ or pipeline\.tar"):
        vae_decoder.main(["--from", str(tmp_path), "--out", str(tmp_path / "o"), "--smoke", "--device", "cpu"])
