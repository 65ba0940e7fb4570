"""wan-demo-causal retrained with the DMD2 recipe, Self-Forcing style
(``omniloop_wan_demo_training.train_causal_dmd``, issue 41): one DMD2 iteration of the causal
student (its own chunked, KV-cached rollout) against a bidirectional teacher runs on CPU; the
``--smoke`` CLI writes a checkpoint whose own files are the transformer and ``omniloop.json`` (the
rest links to the source) and which streams through the runtime without CFG."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from omniloop_kit.causal import CausalOptions
from omniloop_wan_demo_training import dmd
from omniloop_wan_demo_training.self_forcing import SelfForcingRollout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("causal-dmd") / "t2v", variant="t2v")


def _snap(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _changed(before, params) -> bool:
    return any(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))


def test_one_dmd_iteration_of_the_causal_student(tiny):
    from diffusers import WanTransformer3DModel

    teacher = WanTransformer3DModel.from_pretrained(tiny / "transformer").eval()
    student, critic = copy.deepcopy(teacher).train(), copy.deepcopy(teacher).train()
    t0, s0, c0 = _snap(teacher.parameters()), _snap(student.parameters()), _snap(critic.parameters())
    g = torch.Generator().manual_seed(0)
    d = teacher.config.text_dim
    uncond = torch.zeros(1, 8, d)

    def batches():
        while True:
            yield dmd.Batch(torch.randn(2, 16, 3, 4, 4, generator=g), dmd.Text(torch.randn(2, 8, d, generator=g), uncond))

    rollout = SelfForcingRollout(CausalOptions(chunk_frames=1, steps=3, shift=3.0))
    logs: list[dict] = []
    cfg = dmd.DMDConfig(critic_steps=2, student_lr=1e-3, critic_lr=1e-3, teacher_guidance=3.0)
    out = dmd.train_dmd(student, teacher, critic, rollout, batches(), cfg, steps=2, log=logs.append, log_every=1,
                        generator=torch.Generator().manual_seed(1))
    assert out["student_steps"] == 1 and out["critic_steps"] == 2
    assert len(rollout.last_exits) == 3 and all(0 <= k < 3 for k in rollout.last_exits)
    assert all(torch.isfinite(torch.tensor(r["critic_loss"])) for r in logs)
    assert torch.isfinite(torch.tensor(logs[0]["dm_loss"])) and logs[0]["dm_loss"] > 0  # the iteration with the student step
    assert not _changed(t0, teacher.parameters()) and all(p.grad is None for p in teacher.parameters())
    assert _changed(s0, student.parameters()) and _changed(c0, critic.parameters())


def test_smoke_cli_writes_a_causal_checkpoint_that_streams_without_cfg(tiny, tmp_path):
    from omniloop.runtime import Runtime
    from omniloop_wan_demo_training.train_causal_dmd import main

    out = tmp_path / "causal-dmd"
    assert main(["--from", str(tiny), "--out", str(out), "--smoke", "--device", "cpu"]) == 0
    info = json.loads((out / "train_causal_dmd.json").read_text())
    assert info["teacher_forcing"]["steps"] == 3 and info["dmd"]["student_steps"] == 2
    assert info["shipped_weights"] in ("raw", "ema") and set(info["checks"]) == {"transformer", "ema_transformer"}
    # the teacher-forced model is checked too, before DMD2 (how much the causal adaptation keeps)
    assert set(info["check_after_teacher_forcing"]["accuracy"]) >= {"color", "direction", "shape", "clean"}
    meta = json.loads((out / "omniloop.json").read_text())
    assert meta["variant"] == "wan-demo-causal" and meta["rollout"] == "causal"
    assert meta["rollout_options"]["guidance_scale"] == meta["defaults"]["guidance_scale"] == 1.0
    assert meta["rollout_options"]["steps"] == 4 and "Self-Forcing DMD2" in meta["training"]["recipe"]["method"]
    assert meta["rollout_options"].get("sampler", "euler") == "euler"  # --renoise euler (the default)
    for name in ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"):  # shared: links to the source's
        assert (out / name).is_symlink() and (out / name).resolve() == (tiny / name).resolve(), name
    own = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and not any(
        q.is_symlink() for q in [p, *p.parents]))
    assert own == ["omniloop.json", "train_causal_dmd.json", "transformer/config.json",
                   "transformer/diffusion_pytorch_model.safetensors"]
    rt = Runtime.from_model(out, options={"rollout": "causal", "rollout_options": dict(meta["rollout_options"], steps=1)})
    events = list(rt.stream({"task": "t2v", "prompt": "a red circle", "outputs": {"stream_partial": True},
                             "diffusion": {"frames": 9, "seed": 0, "height": 32, "width": 32}}))
    assert sum(e.kind == "partial" for e in events) == 3
    assert events[-1].kind == "final" and events[-1].output.ok


def test_smoke_cli_from_a_causal_student_with_critic_warmup(tiny, tmp_path):
    """``--student-from`` (the shipped causal student's place), ``--critic-warmup`` critic-only
    updates first, ``--renoise fresh`` and ``--save-every-s`` (``progress.pt``: raw and EMA weights)."""
    from omniloop_wan_demo_training.train_causal_dmd import main

    out = tmp_path / "from-student"
    assert main(["--from", str(tiny), "--out", str(out), "--smoke", "--device", "cpu", "--tf-seconds", "0",
                 "--student-from", str(tiny), "--critic-warmup", "2", "--renoise", "fresh",
                 "--save-every-s", "0.001"]) == 0
    info = json.loads((out / "train_causal_dmd.json").read_text())
    assert "teacher_forcing" not in info and "check_after_teacher_forcing" not in info and info["student_from"] == str(tiny)
    assert [r["critic_warmup_iter"] for r in info["critic_warmup"]] == [1, 2]
    assert info["dmd"]["student_steps"] == 2
    assert info["recipe"]["renoise"] == "fresh" and info["recipe"]["critic_warmup"] == 2
    assert info["recipe"]["init"] == f"causal student from {tiny}"
    # trained with fresh noise between steps: saved (and checked) with the runtime's fresh sampler
    meta = json.loads((out / "omniloop.json").read_text())
    assert meta["rollout_options"]["sampler"] == "fresh"
    saved = torch.load(out / "progress.pt", weights_only=False)
    assert set(saved) == {"transformer", "ema_transformer", "info"} and saved["info"]["student_steps"] >= 1


def test_smoke_cli_teacher_forcing_alone(tiny, tmp_path):
    """``--dmd-seconds 0`` after a teacher-forcing stage: the teacher-forced model (raw or EMA, by the
    same check) is saved as a causal checkpoint, with no DMD2 record and a recipe that says so."""
    from omniloop_wan_demo_training.train_causal_dmd import main

    out = tmp_path / "tf-only"
    assert main(["--from", str(tiny), "--out", str(out), "--smoke", "--device", "cpu", "--dmd-seconds", "0"]) == 0
    info = json.loads((out / "train_causal_dmd.json").read_text())
    assert info["teacher_forcing"]["steps"] == 3 and "dmd" not in info and info["steps"] == 0
    assert set(info["checks"]) == {"transformer", "ema_transformer"} and info["shipped_weights"] in ("raw", "ema")
    meta = json.loads((out / "omniloop.json").read_text())
    assert meta["rollout"] == "causal" and meta["rollout_options"]["guidance_scale"] == 1.0
    assert meta["training"]["recipe"]["method"].startswith("teacher-forcing causal adaptation only")
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_bad_student_options_are_refused_before_compute(tiny, tmp_path, capsys):
    from omniloop_wan_demo_training.train_causal_dmd import main

    for argv, msg in ((["--student-from", str(tiny)], "give --tf-seconds 0"),
                      (["--student-from", str(tmp_path), "--tf-seconds", "0"], "has no transformer/config.json"),
                      (["--critic-warmup", "-1"], "--critic-warmup"),
                      (["--tf-seconds", "0", "--dmd-seconds", "0"], "give --tf-seconds > 0"),
                      (["--dmd-seconds", "-1"], "--dmd-seconds must be >= 0")):
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path / "x"), *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_dmd_overrides_are_refused(tmp_path, capsys):
    from omniloop_wan_demo_training.train_causal_dmd import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "x"), "--dmd", "[1]"])
    assert e.value.code == 2 and "--dmd: expected a JSON object" in capsys.readouterr().err


def test_causal_meta_drops_the_bidirectional_sampler_defaults():
    from omniloop_wan_demo_training.train_causal import causal_meta

    base = {"defaults": {"steps": 20, "guidance_scale": 2.0, "shift": 5.0, "sampler": "flow-euler", "fps": 8.0,
                         "sampler_options": {"flow-euler": {"stochastic_sampling": True}}},
            "limits": {"max_frames": 17, "note": "trained on 17-frame clips"}, "tasks": ["t2v"], "vocabulary": ["red"],
            "version": 2}
    meta = causal_meta(base, {"chunk_frames": 1, "steps": 4, "shift": 3.0, "guidance_scale": 1.0}, {"steps": 1})
    assert meta["defaults"] == {"steps": 4, "guidance_scale": 1.0, "fps": 8.0}
    assert meta["limits"] == {"max_frames": 17, "note": "trained on 17-frame clips (5 one-latent-frame chunks)"}
    assert base["limits"]["note"] == "trained on 17-frame clips" and meta["tasks"] == ["t2v"] and meta["vocabulary"] == ["red"]
    assert meta["rollout"] == "causal" and meta["rollout_options"]["shift"] == 3.0 and "version" not in meta


def test_the_causal_student_as_a_lora_role(tiny):
    """LoRA roles (student and critic adapters on one frozen base, the teacher = adapters off): the
    causal rollout runs the student's adapter (zero at the start: the base's own rollout), and one
    DMD2 iteration moves the two adapters, not the base."""
    from diffusers import WanTransformer3DModel

    from omniloop_wan_demo_training.self_forcing import causal_rollout, stream_noise

    base = WanTransformer3DModel.from_pretrained(tiny / "transformer").eval()
    opts = CausalOptions(chunk_frames=1, steps=2, shift=3.0)
    noise = stream_noise([0, 1], 3, (1, 16, 1, 4, 4))
    text = torch.randn(2, 8, base.config.text_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = causal_rollout(base, noise, text, opts)
    student, teacher, critic = dmd.lora_roles(base, rank=4)
    b0 = _snap(base.parameters())
    s0, c0 = _snap(student.parameters()), _snap(critic.parameters())
    with torch.no_grad():
        assert torch.equal(SelfForcingRollout(opts, exit="last")(student, noise, text), plain)  # B = 0: the base

    def batches():
        while True:
            yield dmd.Batch(noise, dmd.Text(text, torch.zeros(1, 8, base.config.text_dim)))

    cfg = dmd.DMDConfig(critic_steps=2, student_lr=1e-2, critic_lr=1e-2, teacher_guidance=3.0)
    out = dmd.train_dmd(student, teacher, critic, SelfForcingRollout(opts), batches(), cfg, steps=2,
                        generator=torch.Generator().manual_seed(1))
    assert out["student_steps"] == 1 and out["critic_steps"] == 2
    assert _changed(s0, student.parameters()) and _changed(c0, critic.parameters())
    frozen = [(a, p) for a, (n, p) in zip(b0, base.named_parameters(), strict=True) if "lora_" not in n]
    assert all(torch.equal(a, p.detach()) for a, p in frozen)
