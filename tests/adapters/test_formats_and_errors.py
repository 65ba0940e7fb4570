"""Adapter file layouts converted at load, and every bad input refused before compute (issue 17).

Layouts: a ComfyUI and a kohya Wan file holding adapter ``a``'s tensors under their names (with
``.alpha`` = its lora_alpha) give exactly (``torch.equal``) what diffusers' file gives; a kohya
FLUX.1 file with fused ``img_attn_qkv`` / ``linear1`` gives exactly what a diffusers-layout file
holding the split parts (built here by hand) gives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import omniloop_adapters.plugin as adapters_plugin
import omniloop_flux.plugin as flux_plugin
import omniloop_wan.plugin as wan_plugin
from omniloop.errors import DeployError, RequestError
from omniloop.runtime import Deployment, Runtime
from omniloop.testing import make_manager
from omniloop_adapters import hooked

PROMPT = "a red fox jumps over the lazy dog"


def wan_manager() -> Any:
    return make_manager(("wan", wan_plugin), ("adapters", adapters_plugin), toy=False)


def wan_req(adapters: list[dict[str, Any]] | None = None, **d: Any) -> dict[str, Any]:
    diffusion = {"steps": 2, "guidance_scale": 5.0, "seed": 7, "height": 32, "width": 32, "frames": 5, **d}
    return {"task": "t2v", "inputs": [{"type": "text", "text": PROMPT}], "diffusion": diffusion,
            "outputs": {"return_latents": True}, "adapters": adapters or []}


def lat(out: Any) -> torch.Tensor:
    assert out.ok, out.error
    return out.artifacts["latents"].tensor


# Wan's original module names for diffusers' (what ComfyUI and kohya files use)
WAN_ORIGINAL = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
                "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
                "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
                "ffn.net.2": "ffn.2"}


def wan_renamed(sd: dict[str, torch.Tensor], kohya: bool, alpha: float) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        mod, which = k.removeprefix("transformer.").rsplit(".", 2)[0], k.split(".")[-2]
        _, n, rest = mod.split(".", 2)
        orig = WAN_ORIGINAL[rest]
        base = f"lora_unet_blocks_{n}_{orig.replace('.', '_')}" if kohya else f"diffusion_model.blocks.{n}.{orig}"
        out[f"{base}.{'lora_down' if which == 'lora_A' else 'lora_up'}.weight"] = t
        out[f"{base}.alpha"] = torch.tensor(alpha)
    return out


def test_wan_comfyui_and_kohya_layouts_equal_diffusers(wan_setup, tmp_path):
    sd = load_file(str(wan_setup["a"] / "pytorch_lora_weights.safetensors"))
    save_file(wan_renamed(sd, kohya=False, alpha=8.0), str(tmp_path / "comfy.safetensors"))
    save_file(wan_renamed(sd, kohya=True, alpha=8.0), str(tmp_path / "kohya.safetensors"))
    rt = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), adapters={
        "d": str(wan_setup["a"]), "c": str(tmp_path / "comfy.safetensors"), "k": str(tmp_path / "kohya.safetensors")})
    rows = {r["name"]: r for r in rt.describe()["adapters"]}
    assert rows["d"]["layout"] == "diffusers" and rows["c"]["layout"] == rows["k"]["layout"] == "converted"
    ref = lat(rt.generate(wan_req([{"name": "d", "scale": 0.9}])))
    assert torch.equal(lat(rt.generate(wan_req([{"name": "c", "scale": 0.9}]))), ref)
    assert torch.equal(lat(rt.generate(wan_req([{"name": "k", "scale": 0.9}]))), ref)


def test_flux_kohya_fused_layout_equals_split_parts(flux_setup, tmp_path):
    from diffusers import FluxTransformer2DModel

    cfg = FluxTransformer2DModel.load_config(flux_setup["ckpt"] / "transformer")
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    g = torch.Generator().manual_seed(0)
    kohya: dict[str, torch.Tensor] = {}
    split: dict[str, torch.Tensor] = {}
    r, alpha = 2, 3.0
    for i in range(cfg["num_layers"]):
        down, up = torch.randn(r, inner, generator=g), torch.randn(3 * inner, r, generator=g) * 0.3
        kohya |= {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_down.weight": down,
                  f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_up.weight": up,
                  f"lora_unet_double_blocks_{i}_img_attn_qkv.alpha": torch.tensor(alpha)}
        for part, chunk in zip(("to_q", "to_k", "to_v"), up.chunk(3), strict=True):
            split |= {f"transformer.transformer_blocks.{i}.attn.{part}.lora_A.weight": down.clone(),
                      f"transformer.transformer_blocks.{i}.attn.{part}.lora_B.weight": chunk.contiguous()}
    for i in range(cfg["num_single_layers"]):
        down, up = torch.randn(r, inner, generator=g), torch.randn(7 * inner, r, generator=g) * 0.3
        kohya |= {f"lora_unet_single_blocks_{i}_linear1.lora_down.weight": down,
                  f"lora_unet_single_blocks_{i}_linear1.lora_up.weight": up,
                  f"lora_unet_single_blocks_{i}_linear1.alpha": torch.tensor(alpha)}
        parts = up.split([inner, inner, inner, 4 * inner])
        for part, chunk in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), parts, strict=True):
            split |= {f"transformer.single_transformer_blocks.{i}.{part}.lora_A.weight": down.clone(),
                      f"transformer.single_transformer_blocks.{i}.{part}.lora_B.weight": chunk.contiguous()}
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    # the split file carries alpha as diffusers' metadata does (lora_alpha for every module)
    import json
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": r, "transformer.lora_alpha": alpha})}
    save_file(split, str(tmp_path / "split.safetensors"), metadata=meta)
    rt = Runtime.from_model(flux_setup["ckpt"], manager=make_manager(("flux", flux_plugin), ("adapters", adapters_plugin), toy=False),
                            adapters={"k": str(tmp_path / "kohya.safetensors"), "s": str(tmp_path / "split.safetensors")})
    req = lambda name: {"task": "t2i", "prompt": PROMPT, "diffusion": {"steps": 2, "seed": 1, "height": 64, "width": 64},  # noqa: E731
                        "outputs": {"return_latents": True}, "adapters": [{"name": name, "scale": 0.7}]}
    base = lat(rt.generate({**req("k"), "adapters": []}))
    got = lat(rt.generate(req("k")))
    assert torch.equal(got, lat(rt.generate(req("s"))))
    assert not torch.equal(got, base)


# -- refused, with the name of what is wrong -----------------------------------------------------


def test_unknown_adapter_names_refused_before_compute(wan_setup):
    deploy = {"model": {"path": str(wan_setup["ckpt"])}, "adapters": {"a": str(wan_setup["a"])}}
    dep = Deployment(deploy, manager=wan_manager())  # no weights read
    with pytest.raises(RequestError) as e:
        dep.check(wan_req([{"name": "a"}, {"name": "zzz", "scale": 1.0}]))
    assert e.value.path == "adapters.1.name" and "'zzz'" in str(e.value) and "declares: a" in str(e.value)
    with pytest.raises(RequestError, match="named twice"):
        dep.check(wan_req([{"name": "a"}, {"name": "a"}]))
    with pytest.raises(RequestError) as e:
        dep.check(wan_req([{"name": "../../etc/passwd"}]))
    assert e.value.path == "adapters.0.name"
    with pytest.raises(RequestError) as e:
        dep.check(wan_req([{"name": "a", "scale": float("inf")}]))
    assert e.value.path == "adapters.0.scale"
    with pytest.raises(RequestError, match="at most 8"):
        Deployment({**deploy, "adapters": {f"n{i}": str(wan_setup["a"]) for i in range(9)}},
                   manager=wan_manager()).check(wan_req([{"name": f"n{i}"} for i in range(9)]))
    dep.check(wan_req([{"name": "a", "scale": 0.5}]))  # a declared one passes
    # and the loaded runtime refuses in prepare, before any step
    rt = Runtime(deploy, manager=wan_manager())  # a plain mapping, as a front end passes it
    with pytest.raises(RequestError, match="unknown adapter 'nope'"):
        rt.prepare(wan_req([{"name": "nope"}]))


def _deploy_error(wan_setup, adapters: dict[str, str], match: str, **extra: Any) -> None:
    deploy = {"model": {"path": str(wan_setup["ckpt"])}, "adapters": adapters, **extra}
    with pytest.raises(DeployError, match=match):
        Runtime.from_deploy(deploy, manager=wan_manager())


def test_bad_adapter_files_and_keys(wan_setup, tmp_path):
    _deploy_error(wan_setup, {"x": str(tmp_path / "missing.safetensors")}, r"adapters\.x: .*does not exist")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    _deploy_error(wan_setup, {"x": str(tmp_path / "junk.safetensors")}, r"adapters\.x: .*not a readable safetensors")
    (tmp_path / "w.bin").write_bytes(b"x")
    _deploy_error(wan_setup, {"x": str(tmp_path / "w.bin")}, r"not a \.safetensors file")
    save_file({"lora_unet_head_head.lora_down.weight": torch.zeros(2, 24), "something_else": torch.zeros(1)},
              str(tmp_path / "unknown.safetensors"))
    _deploy_error(wan_setup, {"x": str(tmp_path / "unknown.safetensors")},
                  r"adapters\.x: 2 key\(s\) not understood as Wan .*lora_unet_head_head\.lora_down\.weight, something_else")
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 24)}, str(tmp_path / "half.safetensors"))
    _deploy_error(wan_setup, {"x": str(tmp_path / "half.safetensors")}, r"blocks\.0\.attn1\.to_q: has no lora_B")
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 7),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 2)}, str(tmp_path / "shape.safetensors"))
    _deploy_error(wan_setup, {"x": str(tmp_path / "shape.safetensors")}, r"to_q: lora_A \(2, 7\).*do not fit a Linear 24 -> 24")
    save_file({"transformer.blocks.9.attn1.to_q.lora_A.weight": torch.zeros(2, 24),
               "transformer.blocks.9.attn1.to_q.lora_B.weight": torch.zeros(24, 2)}, str(tmp_path / "deep.safetensors"))
    _deploy_error(wan_setup, {"x": str(tmp_path / "deep.safetensors")}, r"targets transformer\.blocks\.9\.attn1\.to_q, which the model does not have")
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.full((2, 24), float("nan")),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 2)}, str(tmp_path / "nan.safetensors"))
    _deploy_error(wan_setup, {"x": str(tmp_path / "nan.safetensors")}, r"non-finite")
    _deploy_error(wan_setup, {"bad/name": str(wan_setup["a"])}, r"an adapter name is")
    _deploy_error(wan_setup, {"a": str(wan_setup["a"])}, r"compile_mode 'reduce-overhead' captures CUDA graphs",
                  compile=True, options={"compile_backend": "inductor", "compile_mode": "reduce-overhead"})
    _deploy_error(wan_setup, {"a": str(wan_setup["a"]), "b": str(wan_setup["b"])}, r"adapter_fuse: fusing needs exactly one",
                  adapter_fuse={"a": 1.0})


def test_family_without_adapter_support_refuses_adapters(wan_setup, toy_checkpoint):
    from omniloop.testing import make_manager as mm

    with pytest.raises(DeployError, match="does not support LoRA adapters"):
        Deployment({"model": {"path": str(toy_checkpoint)}, "adapters": {"a": str(wan_setup["a"])}}, manager=mm(("adapters", adapters_plugin)))


# -- fuse, LRU, compiled blocks ---------------------------------------------------------------


def test_fused_deployment_matches_unfused_and_refuses_request_adapters(wan_setup):
    unfused = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), adapters={"a": str(wan_setup["a"])})
    fused = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), adapters={"a": str(wan_setup["a"])},
                               adapter_fuse={"a": 0.8})
    assert not hooked(fused.model.components["transformer"].blocks[0].attn1.to_q)
    want = lat(unfused.generate(wan_req([{"name": "a", "scale": 0.8}])))
    got = lat(fused.generate(wan_req()))
    # W + s*B@A in one matmul vs W x + s*B(A x): float32 roundoff apart, not bitwise
    assert (got - want).abs().max() <= 1e-4
    with pytest.raises(RequestError, match="fuses its adapter"):
        fused.prepare(wan_req([{"name": "a"}]))
    assert fused.describe()["adapters"][0]["fused"] == 0.8


def test_lru_bound_reloads_evicted_adapters(wan_setup):
    rt = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), limits={"max_adapters": 1},
                            adapters={"a": str(wan_setup["a"]), "b": str(wan_setup["b"])})
    loads = rt.adapters.loads
    first = lat(rt.generate(wan_req([{"name": "a"}])))
    lat(rt.generate(wan_req([{"name": "b"}])))  # evicts a
    assert [r["loaded"] for r in rt.describe()["adapters"]] == [False, True]
    assert torch.equal(lat(rt.generate(wan_req([{"name": "a"}]))), first)
    assert rt.adapters.loads > loads


def test_compiled_blocks_switch_adapters_without_recompiling(wan_setup):
    """compile: true (backend 'eager': dynamo traces the blocks, fullgraph) — the hook's custom op
    reads the active set at run time, so a switch of adapters compiles nothing new; and the hooks
    carry no per-module constant, so all blocks share one graph (a recompile limit of 1 with 2
    blocks: a per-block specialisation fails the fullgraph compile, as it did on the H200)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    with torch._dynamo.config.patch(cache_size_limit=1):  # recompile_limit's alias on every torch
        eager = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(),
                                   adapters={"a": str(wan_setup["a"]), "b": str(wan_setup["b"])})
        rt = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), compile=True, options={"compile_backend": "eager"},
                                adapters={"a": str(wan_setup["a"]), "b": str(wan_setup["b"])})
        sets = [[{"name": "a", "scale": 0.8}], [], [{"name": "b", "scale": 1.0}, {"name": "a", "scale": 0.2}]]
        rt.generate(wan_req(sets[0]))  # first call of the shape compiles
        frames = counters["stats"]["unique_graphs"]
        assert frames > 0  # the blocks did compile
        for s in sets:
            got = lat(rt.generate(wan_req(s)))
            assert (got - lat(eager.generate(wan_req(s)))).abs().max() <= 1e-5
        assert counters["stats"]["unique_graphs"] == frames  # no recompilation on a switch


def test_adapters_apply_in_blocks_compiled_before_their_hooks(wan_setup):
    """Dynamo shares compiled code between instances of a block class and, by default, does not
    guard on module hooks: blocks of a deployment without adapters compiled first would be reused
    by a later deployment's hooked blocks and the adapter silently dropped (seen on the H200 bench:
    "unfused-compile" as fast as the base). The first adapter hook turns the hook guards on."""
    import torch._dynamo

    torch._dynamo.reset()
    # a fresh process (hook guards off), at most 2 graphs: the plain blocks' and the hooked blocks'
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True, cache_size_limit=2):
        plain = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), compile=True,
                                   options={"compile_backend": "eager"})
        base = lat(plain.generate(wan_req()))  # compiles the block class's forward, no hooks anywhere
        eager = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), adapters={"a": str(wan_setup["a"])})
        rt = Runtime.from_model(wan_setup["ckpt"], manager=wan_manager(), compile=True,
                                options={"compile_backend": "eager"}, adapters={"a": str(wan_setup["a"])})
        want = lat(eager.generate(wan_req([{"name": "a", "scale": 1.0}])))
        assert (want - base).abs().max() > 1e-3  # the adapter moves the output
        got = lat(rt.generate(wan_req([{"name": "a", "scale": 1.0}])))
        assert (got - want).abs().max() <= 1e-5
        assert torch.equal(lat(plain.generate(wan_req())), base)  # the plain deployment still runs without adapters


def test_an_absurd_lora_alpha_is_refused_at_load(wan_setup, tmp_path):
    """Issue 43, finding 8: alpha 1e308 over rank 2 loaded and turned every output black; now the
    deploy is refused naming the module and the scaling (real adapters scale by 0.5-4)."""
    sd = {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 24),
          "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(24, 2),
          "diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(1e308, dtype=torch.float64)}
    save_file(sd, str(tmp_path / "huge.safetensors"))
    _deploy_error(wan_setup, {"x": str(tmp_path / "huge.safetensors")},
                  r"adapters\.x: .*attn1\.to_q: alpha 1e\+308 over rank 2 scales the update by 5e\+307, more than 10000")


def test_unfused_adapters_refuse_cuda_graphs():
    """Deploy ``options.cuda_graphs`` (omniloop_kit.graphs) replays one captured forward: with
    unfused adapters it would apply one adapter set for every request; fused ones are fine."""
    from omniloop.errors import DeployError
    from omniloop_adapters import check_compile_mode

    with pytest.raises(DeployError, match=r"^adapters: options\.cuda_graphs replays one captured forward"):
        check_compile_mode({"cuda_graphs": True}, fused=False)
    check_compile_mode({"cuda_graphs": True}, fused=True)
    check_compile_mode({"cuda_graphs": False}, fused=False)
