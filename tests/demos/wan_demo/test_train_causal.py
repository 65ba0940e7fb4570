"""wan-demo-causal training (``omniloop_wan_demo_training.train_causal``): the teacher-forcing
forward trains exactly what the causal rollout runs, the ``--smoke`` CLI writes a loadable
checkpoint, ``ship`` installs one, and the preset refuses cleanly until weights exist."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from omniloop_kvcache import CacheManager
from omniloop_wan.causal import ChunkKV, chunk_forward, chunk_layout
from omniloop_wan_demo_training.train_causal import main, ship, teacher_forcing_forward, teacher_forcing_mask

# the teacher-forcing forward attends over one [clean | noisy] sequence with a boolean mask; the
# rollout reads the clean chunks' K/V from slabs. Same math, different key order / softmax length
# / matmul shapes, so fp32 rounding differs at the 1e-7 level per op (as tests/wan_causal's
# cached-vs-masked tolerance); 1e-5 over a 2-block model.
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("wan-demo-causal") / "t2v", variant="t2v")


@pytest.fixture(scope="module")
def transformer(tiny: Path):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(tiny / "transformer").eval()


def test_mask_layout():
    m = teacher_forcing_mask(3, 1)
    # rows/cols: clean 0,1,2 | noisy 0,1,2
    assert m.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    assert teacher_forcing_mask(2, 4).shape == (16, 16)
    with pytest.raises(ValueError, match="chunk"):
        teacher_forcing_mask(0, 4)


@pytest.mark.parametrize("chunk_frames", [1, 2])
def test_teacher_forcing_equals_the_cached_rollout_forward(transformer, chunk_frames):
    """Training's prediction for noisy chunk i == the rollout's chunk_forward of that chunk with
    the slabs written by the context forwards of the clean chunks before it."""
    g = torch.Generator().manual_seed(3)
    frames = 3 * chunk_frames
    x0 = torch.randn(1, 16, frames, 4, 4, generator=g)
    xt = torch.randn(1, 16, frames, 4, 4, generator=g)
    sig = torch.tensor([[0.9, 0.4, 0.05]])
    text = torch.randn(1, 12, transformer.config.text_dim, generator=g)
    with torch.no_grad():
        pred = teacher_forcing_forward(transformer, x0, xt, sig, text, chunk_frames)
        tokens = chunk_frames * 4
        mgr = CacheManager(chunk_layout(transformer), block_size=tokens, num_blocks=4)
        kv = ChunkKV(mgr)
        f = chunk_frames
        for i in range(3):
            want = chunk_forward(transformer, xt[:, :, i * f:(i + 1) * f], sig[:, i] * 1000.0, text, i * f, context=kv.context)
            torch.testing.assert_close(pred[:, :, i * f:(i + 1) * f], want, atol=ATOL, rtol=RTOL)
            chunk_forward(transformer, x0[:, :, i * f:(i + 1) * f], torch.zeros(1), text, i * f,
                          context=kv.context, record=kv.record)
            kv.commit()
        kv.free()
    # and it is causal: changing a later clean chunk does not change an earlier noisy prediction
    x0b = x0.clone()
    x0b[:, :, 2 * chunk_frames:] += 1.0
    with torch.no_grad():
        pred_b = teacher_forcing_forward(transformer, x0b, xt, sig, text, chunk_frames)
    assert torch.equal(pred_b, pred)  # chunk 2's clean copy is seen by nobody's noisy prediction
    x0c = x0.clone()
    x0c[:, :, :chunk_frames] += 1.0
    with torch.no_grad():
        pred_c = teacher_forcing_forward(transformer, x0c, xt, sig, text, chunk_frames)
    assert torch.equal(pred_c[:, :, :chunk_frames], pred[:, :, :chunk_frames])
    assert not torch.allclose(pred_c[:, :, chunk_frames:], pred[:, :, chunk_frames:], atol=1e-4)


def test_bad_shapes_are_refused(transformer):
    x = torch.zeros(1, 16, 3, 4, 4)
    with pytest.raises(ValueError, match="whole chunks"):
        teacher_forcing_forward(transformer, x, x, torch.zeros(1, 1), torch.zeros(1, 4, 16), 2)
    with pytest.raises(ValueError, match=r"sigmas must be \[batch, chunks\]"):
        teacher_forcing_forward(transformer, x, x, torch.zeros(1, 2), torch.zeros(1, 4, 16), 1)


def test_smoke_cli_writes_a_loadable_causal_checkpoint(tiny, tmp_path):
    """``--smoke`` end to end on CPU (3 steps, batch 2, 8 rendered clips), from a tiny source so
    that it stays fast; the output is a diffusers folder the Wan family streams causally."""
    from diffusers import WanTransformer3DModel
    from safetensors import safe_open

    out = tmp_path / "causal"
    assert main(["--from", str(tiny), "--out", str(out), "--smoke", "--no-eval", "--device", "cpu"]) == 0
    info = json.loads((out / "train_causal.json").read_text())
    assert info["steps"] == 3 and info["recipe"]["chunk_frames"] == 1
    assert all(isinstance(r["loss"], float) for r in info["log"])
    meta = json.loads((out / "omniloop.json").read_text())
    assert meta["variant"] == "wan-demo-causal" and meta["rollout"] == "causal"
    assert meta["rollout_options"]["chunk_frames"] == 1
    assert meta["defaults"]["steps"] == meta["rollout_options"]["steps"] == 4
    with safe_open(str(out / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    for name in ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"):  # frozen: links to the source's
        assert (out / name).is_symlink() and (out / name).resolve() == (tiny / name).resolve(), name
    own = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and not any(
        q.is_symlink() for q in [p, *p.parents]))
    assert own == ["omniloop.json", "train_causal.json", "transformer/config.json",
                   "transformer/diffusion_pytorch_model.safetensors"]
    src = WanTransformer3DModel.from_pretrained(tiny / "transformer")
    new = WanTransformer3DModel.from_pretrained(out / "transformer")
    assert {k: v for k, v in src.config.items() if k != "_name_or_path"} == {
        k: v for k, v in new.config.items() if k != "_name_or_path"}
    assert any(not torch.equal(p.half(), q.half()) for p, q in zip(src.parameters(), new.parameters(), strict=True))

    # the folder streams through the runtime with rollout: causal
    from omniloop.runtime import Runtime

    rt = Runtime.from_model(out, options={"rollout": "causal", "rollout_options": {"chunk_frames": 1, "steps": 1}})
    events = list(rt.stream({"task": "t2v", "prompt": "a red circle", "diffusion": {"frames": 9, "seed": 0, "height": 32,
                             "width": 32, "guidance_scale": 1.0}, "outputs": {"stream_partial": True}}))
    assert sum(e.kind == "partial" for e in events) == 3  # 9 frames = 3 latent frames = 3 chunks
    assert events[-1].kind == "final" and events[-1].output.ok

    # bench/adherence.py --rollout causal scores streamed clips of this folder (its omniloop.json's options)
    import importlib.util

    spec = importlib.util.spec_from_file_location("adherence_bench", Path(__file__).resolve().parents[3] / "bench" / "adherence.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", str(out), "--rollout", "causal", "--smoke"]) == 0


def test_ship_installs_the_transformer_and_links_the_rest(tmp_path):
    from omniloop_wan_demo.checkpoint_path import causal_checkpoint_missing, checkpoint_dir

    trained = tmp_path / "trained"
    shutil.copytree(checkpoint_dir(), trained)  # stands in for a trained folder (same shared parts)
    (trained / "omniloop.json").write_text(json.dumps({"variant": "wan-demo-causal", "rollout": "causal",
                                                       "rollout_options": {"chunk_frames": 1, "steps": 4}}))
    dest = tmp_path / "checkpoint_causal"
    assert "transformer/config.json is missing" in causal_checkpoint_missing(dest)
    ship(trained, dest)
    assert causal_checkpoint_missing(dest) is None
    assert (dest / "vae").is_symlink() and not (dest / "transformer").is_symlink()
    assert (dest / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        checkpoint_dir() / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    # a folder whose VAE is not wan-demo's is refused (the preset shares wan-demo's VAE)
    (trained / "vae" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"vae/config.json differs from wan-demo's"):
        ship(trained, tmp_path / "other")


def test_preset_is_listed_and_refused_with_one_line_until_the_weights_exist(check_preset_not_installed):
    from omniloop.plugins import default_manager
    from omniloop_wan_demo import checkpoint_path, plugin

    assert "wan-demo-causal" in default_manager().registry().presets
    check_preset_not_installed("wan-demo-causal", [(checkpoint_path, "causal_checkpoint_dir"),
                                                   (plugin, "causal_checkpoint_dir")], "--ship")


def test_preset_streams_with_causal_cfg_when_installed(tmp_path, monkeypatch):
    """With weights in place (here: wan-demo's own transformer standing in), the preset runs
    rollout: causal with CFG and the streaming evaluator scores the streamed chunks."""
    from omniloop_wan_demo import checkpoint_path, plugin
    from omniloop_wan_demo.evaluate import StreamingRuntimeGenerator, evaluate

    dest = tmp_path / "checkpoint_causal"
    trained = tmp_path / "trained"
    shutil.copytree(checkpoint_path.checkpoint_dir(), trained)
    (trained / "omniloop.json").write_text(json.dumps({"variant": "wan-demo-causal"}))
    ship(trained, dest)
    monkeypatch.setattr(checkpoint_path, "causal_checkpoint_dir", lambda: dest)
    monkeypatch.setattr(plugin, "causal_checkpoint_dir", lambda: dest)
    gen = StreamingRuntimeGenerator("wan-demo-causal")
    assert gen.runtime.options["rollout"] == "causal"
    rep = evaluate(gen, prompts=["a red circle moving right"], seeds=[0], steps=1, guidance_scale=5.0,
                   backend="runtime-stream")
    assert rep.n == 1 and set(rep.accuracy) >= {"color", "direction"}
    assert len(gen.timings) == 1 and 0 < gen.timings[0]["first_chunk_s"] <= gen.timings[0]["total_s"]
    eng, _ = gen.runtime.model.config["causal"].engine(64, 64)
    assert eng.manager.used_blocks == 0  # both branches' slabs freed after the request


def test_cli_eval_adherence_scores_streamed_clips_of_a_causal_checkpoint(tmp_path, monkeypatch):
    """``omniloop eval adherence --model <causal folder>`` picks rollout: causal from its
    omniloop.json (streamed clips, its steps/guidance defaults, its rollout_options)."""
    from click.testing import CliRunner

    from omniloop_wan_demo import cli
    from omniloop_wan_demo import evaluate as ev

    folder = tmp_path / "causal"
    folder.mkdir()
    (folder / "omniloop.json").write_text(json.dumps({
        "rollout": "causal", "defaults": {"steps": 4, "guidance_scale": 5.0},
        "rollout_options": {"chunk_frames": 1, "steps": 4, "guidance_scale": 5.0}}))
    made: list[dict] = []

    class Fake:
        def __init__(self, model, **kw):
            made.append({"model": model, **kw})

        def __call__(self, prompts, seeds, *, steps, guidance_scale):
            made.append({"steps": steps, "guidance_scale": guidance_scale})
            return [np.zeros((17, 64, 64, 3), np.uint8) for _ in prompts]

    monkeypatch.setattr(ev, "StreamingRuntimeGenerator", Fake)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli.main, ["eval", "adherence", "--model", str(folder), "--seeds", "0", "--json", str(out),
                                        "--no-table"])
    assert res.exit_code == 0, res.output
    assert made[0]["model"] == str(folder)
    assert made[0]["options"] == {"rollout": "causal", "rollout_options": {"chunk_frames": 1, "steps": 4, "guidance_scale": 5.0}}
    assert made[1] == {"steps": 4, "guidance_scale": 5.0}
    assert json.loads(out.read_text())["reports"][0]["backend"] == "runtime-stream"
