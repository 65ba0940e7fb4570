"""Deploy ``linear_precision_options: {keep: [...]}`` (omniloop-quant's FP8 modes): the block linears a
glob names stay in the deploy's dtype. Checked at load (core: the precision's ``options_schema``; the
plugin: every pattern must match a module), reported in ``Runtime.linears``, and on wan-demo and
flux-demo the kept layers are the plain linears they were (CPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import omniloop_quant.plugin as quant_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.errors import DeployError
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import make_manager
from omniloop_quant import FP8FeedForward, FP8Linear, FP8PartLinear
from omniloop_quant.options import FP8Options, keep_matcher
from omniloop_wan.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wan"), variant="t2v")


@pytest.fixture(scope="module")
def wan_demo() -> tuple[Any, Any]:
    demo = pytest.importorskip("omniloop_wan_demo.checkpoint_path")
    import omniloop_wan_demo.plugin as demo_plugin

    return demo.checkpoint_dir(), make_manager(("wan", wan_plugin), ("wan-demo", demo_plugin), ("quant", quant_plugin),
                                               toy=False)


def manager() -> Any:
    return make_manager(("wan", wan_plugin), ("quant", quant_plugin), toy=False)


def deploy(tiny: Any, **kw: Any) -> dict[str, Any]:
    return {"model": {"path": str(tiny)}, "linear_precision": "fp8", **kw}


def test_every_fp8_mode_takes_the_options() -> None:
    specs = [quant_plugin.FP8, quant_plugin.FP8_FAST, quant_plugin.FP8_FAST_EXCEPT_DOWN]
    assert all(s.options_schema is FP8Options for s in specs)
    assert quant_plugin.OMNILOOP_HOOK_API.startswith(">=1.5")  # options_schema came with hook API 1.5


@pytest.mark.parametrize(("options", "message"), [
    ({"skip": ["*.to_v"]}, r"linear_precision_options\.skip"),
    ({"keep": "*.to_v"}, r"linear_precision_options\.keep"),
    ({"keep": [""]}, r"linear_precision_options\.keep: pattern 0 must be 1-200 characters of a module path"),
    ({"keep": ["attn.to_v", "../x"]}, r"linear_precision_options\.keep: pattern 1 must be"),
    ({"keep": ["a b"]}, r"linear_precision_options\.keep: pattern 0 must be"),
    ({"keep": [f"x{i}" for i in range(65)]}, r"linear_precision_options\.keep: at most 64 patterns, got 65"),
])
def test_bad_options_refused_at_load(tiny, options, message):
    with pytest.raises(DeployError, match=message) as info:
        Deployment(deploy(tiny, linear_precision_options=options), manager=manager())
    assert "\n" not in str(info.value) and "../x" not in str(info.value)  # the value is not echoed


def test_options_need_a_precision_that_takes_them(tiny):
    with pytest.raises(DeployError, match=r"^linear_precision_options: given for linear_precision: dtype, which takes "
                                          r"none \(got \['keep'\]\)"):
        Deployment({"model": {"path": str(tiny)}, "linear_precision_options": {"keep": ["*.to_v"]}}, manager=manager())


def test_a_precision_without_a_schema_takes_no_options(tiny):
    """The core's rule for any registered precision: without ``options_schema``, options are refused."""
    import attrs

    from omniloop.family import LinearPrecisionSpec
    from omniloop.hookspecs import hookimpl

    bare = attrs.evolve(quant_plugin.FP8, name="fp8-bare", options_schema=None)

    class Bare:
        OMNILOOP_HOOK_API = ">=1.2,<2"

        @staticmethod
        @hookimpl
        def omniloop_register_linear_precisions(register: Any) -> None:
            register(bare)

    assert isinstance(bare, LinearPrecisionSpec)
    mgr = make_manager(("wan", wan_plugin), ("bare", Bare), toy=False)
    with pytest.raises(DeployError, match=r"^linear_precision_options: linear_precision 'fp8-bare' takes no options, "
                                          r"got \['keep'\]$"):
        Deployment(deploy(tiny, linear_precision="fp8-bare", linear_precision_options={"keep": ["x"]}), manager=mgr)


def test_keep_matcher_globs_over_block_paths() -> None:
    exclude, hits = keep_matcher(["*.to_v", "attn.add_v_proj", "ff"])
    assert [p for p in ("attn.to_v", "attn1.to_v", "attn.add_v_proj", "attn.to_vv", "ff", "ff.net.0", "attn.to_q")
            if exclude(p)] == ["attn.to_v", "attn1.to_v", "attn.add_v_proj", "ff"]
    exclude("attn.to_v")
    assert hits == {"*.to_v": ["attn.to_v", "attn1.to_v"], "attn.add_v_proj": ["attn.add_v_proj"], "ff": ["ff"]}
    assert not keep_matcher(["Attn.to_v"])[0]("attn.to_v")  # case-sensitive


def test_a_pattern_matching_nothing_is_refused_before_any_linear_is_swapped(wan_demo):
    """A typo (or a layer this family does not have: wan-demo's text-to-video blocks have no
    ``add_v_proj``) is one error naming the pattern and listing a block's modules that hold linears."""
    path, mgr = wan_demo
    with pytest.raises(DeployError) as info:
        Runtime.from_model(path, manager=mgr, linear_precision="fp8",
                           linear_precision_options={"keep": ["*.to_v", "*.add_v_proj"]})
    msg = str(info.value)
    assert msg.startswith("linear_precision_options.keep: '*.add_v_proj' matched no module in any of the 10 "
                          "transformer blocks; a block's modules (transformer.blocks.0): ")
    assert "attn1.to_v" in msg and "ffn" in msg and "norm1" not in msg and "\n" not in msg


def test_wan_demo_keeps_the_value_projections_in_the_model_dtype(wan_demo):
    """``keep: ["*.to_v"]`` on wan-demo: the self- and cross-attention value projections of all 10 blocks
    stay the plain linears they were (80 of 100 GEMMs FP8), the report says which, and the clip differs
    from both the float32 one and the all-FP8 one while staying close to float32."""
    path, mgr = wan_demo
    body = {"task": "t2v", "inputs": [{"type": "text", "text": "a yellow triangle moving right"}],
            "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 0, "frames": 9, "height": 64, "width": 64}}
    rt = Runtime.from_model(path, manager=mgr, linear_precision="fp8", linear_precision_options={"keep": ["*.to_v"]})
    assert rt.linears["quantized"] == 80 and rt.linears["keep"] == ["*.to_v"]
    assert rt.linears["kept"] == {"attn1.to_v": 10, "attn2.to_v": 10}
    tf = rt.model.components["transformer"]
    for block in tf.blocks:
        for attn in (block.attn1, block.attn2):
            assert type(attn.to_v) is torch.nn.Linear and isinstance(attn.to_q, FP8Linear)
            assert attn.to_v.weight.dtype == torch.float32
    frames = {}
    for name, kw in {"base": {}, "fp8": {"linear_precision": "fp8"}, "keep": None}.items():
        run = rt if kw is None else Runtime.from_model(path, manager=mgr, **kw)
        out = run.generate(body)
        assert out.ok
        frames[name] = np.asarray(out.artifacts["video"].frames, dtype=np.float64)
    assert not np.array_equal(frames["keep"], frames["fp8"]) and not np.array_equal(frames["keep"], frames["base"])
    mse = float(((frames["keep"] - frames["base"]) ** 2).mean())
    assert 10 * np.log10(255.0**2 / max(mse, 1e-12)) > 20.0


def test_keeping_a_whole_feed_forward(wan_demo):
    """A pattern may name a module above the linears: ``ffn`` keeps each block's feed-forward (two GEMMs)."""
    path, mgr = wan_demo
    rt = Runtime.from_model(path, manager=mgr, linear_precision="fp8-fast", linear_precision_options={"keep": ["ffn"]})
    tf = rt.model.components["transformer"]
    assert rt.linears["quantized"] == 80 and rt.linears["kept"] == {"ffn": 10}
    assert not any(isinstance(m, FP8FeedForward) for m in tf.modules())
    assert all(m.fast_accum for m in tf.modules() if isinstance(m, FP8Linear))


def test_flux_demo_keeps_both_streams_value_projections():
    """FLUX's double blocks have ``attn.to_v`` and ``attn.add_v_proj``, its single blocks ``attn.to_v``: the
    recipe the FP8 study points to (bench/README.md, "Session 27") keeps 2 x 2 + 6 of flux-demo's."""
    demo = pytest.importorskip("omniloop_flux_demo.checkpoint_path")
    import omniloop_flux.plugin as flux_plugin
    import omniloop_flux_demo.plugin as flux_demo_plugin

    mgr = make_manager(("flux", flux_plugin), ("flux-demo", flux_demo_plugin), ("quant", quant_plugin), toy=False)
    path = demo.checkpoint_dir()
    every = Runtime.from_model(path, manager=mgr, linear_precision="fp8").linears["quantized"]
    rt = Runtime.from_model(path, manager=mgr, linear_precision="fp8",
                            linear_precision_options={"keep": ["attn.to_v", "attn.add_v_proj"]})
    assert rt.linears["kept"] == {"attn.to_v": 8, "attn.add_v_proj": 2}
    assert rt.linears["quantized"] == every - 10
    tf = rt.model.components["transformer"]
    for block in [*tf.transformer_blocks, *tf.single_transformer_blocks]:
        assert type(block.attn.to_v) is torch.nn.Linear and isinstance(block.attn.to_k, FP8Linear)
    assert rt.describe()["linear_precision"] == "fp8"


def test_flux_demo_takes_the_readme_keep_list_for_adherence():
    """omniloop-quant's README recommends, for FP8 where adherence matters on FLUX-type models, keeping q/k/v of both
    streams and the AdaLN modulation linears (bench/README.md, "Session 30": flux-demo's shape verdicts 27 lost / 26
    gained of 1,296 on the GPU). Every glob matches in some block type, and exactly those layers stay plain."""
    demo = pytest.importorskip("omniloop_flux_demo.checkpoint_path")
    import omniloop_flux.plugin as flux_plugin
    import omniloop_flux_demo.plugin as flux_demo_plugin

    mgr = make_manager(("flux", flux_plugin), ("flux-demo", flux_demo_plugin), ("quant", quant_plugin), toy=False)
    keep = ["attn.to_[qkv]", "attn.add_[qkv]_proj", "norm1.linear", "norm1_context.linear", "norm.linear"]
    rt = Runtime.from_model(demo.checkpoint_dir(), manager=mgr, linear_precision="fp8",
                            linear_precision_options={"keep": keep})
    double, single = 2, 6  # flux-demo's blocks
    assert rt.linears["kept"] == {**{f"attn.to_{p}": double + single for p in "qkv"},
                                  **{f"attn.add_{p}_proj": double for p in "qkv"},
                                  "norm1.linear": double, "norm1_context.linear": double, "norm.linear": single}
    tf = rt.model.components["transformer"]
    for block in tf.transformer_blocks:
        assert type(block.norm1.linear) is torch.nn.Linear and isinstance(block.attn.to_out[0], FP8Linear)
    for block in tf.single_transformer_blocks:
        assert type(block.norm.linear) is torch.nn.Linear and isinstance(block.proj_mlp, FP8Linear)
    body = {"task": "t2i", "inputs": [{"type": "text", "text": "a red circle"}],
            "diffusion": {"steps": 2, "seed": 0, "height": 64, "width": 64}}
    assert rt.generate(body).ok


def test_under_fused_qkv_a_kept_projection_is_kept_as_rows_of_the_fused_linear():
    """Under ``options.qkv: fused`` the joint attention computes Q/K/V through diffusers' fused ``to_qkv`` (the
    separate linears stay beside it, unused): ``keep: [attn.to_v, attn.add_v_proj]`` makes each fused linear an
    :class:`FP8PartLinear` whose value rows stay in the model dtype -- its V part is the unfused ``to_v``'s output
    bit for bit, its Q/K parts the FP8 ones -- and the report says so; keeping q, k and v keeps the fused linear
    whole."""
    demo = pytest.importorskip("omniloop_flux_demo.checkpoint_path")
    import omniloop_flux.plugin as flux_plugin
    import omniloop_flux_demo.plugin as flux_demo_plugin

    mgr = make_manager(("flux", flux_plugin), ("flux-demo", flux_demo_plugin), ("quant", quant_plugin), toy=False)
    path = demo.checkpoint_dir()
    fused = {"dtype": "bfloat16", "compile": True, "options": {"qkv": "fused", "compile_backend": "eager"},
             "linear_precision": "fp8"}
    rt = Runtime.from_model(path, manager=mgr, linear_precision_options={"keep": ["attn.to_v", "attn.add_v_proj"]},
                            **fused)
    assert rt.linears["kept"] == {"attn.to_v": 8, "attn.add_v_proj": 2}
    assert rt.linears["kept_in_fused"] == {"attn.to_qkv": ["attn.to_v"], "attn.to_added_qkv": ["attn.add_v_proj"]}
    tf = rt.model.components["transformer"]
    for block in [*tf.transformer_blocks, *tf.single_transformer_blocks]:
        assert isinstance(block.attn.to_qkv, FP8PartLinear) and block.attn.to_qkv.kept == (False, False, True)
    attn = tf.transformer_blocks[0].attn
    assert isinstance(attn.to_added_qkv, FP8PartLinear)
    x = torch.randn(2, 5, attn.to_qkv.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
    plain = Runtime.from_model(path, manager=mgr, linear_precision="fp8", dtype="bfloat16",
                               linear_precision_options={"keep": ["attn.to_v", "attn.add_v_proj"]})
    ref = plain.model.components["transformer"].transformer_blocks[0].attn
    assert torch.equal(v, ref.to_v(x))  # the kept rows: the same bf16 GEMM as the separate linear
    torch.testing.assert_close(q.float(), ref.to_q(x).float(), rtol=0.0, atol=0.02)  # same e4m3 operands
    torch.testing.assert_close(k.float(), ref.to_k(x).float(), rtol=0.0, atol=0.02)
    body = {"task": "t2i", "inputs": [{"type": "text", "text": "a red circle"}],
            "diffusion": {"steps": 2, "seed": 0, "height": 64, "width": 64}}
    assert rt.generate(body).ok
    whole = Runtime.from_model(path, manager=mgr, linear_precision_options={"keep": ["attn.to_[qkv]"]}, **fused)
    assert whole.linears["kept_in_fused"] == {"attn.to_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"]}
    assert type(whole.model.components["transformer"].transformer_blocks[0].attn.to_qkv) is torch.nn.Linear


def test_keeping_a_projection_computed_through_a_weight_buffer_is_refused():
    """omniloop-kit's ``options.qkv: fused`` multiplies by a concatenated weight buffer FP8 does not reach (the
    projections stay in the model dtype there anyway): keeping ``attn.to_v`` would change nothing, so it is
    refused, naming the buffer."""
    from omniloop_quant.blocks import _keep

    attn = torch.nn.Module()
    for name in ("to_q", "to_k", "to_v"):
        setattr(attn, name, torch.nn.Linear(32, 32))
    attn.register_buffer("omniloop_qkv_weight", torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
    block = torch.nn.Module()
    block.attn = attn
    with pytest.raises(DeployError, match=r"'attn\.to_v' \(b0\) does not compute this deployment's projection: "
                                          r"attn\.omniloop_qkv_weight \(a concatenated copy"):
        _keep(["attn.to_v"], [("b0", block)])


def test_part_linear_keeps_its_rows_in_the_fused_order():
    """:class:`FP8PartLinear` over three parts keeping the middle one: three GEMMs (FP8, model dtype, FP8) whose
    outputs stand where the fused linear's rows do; the kept part is the plain linear's output bit for bit, the
    others the FP8 layer's; a split with nothing (or everything) kept is refused."""
    lin = torch.nn.Linear(32, 48).requires_grad_(False)
    part = FP8PartLinear(lin, 3, {1})
    assert part.kept == (False, True, False) and len(part.pieces) == 3 and "parts=8k8" in repr(part)
    x = torch.randn(4, 7, 32, generator=torch.Generator().manual_seed(1))
    y = part(x)
    assert y.shape == (4, 7, 48)
    assert torch.equal(y[..., 16:32], torch.nn.functional.linear(x, lin.weight[16:32], lin.bias[16:32]))
    qk = FP8Linear(lin)
    torch.testing.assert_close(y[..., :16], qk(x)[..., :16], rtol=0.0, atol=1e-5)
    torch.testing.assert_close(y[..., 32:], qk(x)[..., 32:], rtol=0.0, atol=1e-5)
    for keep in (set(), {0, 1, 2}):
        with pytest.raises(ValueError, match="at least one part in FP8 and one kept"):
            FP8PartLinear(lin, 3, keep)


def test_wan_demo_fused_projections_keep_the_value_rows(wan_demo):
    """Wan's ``options.qkv: fused`` computes Q/K/V through ``attn1.to_qkv`` and the cross-attention's K/V through
    ``attn2.to_kv``: ``keep: ["*.to_v"]`` keeps their value rows (:class:`FP8PartLinear`), and the clip equals the one
    with separate projections and the same keep list, frame for frame (CPU float32: the same GEMMs' values)."""
    path, mgr = wan_demo
    body = {"task": "t2v", "inputs": [{"type": "text", "text": "a yellow triangle moving right"}],
            "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 0, "frames": 9, "height": 64, "width": 64}}
    frames = []
    for options in ({}, {"qkv": "fused"}):
        rt = Runtime.from_model(path, manager=mgr, linear_precision="fp8", options=options,
                                linear_precision_options={"keep": ["*.to_v"]})
        out = rt.generate(body)
        assert out.ok
        frames.append(np.asarray(out.artifacts["video"].frames))
    assert rt.linears["kept_in_fused"] == {"attn1.to_qkv": ["attn1.to_v"], "attn2.to_kv": ["attn2.to_v"]}
    block = rt.model.components["transformer"].blocks[0]
    assert block.attn1.to_qkv.kept == (False, False, True) and block.attn2.to_kv.kept == (False, True)
    assert np.array_equal(frames[0], frames[1])
