"""Deploy ``linear_precision: fp8`` end to end on the CPU: validation at load, exact requests
refused, the tiny Wan (every linear misaligned: all kept, output unchanged) and the trained
wan-demo (every block linear quantised) generating through the runtime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import omniloop_quant.plugin as quant_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.errors import DeployError, RequestError
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import make_manager
from omniloop_quant import FP8Linear
from omniloop_wan.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wan"), variant="t2v")


def manager() -> Any:
    return make_manager(("wan", wan_plugin), ("quant", quant_plugin), toy=False)


def request(**kw: Any) -> dict[str, Any]:
    return {"task": "t2v", "inputs": [{"type": "text", "text": "a red fox"}],
            "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 3, "height": 32, "width": 32, "frames": 9},
            "outputs": {"return_latents": True}, **kw}


def test_bad_value_refused_at_load(tiny):
    with pytest.raises(DeployError, match=r"^linear_precision: unknown value 'int4' "
                       r"\(available: dtype, fp8, fp8-fast, fp8-fast-except-down\)$") as info:
        Deployment({"model": {"path": str(tiny)}, "linear_precision": "int4"}, manager=manager())
    assert "\n" not in str(info.value)


def test_fp8_is_the_plugins_not_the_cores(tiny):
    """The core knows only ``dtype``: ``fp8`` exists because omniloop-quant's entry point registers it
    (``omniloop_register_linear_precisions``); without the plugin the deploy is refused, with a hint."""
    assert quant_plugin.FP8.distribution_altering and manager().registry().linear_precisions["fp8"] is quant_plugin.FP8
    without = make_manager(("wan", wan_plugin), toy=False)
    with pytest.raises(DeployError, match=r"unknown value 'fp8' \(available: dtype\).*pip install -e plugins/compute/quant"):
        Deployment({"model": {"path": str(tiny)}, "linear_precision": "fp8"}, manager=without)


@pytest.mark.parametrize(("extra", "what"), [
    ({"adapters": {"x": "/nonexistent.safetensors"}}, "adapters"),
    ({"offload": "model"}, "offload"),
])
def test_combinations_refused_at_load(tiny, extra, what):
    with pytest.raises(DeployError, match=rf"^linear_precision: 'fp8' does not combine with {what}"):
        Deployment({"model": {"path": str(tiny)}, "linear_precision": "fp8", **extra}, manager=manager())


def test_exact_requests_refused(tiny):
    dep = Deployment({"model": {"path": str(tiny)}, "linear_precision": "fp8"}, manager=manager())
    dep.check(request())
    with pytest.raises(RequestError, match="linear_precision 'fp8' alters outputs") as info:
        dep.check(request(exact=True))
    assert info.value.path == "exact"
    Deployment({"model": {"path": str(tiny)}}, manager=manager()).check(request(exact=True))  # default: fine


def test_tiny_wan_misaligned_linears_kept(tiny):
    """The tiny Wan's widths (24, 32 with 24-wide inputs) fit no FP8 GEMM: every block linear stays,
    the report says so, and the output is bit-identical to the default deploy."""
    base = Runtime.from_model(tiny, manager=manager())
    rt = Runtime.from_model(tiny, manager=manager(), linear_precision="fp8")
    assert rt.linears["quantized"] == 0 and rt.linears["blocks"] == 2 and len(rt.linears["skipped"]) > 0
    assert rt.model.config["linear_precision"] is rt.linears and rt.describe()["linear_precision"] == "fp8"
    a, b = base.generate(request()), rt.generate(request())
    assert a.ok and b.ok
    assert torch.equal(a.artifacts["latents"].tensor, b.artifacts["latents"].tensor)


def test_wan_demo_generates_with_fp8_linears():
    """wan-demo (dim 160, FFN 640: all aligned): all 100 block linears quantised (4 self-attn, 4
    cross-attn, 2 FFN per block x 10), embeddings / time MLP / proj_out untouched; a clip
    generates and stays close to the float32 clip of the same seed (PSNR > 20 dB: e4m3 linears
    move pixels, not the picture)."""
    demo = pytest.importorskip("omniloop_wan_demo.checkpoint_path")
    import omniloop_wan_demo.plugin as demo_plugin

    path = demo.checkpoint_dir()
    mgr = make_manager(("wan", wan_plugin), ("wan-demo", demo_plugin), ("quant", quant_plugin), toy=False)
    body = {"task": "t2v", "inputs": [{"type": "text", "text": "a yellow triangle moving right"}],
            "diffusion": {"steps": 4, "guidance_scale": 5.0, "seed": 0, "frames": 9, "height": 64, "width": 64}}
    base = Runtime.from_model(path, manager=mgr)
    rt = Runtime.from_model(path, manager=mgr, linear_precision="fp8")
    assert rt.linears["quantized"] == 100 and rt.linears["skipped"] == [] and rt.linears["stray_weights"] == []
    tf = rt.model.components["transformer"]
    assert sum(isinstance(m, FP8Linear) for m in tf.modules()) == 100
    assert isinstance(tf.proj_out, torch.nn.Linear) and not isinstance(tf.proj_out, FP8Linear)
    assert not any(isinstance(m, FP8Linear) for m in tf.condition_embedder.modules())
    a, b = base.generate(body), rt.generate(body)
    assert a.ok and b.ok
    fa, fb = (np.asarray(o.artifacts["video"].frames, dtype=np.float64) for o in (a, b))
    assert fa.shape == fb.shape and not np.array_equal(fa, fb)
    mse = float(((fa - fb) ** 2).mean())
    psnr = 10 * np.log10(255.0**2 / max(mse, 1e-12))
    print(f"wan-demo fp8 linears vs float32: PSNR {psnr:.1f} dB")
    assert psnr > 20.0


def test_fp8_fast_sets_fast_accumulation_on_every_gemm():
    """``linear_precision: fp8-fast`` is ``fp8`` with ``use_fast_accum`` on every block GEMM (the
    plugin registers it beside ``fp8``; distribution-altering, refused for exact requests, same
    combinations refused). On the CPU the flag changes nothing, so the clip equals fp8's."""
    demo = pytest.importorskip("omniloop_wan_demo.checkpoint_path")
    import omniloop_wan_demo.plugin as demo_plugin

    assert manager().registry().linear_precisions["fp8-fast"] is quant_plugin.FP8_FAST
    assert quant_plugin.FP8_FAST.distribution_altering
    path = demo.checkpoint_dir()
    mgr = make_manager(("wan", wan_plugin), ("wan-demo", demo_plugin), ("quant", quant_plugin), toy=False)
    with pytest.raises(DeployError, match=r"^linear_precision: 'fp8-fast' does not combine with offload"):
        Deployment({"model": {"path": str(path)}, "linear_precision": "fp8-fast", "offload": "model"}, manager=mgr)
    body = {"task": "t2v", "inputs": [{"type": "text", "text": "a blue square moving up"}],
            "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 2, "frames": 9, "height": 64, "width": 64}}
    fast = Runtime.from_model(path, manager=mgr, linear_precision="fp8-fast")
    with pytest.raises(RequestError, match="linear_precision 'fp8-fast' alters outputs"):
        fast.check(dict(body, exact=True))
    layers = [m for m in fast.model.components["transformer"].modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 100 and all(m.fast_accum for m in layers) and "fast_accum" in repr(layers[0])
    plain = Runtime.from_model(path, manager=mgr, linear_precision="fp8")
    assert not any(m.fast_accum for m in plain.model.components["transformer"].modules() if isinstance(m, FP8Linear))
    a, b = fast.generate(body), plain.generate(body)
    assert np.array_equal(np.asarray(a.artifacts["video"].frames), np.asarray(b.artifacts["video"].frames))


def test_fp8_fast_except_down_keeps_full_accumulation_on_the_ffn_down_projections():
    """``linear_precision: fp8-fast-except-down``: ``fp8-fast`` except the feed-forwards' down projections
    (``FP8FeedForward.down``, diffusers' ``net[2]``: the largest reduction dimension), which keep full
    accumulation -- 90 of wan-demo's 100 block GEMMs fast, its 10 FFN down GEMMs not. Registered beside
    ``fp8``, distribution-altering, the same combinations refused; on the CPU the clip equals fp8's."""
    demo = pytest.importorskip("omniloop_wan_demo.checkpoint_path")
    import omniloop_quant
    import omniloop_wan_demo.plugin as demo_plugin
    from omniloop_quant import FP8FeedForward

    spec = manager().registry().linear_precisions["fp8-fast-except-down"]
    assert spec is quant_plugin.FP8_FAST_EXCEPT_DOWN and spec.distribution_altering
    assert "fp8-fast-except-down" in omniloop_quant.MODES
    path = demo.checkpoint_dir()
    mgr = make_manager(("wan", wan_plugin), ("wan-demo", demo_plugin), ("quant", quant_plugin), toy=False)
    with pytest.raises(DeployError, match=r"^linear_precision: 'fp8-fast-except-down' does not combine with offload"):
        Deployment({"model": {"path": str(path)}, "linear_precision": "fp8-fast-except-down", "offload": "model"},
                   manager=mgr)
    body = {"task": "t2v", "inputs": [{"type": "text", "text": "a blue square moving up"}],
            "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 2, "frames": 9, "height": 64, "width": 64}}
    rt = Runtime.from_model(path, manager=mgr, linear_precision="fp8-fast-except-down")
    with pytest.raises(RequestError, match="linear_precision 'fp8-fast-except-down' alters outputs"):
        rt.check(dict(body, exact=True))
    assert rt.linears["mode"] == "fp8-fast-except-down" and rt.linears["quantized"] == 100
    assert rt.describe()["linear_precision"] == "fp8-fast-except-down"
    tf = rt.model.components["transformer"]
    ffns = [m for m in tf.modules() if isinstance(m, FP8FeedForward)]
    downs = {id(m.down) for m in ffns}
    layers = [m for m in tf.modules() if isinstance(m, FP8Linear)]
    assert len(ffns) == 10 and len(layers) == 100
    assert all(m.fast_accum is (id(m) not in downs) for m in layers)
    assert all(m.down.in_features > m.up.in_features for m in ffns)  # the down GEMM has the largest K
    plain = Runtime.from_model(path, manager=mgr, linear_precision="fp8")
    a, b = rt.generate(body), plain.generate(body)
    assert np.array_equal(np.asarray(a.artifacts["video"].frames), np.asarray(b.artifacts["video"].frames))


def test_wan_demo_compiled_blocks_trace_fp8_linears_fullgraph():
    """deploy compile: true (each block torch.compile(fullgraph=True); dynamo's ``eager`` backend on
    the CPU, so no C++ build): the blocks trace with the FP8 linears in them — no graph break — and
    give the same frames as the uncompiled FP8 runtime."""
    demo = pytest.importorskip("omniloop_wan_demo.checkpoint_path")
    import omniloop_wan_demo.plugin as demo_plugin

    path = demo.checkpoint_dir()
    mgr = make_manager(("wan", wan_plugin), ("wan-demo", demo_plugin), ("quant", quant_plugin), toy=False)
    body = {"task": "t2v", "inputs": [{"type": "text", "text": "a red circle moving left"}],
            "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 1, "frames": 9, "height": 64, "width": 64}}
    torch._dynamo.reset()
    compiled = Runtime.from_model(path, manager=mgr, linear_precision="fp8", compile=True,
                                  options={"compile_backend": "eager"})
    out = compiled.generate(body)
    assert out.ok and out.metrics["denoise"]["compile"]["fullgraph"]
    assert compiled.linears["quantized"] == 100
    eager = Runtime.from_model(path, manager=mgr, linear_precision="fp8").generate(body)
    assert np.array_equal(np.asarray(out.artifacts["video"].frames), np.asarray(eager.artifacts["video"].frames))
    torch._dynamo.reset()
