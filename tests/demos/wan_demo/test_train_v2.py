"""wan-demo v2 / wan-demo-fast training (omniloop_wan_demo_training.v2, .distill, .ship): the pieces
a GPU session depends on, checked on CPU in a few seconds (the VAE and eval phases are too slow for
CI on a CPU; ``python -m omniloop_wan_demo_training.v2 --smoke --vae-init fresh --dit-init fresh``
runs them all)."""

import json
import os
import tarfile

import pytest
import torch

from omniloop_wan_demo import checkpoint_path
from omniloop_wan_demo.prompts import vocabulary_words
from omniloop_wan_demo_training import distill, v2
from omniloop_wan_demo_training.common import DEMO_DEFAULTS, V1_VOCAB_SIZE, V2_SAMPLING, VOCAB, grow_text_encoder
from omniloop_wan_demo_training.ship import ship

torch.set_num_threads(2)
CKPT = checkpoint_path.checkpoint_dir()


def test_fast_sigmas_are_the_few_step_samplers_own():
    from omniloop_policies.samplers import FewStepSampler

    ts, sigmas = FewStepSampler(timesteps_list=distill.FAST_TIMESTEPS, grid_shift=distill.GRID_SHIFT).schedule()
    assert list(ts) == [float(t) for t in distill.FAST_TIMESTEPS]
    assert distill.fast_sigmas() == list(sigmas[:-1])
    assert distill.GRID_SHIFT == FewStepSampler().grid_shift  # a request only has to name the timesteps


def test_loss_weights_mark_edges_objects_and_frame_zero():
    cov = torch.zeros(1, 1, 3, 16, 16)
    cov[..., 4:12, 4:12] = 1.0
    w = v2.loss_weights(cov, object_weight=2.0, edge_weight=10.0, frame0_weight=3.0)
    assert w.shape == cov.shape
    f1 = w[0, 0, 1]
    assert f1[0, 0] == 1.0  # background far from the object
    assert f1[8, 8] == 3.0  # object interior: 1 + 2
    assert f1[4, 4] == 13.0 and f1[3, 4] == 11.0  # the outline, inside and outside
    assert torch.equal(w[0, 0, 0], 3.0 * f1)  # frame 0 weighted


def test_trail_weight_marks_the_objects_path_away_from_the_object():
    cov = torch.zeros(1, 1, 3, 16, 16)
    for t in range(3):  # a 4 px square moving right 4 px a frame
        cov[0, 0, t, 6:10, 2 + 4 * t:6 + 4 * t] = 1.0
    base = v2.loss_weights(cov, object_weight=2.0, edge_weight=0.0, frame0_weight=1.0)
    w = v2.loss_weights(cov, object_weight=2.0, edge_weight=0.0, frame0_weight=1.0, trail_weight=5.0)
    extra = w - base
    assert torch.equal(extra[0, 0, 1, 6:10, 2:6], torch.full((4, 4), 5.0))  # where it was at frame 0
    assert torch.equal(extra[0, 0, 1, 6:10, 10:14], torch.full((4, 4), 5.0))  # where it will be at frame 2
    assert torch.equal(extra[0, 0, 1, 6:10, 6:10], torch.zeros(4, 4))  # the object itself
    assert extra[0, 0, :, :6].abs().sum() == 0 and extra[0, 0, :, 10:].abs().sum() == 0  # off its path
    assert torch.equal(v2.loss_weights(cov, object_weight=2.0, edge_weight=0.0, frame0_weight=1.0, trail_weight=0.0), base)


def test_new_words_get_ids_after_v1s_and_the_grown_encoder_is_v1_on_v1_prompts():
    from transformers import AutoTokenizer, UMT5EncoderModel

    # v1's tokenizer: the package's until v2 shipped, then checkpoint_causal's own copy (v2.v1_dir)
    old = json.loads((v2.v1_dir() / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    if len(old) != V1_VOCAB_SIZE:
        pytest.skip("no v1 tokenizer in the package")
    assert all(old[w] == i for i, w in enumerate(VOCAB[:V1_VOCAB_SIZE]))
    new = json.loads((checkpoint_path.tokenizer_dir() / "tokenizer.json").read_text())["model"]["vocab"]
    assert all(new[w] == i for i, w in enumerate(VOCAB))  # the shipped (v2) tokenizer: v1's ids, new words after
    te = UMT5EncoderModel.from_pretrained(str(v2.v1_dir() / "text_encoder"), torch_dtype=torch.float32)
    if te.config.vocab_size != V1_VOCAB_SIZE:
        pytest.skip("no v1 text encoder in the package")
    grown = grow_text_encoder(te)
    assert grown.get_input_embeddings().weight.shape[0] == len(VOCAB)
    tok = AutoTokenizer.from_pretrained(str(checkpoint_path.tokenizer_dir()))
    ids = tok(["a red circle moving left", ""], padding="longest", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(te(ids.input_ids, ids.attention_mask).last_hidden_state,
                           grown(ids.input_ids, ids.attention_mask).last_hidden_state)


def test_bad_arguments_are_refused_before_any_work(capsys):
    for argv in (["--out", "x", "--phases", "vae,train"], ["--out", "x", "--dit-seconds", "nan"],
                 ["--out", "x", "--vae-seconds", "-1"], ["--out", "x", "--session-seconds", "inf"], ["--phases", "dit"],
                 ["--out", "x", "--dit-shifts", "1,nan"], ["--out", "x", "--dit-shifts", "one"],
                 ["--out", "x", "--eval-v2", "20"], ["--out", "x", "--eval-v2", "20/5/0"],
                 ["--out", "x", "--trail-weight", "-1"], ["--out", "x", "--trail-weight", "nan"],
                 ["--out", "x", "--decoder-batch", "0"], ["--out", "x", "--decoder-lr", "inf"],
                 ["--out", "x", "--dit-reflow-clips", "-1"], ["--out", "x", "--dit-reflow-share", "1"],
                 ["--out", "x", "--dit-reflow-ghost-share", "nan"], ["--out", "x", "--dit-reflow-guidance", "0.5"],
                 ["--out", "x", "--eval-v2", "20/2@ddim"], ["--out", "x", "--eval-seeds", "3-1"],
                 ["--out", "x", "--eval-seeds", "0,x"], ["--out", "x", "--eval-seeds", "0-3,2"]):
        with pytest.raises(SystemExit) as e:
            v2.parse_args(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown phase 'train'" in err and "--dit-seconds: must be a finite number > 0" in err
    assert "--dit-shifts: every shift must be a finite number > 0" in err and "--dit-shifts: a comma list" in err
    assert "--eval-v2: '20' is not STEPS/GUIDANCE[/SHIFT][@SAMPLER]" in err and "--eval-v2: '20/5/0': steps >= 1" in err
    assert "--eval-v2: '20/2@ddim': unknown sampler 'ddim' (known: unipc, euler, euler-sde)" in err
    assert "--eval-seeds: '3-1': at least one seed" in err and "--eval-seeds: 'x' is not a seed or a LO-HI range" in err
    assert "--eval-seeds: '0-3,2': at least one seed, all >= 0, none twice" in err
    assert "--trail-weight: must be a finite number >= 0, got -1.0" in err and "got nan" in err
    assert "--decoder-batch: must be >= 1" in err and "--decoder-lr: must be a finite number > 0" in err
    assert "--dit-reflow-clips: must be >= 0" in err and "--dit-reflow-share: must be a finite number in (0, 1)" in err
    assert "--dit-reflow-ghost-share: must be a finite number in [0, 1], got nan" in err
    assert "--dit-reflow-guidance: must be a finite number >= 1" in err


def test_eval_plan_and_training_shifts_parse():
    a = v2.parse_args(["--out", "x", "--eval-v2", "20/5, 50/5/1,4/3,20/2/5@euler-sde,8/1@euler", "--dit-shifts", "1,3",
                       "--eval-seeds", "0-3,16-17,40"])
    assert a.eval_v2_plan == [(20, 5.0, None, "unipc"), (50, 5.0, 1.0, "unipc"), (4, 3.0, None, "unipc"),
                              (20, 2.0, 5.0, "euler-sde"), (8, 1.0, None, "euler")]
    assert a.eval_seed_list == [0, 1, 2, 3, 16, 17, 40] and not a.no_fast_eval
    assert a.dit_shift_list == (1.0, 3.0)
    assert v2.parse_args(["--out", "x"]).dit_shift_list == (3.0,)  # the recipe of sessions A-E


def _folder(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


PARTS = ("vae/config.json", "transformer/config.json", "text_encoder/config.json", "tokenizer/tokenizer.json",
         "scheduler/scheduler_config.json", "model_index.json", "omniloop.json")


def test_ship_installs_v2_and_fast_and_keeps_v1_parts_for_the_causal_variant(tmp_path):
    pkg = tmp_path / "pkg"
    _folder(pkg / "checkpoint", {p: f"v1 {p}" for p in PARTS})
    _folder(pkg / "tokenizer", {"tokenizer.json": "v1 tok"})
    _folder(pkg / "checkpoint_causal", {"transformer/config.json": "causal", "omniloop.json": "causal"})
    for name in checkpoint_path.CAUSAL_SHARED:
        (pkg / "checkpoint_causal" / name).symlink_to(os.path.relpath(pkg / "checkpoint" / name, pkg / "checkpoint_causal"))
    src = tmp_path / "files"
    _folder(src / "pipeline", {**{p: f"v2 {p}" for p in PARTS}, "omniloop.json": '{"variant": "wan-demo"}'})
    _folder(src / "fast", {"transformer/config.json": "fast", "transformer/diffusion_pytorch_model.safetensors": "w",
                           "omniloop.json": "{}"})
    src2 = tmp_path / "tars"
    src2.mkdir()
    for name in ("pipeline", "fast"):
        with tarfile.open(src2 / f"{name}.tar", "w") as tf:
            tf.add(src / name, arcname=name)
    done = ship(src2, pkg)
    assert sorted(done) == ["checkpoint", "checkpoint_causal_kept_v1", "checkpoint_fast"]
    causal = pkg / "checkpoint_causal"
    for name in checkpoint_path.CAUSAL_SHARED:
        assert not (causal / name).is_symlink()
    assert (causal / "vae" / "config.json").read_text() == "v1 vae/config.json"
    assert (causal / "model_index.json").read_text() == "v1 model_index.json"
    assert (pkg / "checkpoint" / "vae" / "config.json").read_text() == "v2 vae/config.json"
    assert (pkg / "tokenizer" / "tokenizer.json").read_text() == "v2 tokenizer/tokenizer.json"
    fast = pkg / "checkpoint_fast"
    assert checkpoint_path.fast_checkpoint_missing(fast) is None
    for name in checkpoint_path.FAST_SHARED:
        assert (fast / name).is_symlink() and not os.path.isabs(os.readlink(fast / name))
    assert (fast / "vae" / "config.json").read_text() == "v2 vae/config.json"
    words = sorted(vocabulary_words("video"))
    assert len(words) == 16 and "star" in words
    for meta in (pkg / "checkpoint" / "omniloop.json", fast / "omniloop.json"):  # the CLI's out-of-vocabulary warning
        assert json.loads(meta.read_text())["vocabulary"] == words
        # and the range it was trained at (issue 42: omniloop.limits refuses requests outside it)
        assert json.loads(meta.read_text())["limits"]["max_height"] == 64
    # shipping again (e.g. a later v2) leaves the causal variant's v1 copies alone
    ship(src, pkg)
    assert (causal / "vae" / "config.json").read_text() == "v1 vae/config.json"
    with pytest.raises(ValueError, match=r"neither pipeline\.tar nor fast\.tar"):
        ship(tmp_path / "pkg" / "tokenizer", pkg)


def test_fast_preset_is_refused_with_one_line_until_installed(tmp_path, monkeypatch):
    from omniloop.errors import DeployError
    from omniloop_wan_demo import plugin

    monkeypatch.setattr(checkpoint_path, "PACKAGE_DIR", tmp_path)
    with pytest.raises(DeployError) as e:
        plugin.fast_path()
    msg = str(e.value)
    assert "\n" not in msg and "wan-demo-fast" in msg and "--ship" in msg
    assert plugin.FAST_PRESET.name == "wan-demo-fast" and plugin.fast_schedule() == {}


def test_smoke_session_trains_dit_and_student_and_resumes(tmp_path):
    """--smoke with tiny fresh models, phases dit + distill (CPU: the VAE is v1's, for encoding)."""
    out = tmp_path / "run1"
    assert v2.main(["--out", str(out), "--smoke", "--phases", "dit,distill", "--dit-init", "fresh"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["fast.tar", "pipeline.tar", "raw-0.safetensors", "run.json"]
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == {"step": 2} and [h["phase"] for h in run["history"]] == ["dit", "distill"]
    with tarfile.open(out / "fast.tar") as tf:
        meta = json.load(tf.extractfile("fast/omniloop.json"))
    assert meta["defaults"]["sampler"] == "few-step" and meta["defaults"]["guidance_scale"] == 1.0
    assert meta["defaults"]["sampler_options"]["few-step"]["timesteps"] == list(distill.FAST_TIMESTEPS)
    with tarfile.open(out / "pipeline.tar") as tf:  # v2 pipelines sample as the shipped preset does
        meta = json.load(tf.extractfile("pipeline/omniloop.json"))
    assert meta["version"] == 2 and meta["defaults"] == {**DEMO_DEFAULTS, **V2_SAMPLING}
    out2 = tmp_path / "run2"
    assert v2.main(["--out", str(out2), "--smoke", "--phases", "dit", "--resume", str(out), "--session-seconds", "400",
                    "--dit-shifts", "1,3"]) == 0
    run2 = json.loads((out2 / "run.json").read_text())
    assert run2["state"] == {"step": 4} and "raw weights from raw" in run2["phases"]["dit"]["init"]
    assert run2["phases"]["dit"]["recipe"]["shift"] == [1.0, 3.0]


def test_previous_run_comes_from_run_json_else_the_checkpoints_training_record(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "omniloop.json").write_text(json.dumps(
        {"training": {"trained_steps": 7, "history": [{"phase": "dit", "steps": 7}]}}))
    assert v2.previous_run(tmp_path) == {"state": {"step": 7}, "history": [{"phase": "dit", "steps": 7}]}
    (tmp_path / "run.json").write_text(json.dumps({"state": {"step": 9}, "history": [], "args": {}}))
    assert v2.previous_run(tmp_path) == {"state": {"step": 9}, "history": []}


def test_resume_package_continues_the_shipped_checkpoint(tmp_path):
    """--resume package: the shipped v2's EMA weights, step count and history (2 smoke steps, CPU)."""
    if not (CKPT / "model_index.json").exists():
        pytest.skip("no shipped checkpoint")
    shipped = json.loads((CKPT / "omniloop.json").read_text())["training"]
    out = tmp_path / "run"
    assert v2.main(["--out", str(out), "--smoke", "--phases", "dit", "--resume", "package"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == {"step": shipped["trained_steps"] + 2}
    assert run["history"][:-1] == shipped["history"] and run["history"][-1]["total_steps"] == shipped["trained_steps"] + 2
    assert "EMA from pipeline/" in run["phases"]["dit"]["init"]


def test_reflow_pairs_come_from_the_shipped_teacher_and_enter_the_dit_batches(tmp_path):
    """--dit-reflow-clips (training/reflow.py): the shipped v2 generates 8 clips (4 Euler steps,
    CPU), each is fitted and re-rendered, and the DiT's smoke steps draw half their samples from
    the pairs; the recipe records it."""
    if not (CKPT / "model_index.json").exists():
        pytest.skip("no shipped checkpoint")
    out = tmp_path / "run"
    assert v2.main(["--out", str(out), "--smoke", "--phases", "dit", "--resume", "package", "--dit-reflow-clips", "8",
                    "--dit-reflow-steps", "4", "--dit-reflow-share", "0.5", "--dit-reflow-ghost-share", "0.5",
                    "--workers", "1"]) == 0
    dit = json.loads((out / "run.json").read_text())["phases"]["dit"]
    info = dit["reflow"]
    assert info["generated"] == 8 and info["fitted"] == info["pairs"] >= 6  # a trained teacher: objects to fit
    assert dit["recipe"]["reflow"]["pairs"] == info["pairs"] and dit["recipe"]["reflow"]["share"] == 0.5
    assert dit["steps"] == 2


def test_decoder_phase_tunes_the_shipped_decoder_and_records_it(tmp_path):
    """--phases decoder,eval --resume package (2 smoke steps, CPU): pipeline.tar = the shipped
    pipeline with a new decoder (encoder, transformer untouched) and a history entry naming the
    trail weight; eval.json keeps per-clip records (with ghost frames) for v2 and the shipped fast."""
    from safetensors.torch import load_file

    if not (CKPT / "model_index.json").exists():
        pytest.skip("no shipped checkpoint")
    shipped = json.loads((CKPT / "omniloop.json").read_text())["training"]
    out = tmp_path / "run"
    assert v2.main(["--out", str(out), "--smoke", "--phases", "decoder,eval", "--resume", "package",
                    "--trail-weight", "7", "--decoder-lr", "0.05"]) == 0
    with tarfile.open(out / "pipeline.tar") as t:
        t.extractall(tmp_path / "x", filter="data")
    pipe = tmp_path / "x" / "pipeline"
    entry = json.loads((pipe / "omniloop.json").read_text())["training"]["history"][-1]
    assert entry["phase"] == "vae_decoder" and entry["trail_weight"] == 7.0 and entry["steps"] == 2
    assert {"recon_clean", "recon_shape", "recon_psnr_frame0"} <= entry.keys()
    run = json.loads((out / "run.json").read_text())
    assert run["history"][:-1] == shipped["history"] and run["history"][-1] == entry
    assert run["phases"]["decoder"]["trail_weight"] == 7.0 and "clean" in run["phases"]["decoder"]["final"]["accuracy"]
    old = load_file(str(CKPT / "vae" / "diffusion_pytorch_model.safetensors"))
    new = load_file(str(pipe / "vae" / "diffusion_pytorch_model.safetensors"))
    from omniloop_wan_demo_training.vae_decoder import ENCODER_PREFIXES

    assert all(torch.equal(old[k], new[k]) for k in old if k.startswith(ENCODER_PREFIXES))
    assert any(not torch.equal(old[k], new[k]) for k in old if k.startswith("decoder."))
    name = "diffusion_pytorch_model.safetensors"
    assert (pipe / "transformer" / name).read_bytes() == (CKPT / "transformer" / name).read_bytes()
    runs = json.loads((out / "eval.json").read_text())["runs"]
    if (checkpoint_path.fast_checkpoint_dir() / "transformer").is_dir():
        assert {r["model"] for r in runs} == {"v2", "fast"}
    for r in runs:
        assert len(r["clips"]) == r["n"] == 2 and {"p", "s", "c", "d", "sh", "g"} <= r["clips"][0].keys()
        assert "clean" in r["accuracy"]


@pytest.fixture
def fake_fast_package(tmp_path, monkeypatch):
    """A package folder whose ``checkpoint_fast/`` holds the shipped transformer as a stand-in
    student (links only) and the omniloop.json the distill phase writes; ``adapters/`` links the
    shipped one (the ``wan-demo-fast`` preset fuses its ``fast`` LoRA at load)."""
    if not (CKPT / "model_index.json").exists():
        pytest.skip("no shipped checkpoint")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "checkpoint").symlink_to(CKPT)
    fast = pkg / "checkpoint_fast"
    fast.mkdir()
    (fast / "transformer").symlink_to(CKPT / "transformer")
    for name in checkpoint_path.FAST_SHARED:
        (fast / name).symlink_to(os.path.relpath(pkg / "checkpoint" / name, fast))
    from omniloop_wan_demo_training.common import DEMO_DEFAULTS

    meta = {"variant": "wan-demo-fast", "defaults": dict(
        DEMO_DEFAULTS, steps=4, guidance_scale=1.0, sampler="few-step",
        sampler_options={"few-step": {"timesteps": list(distill.FAST_TIMESTEPS), "grid_shift": distill.GRID_SHIFT}})}
    (fast / "omniloop.json").write_text(json.dumps(meta))
    (pkg / "adapters").symlink_to(checkpoint_path.fast_lora_path().parent)  # the preset fuses its 'fast' LoRA
    monkeypatch.setattr(checkpoint_path, "PACKAGE_DIR", pkg)
    return fast


def test_fast_preset_runs_the_few_step_schedule_from_its_omniloop_json(fake_fast_package):
    runtime = pytest.importorskip("omniloop.runtime")
    from omniloop_wan_demo import plugin

    assert plugin.fast_schedule()["sampler"] == "few-step"
    rt = runtime.Runtime.from_model("wan-demo-fast")
    out = rt.generate({"task": "t2v", "prompt": "a red star moving left", "diffusion": {"seed": 0}})
    assert out.ok, out.error
    assert out.metrics["steps"] == 4 and out.metrics["policies"]["sampler"] == "few-step"
    assert tuple(out.artifacts["video"].frames.shape) == (17, 64, 64, 3)


def test_gpu_eval_generator_is_the_runtimes_few_step_sampler(fake_fast_package):
    """distill.FewStepGenerator (what eval.json measures) = the runtime's few-step sampler, on a
    1-step schedule (no re-noise, whose draws differ): same initial noise, same x0, same decode."""
    runtime = pytest.importorskip("omniloop.runtime")
    from diffusers import WanPipeline

    from omniloop_wan_demo_training.common import load_tokenizer

    rt = runtime.Runtime.from_model(str(fake_fast_package))  # a path: diffusers' VAE kernels
    req = {"task": "t2v", "prompt": "a blue square moving up", "diffusion": {"seed": 3, "steps": 1},
           "node_params": {"denoise": {"sampler": "few-step", "timesteps": [1000]}}}
    out = rt.generate(req)
    assert out.ok, out.error
    pipe = WanPipeline.from_pretrained(str(fake_fast_package), torch_dtype=torch.float32)
    gen = distill.FewStepGenerator(pipe.transformer, pipe.text_encoder, load_tokenizer(fake_fast_package / "tokenizer"),
                                   pipe.vae, device="cpu", timesteps=(1000,))
    (video,) = gen(["a blue square moving up"], [3], steps=1, guidance_scale=1.0)
    diff = (torch.as_tensor(video).int() - out.artifacts["video"].frames.int()).abs()
    assert diff.max() <= 1, int(diff.max())


def test_shipped_v2_and_fast_declare_the_video_vocabulary():
    """wan-demo and wan-demo-fast name their 16 words, so `omniloop generate` warns on others."""
    words = sorted(vocabulary_words("video"))
    for folder in (CKPT, checkpoint_path.fast_checkpoint_dir()):
        meta = json.loads((folder / "omniloop.json").read_text())
        if meta.get("version") != 2 and meta.get("variant") != "wan-demo-fast":
            pytest.skip("wan-demo v2 is not installed")
        assert meta["vocabulary"] == words


def test_latent_coverage_follows_the_vae_grid_and_dilates():
    from omniloop_wan_demo_training.train_dit import latent_coverage

    mask = torch.zeros(1, 1, 17, 64, 64)
    mask[0, 0, 5, 20, 40] = 0.3  # frame 5 -> latent frame 2 (frames 5..8); pixel (20, 40) -> cell (5, 10)
    exact = latent_coverage(mask, dilate=0)
    assert exact.shape == (1, 1, 5, 16, 16) and exact.dtype == torch.bool
    assert exact.sum() == 1 and bool(exact[0, 0, 2, 5, 10])
    grown = latent_coverage(mask)
    assert grown.sum() == 9 and bool(grown[0, 0, 2, 4:7, 9:12].all())
    mask[0, 0, 0, 0, 0] = 1.0  # frame 0 is a latent frame of its own
    assert bool(latent_coverage(mask, dilate=0)[0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="1\\+4k frames"):
        latent_coverage(torch.zeros(1, 1, 16, 64, 64))
