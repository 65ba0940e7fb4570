"""Issue 8 code paths, checked on CPU: text-embedding cache, regional compile, VAE tiling/slicing.

Compilation uses a counting ``torch.compile`` backend that runs the captured graph eagerly
(``options.compile_backend``): it checks the wiring — every block compiled with
``fullgraph=True`` (a graph break would raise), the compiled blocks used in the plain block loop,
eager blocks when a plugin needs eager — in well under a second; inductor code generation is
for the GPU benchmark (bench/wan_gpu.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omniloop.errors import DeployError
from omniloop.family import PluginComponentSpec
from omniloop.hookspecs import hookimpl
from omniloop.runtime import Runtime
from omniloop_wan.textcache import TextEmbeddingCache

from .conftest import wan_manager

# -- text-embedding cache ------------------------------------------------------------------------------


class EncoderCalls:
    """Counts text-encoder forwards through a forward hook."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.n = 0
        self.handle = encoder.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.n += 1


def test_repeated_prompts_and_the_shared_negative_prompt_are_encoded_once(tiny_ckpt, t2v_request):
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"text_cache": 8})
    calls = EncoderCalls(rt.model.components["text_encoder"])
    first = rt.generate(t2v_request(steps=2))
    assert calls.n == 2 and first.metrics["text_cache"] == {"hits": 0, "misses": 2, "entries": 2}
    again = rt.generate(t2v_request(steps=2, seed=9))
    assert calls.n == 2 and again.metrics["text_cache"]["hits"] == 2
    other = t2v_request(steps=2)
    other["inputs"][0]["text"] = "a blue bird flies"  # same negative prompt
    third = rt.generate(other)
    assert calls.n == 3 and third.metrics["text_cache"] == {"hits": 1, "misses": 1, "entries": 3}
    # identical outputs from cached embeddings
    same = rt.generate(t2v_request(steps=2))
    assert torch.equal(same.artifacts["latents"].tensor, first.artifacts["latents"].tensor)
    uncached = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"text_cache": 0})
    ref = uncached.generate(t2v_request(steps=2))
    assert "text_cache" not in ref.metrics and uncached.model.config["text_cache"] is None
    assert torch.equal(ref.artifacts["latents"].tensor, first.artifacts["latents"].tensor)
    assert rt.model.config["text_cache"].stats() == {"entries": 3, "capacity": 8, "hits": 5, "misses": 3,
                                                     "evictions": 0}


def test_text_cache_is_on_by_default_and_bounded(wan_runtime):
    from omniloop_wan.textcache import DEFAULT_ENTRIES

    assert wan_runtime("t2v").model.config["text_cache"].capacity == DEFAULT_ENTRIES
    cache = TextEmbeddingCache(2, weight_version="v1")
    enc = object()
    encodes: list[str] = []

    def get(text: str, version: TextEmbeddingCache = cache) -> bool:
        def encode() -> Any:
            encodes.append(text)
            return torch.zeros(1), torch.ones(1)

        return version.get_or_encode(version.key(text, enc, torch.float32, torch.device("cpu")), encode)[1]

    assert [get("a"), get("b"), get("a"), get("c"), get("b")] == [False, False, True, False, False]
    assert encodes == ["a", "b", "c", "b"] and cache.evictions == 2 and len(cache) == 2  # b was least recent
    # another weight version never hits
    other = TextEmbeddingCache(2, weight_version="v2")
    assert cache.key("a", enc, torch.float32, torch.device("cpu")) != other.key("a", enc, torch.float32,
                                                                                 torch.device("cpu"))


def test_weight_version_comes_from_the_weight_files(wan_runtime):
    model = wan_runtime("t2v").model
    assert len(model.weight_version) == 16 and model.config["text_cache"].weight_version == model.weight_version


@pytest.mark.parametrize("value", [-1, "64", 2.5])
def test_bad_text_cache_option(tiny_ckpt, value):
    with pytest.raises(DeployError, match=r"options\.text_cache"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"text_cache": value})


# -- regional compile ------------------------------------------------------------------------------------

GRAPHS: list[int] = []


def _counting_backend(gm: Any, example_inputs: Any) -> Any:
    GRAPHS.append(len(gm.graph.nodes))
    return gm.forward


@pytest.fixture(scope="module")
def compiled_runtime(tiny_ckpt):
    from torch._dynamo import register_backend

    register_backend(_counting_backend, name="omniloop_wan_test_counting")
    return Runtime.from_model(tiny_ckpt("wan22"), manager=wan_manager(), compile=True,
                              options={"compile_backend": "omniloop_wan_test_counting"})


def test_compile_true_compiles_each_block_and_equals_eager(compiled_runtime, wan_runtime, t2v_request):
    from torch._dynamo.utils import counters

    from omniloop_wan.compile import compiled

    torch._dynamo.reset()
    GRAPHS.clear()
    counters.clear()
    rt = compiled_runtime
    for name in ("transformer", "transformer_2"):
        cb = compiled(rt.model.components[name])
        assert cb is not None and len(cb.blocks) == len(rt.model.components[name].blocks)
    out = rt.generate(t2v_request(steps=4))
    assert out.ok, out.error
    # one graph per block signature (all blocks share the code; the two experts share the shapes)
    assert len(GRAPHS) == 1 and GRAPHS[0] > 50
    assert not counters["graph_break"]  # fullgraph=True: a break would have raised anyway
    ref = wan_runtime("wan22").generate(t2v_request(steps=4))
    assert torch.equal(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)
    den = out.metrics["denoise"]
    assert den["compile"] == {"enabled": True, "regional": True, "blocks": 4, "backend": "omniloop_wan_test_counting",
                              "mode": None, "fullgraph": True}
    assert den["first_step_seconds"] > 0 and den["steady_step_seconds"] > 0  # compile time apart from the rest
    rt.generate(t2v_request(steps=2, seed=3))
    assert len(GRAPHS) == 1  # same shape: no recompilation


class EagerObserver:
    needs_eager = True

    @hookimpl
    def omniloop_step_end(self, request: Any, node: str, step: int, total: int, loop: Any, seconds: float) -> None:
        pass


def test_a_plugin_that_needs_eager_gets_the_eager_blocks(tiny_ckpt, t2v_request):
    class Plugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_observers(self, register: Any) -> None:
            register(PluginComponentSpec(name="eager-watch", kind="observer", factory=lambda cfg: EagerObserver()))

    from torch._dynamo import register_backend

    seen: list[int] = []

    def must_not_run(gm: Any, example_inputs: Any) -> Any:
        seen.append(1)
        return gm.forward

    register_backend(must_not_run, name="omniloop_wan_test_never")
    manager = wan_manager()
    manager.add("eager-watch", Plugin())
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=manager, compile=True, plugins={"eager-watch": {}},
                            options={"compile_backend": "omniloop_wan_test_never"})
    out = rt.generate(t2v_request(steps=2))
    assert out.ok and not seen
    assert out.metrics["denoise"]["compile"]["enabled"] is False


def test_compile_options_are_checked_at_load(tiny_ckpt):
    with pytest.raises(DeployError, match="compile_mode"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), compile=True,
                           options={"compile_backend": "eager", "compile_mode": "max-autotune"})
    with pytest.raises(DeployError, match="compile_inductor: 'no_such_setting'"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"compile_inductor": {"no_such_setting": 1}})
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"compile_backend": "eager"})
    from omniloop_wan.compile import compiled

    assert compiled(rt.model.components["transformer"]) is None  # compile: false (the default)
    # a known option of every family that compiles: the wrappers carry the inductor settings (lazy: no compile here)
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), compile=True,
                            options={"compile_inductor": {"triton.multi_kernel": 1}})
    assert compiled(rt.model.components["transformer"]).options == {"triton.multi_kernel": 1}


# -- VAE tiling / slicing ---------------------------------------------------------------------------------


def test_vae_tiling_and_slicing_options(tiny_ckpt, t2v_request, monkeypatch):
    tiles = {"tile_sample_min_height": 16, "tile_sample_min_width": 16,
             "tile_sample_stride_height": 8, "tile_sample_stride_width": 8}
    rt = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(),
                            options={"vae_tiling": tiles, "vae_slicing": True})
    vae = rt.model.components["vae"]
    assert vae.use_tiling and vae.use_slicing and vae.tile_sample_min_height == 16
    tiled: list[int] = []
    original = type(vae).tiled_decode

    def spy(self: Any, z: torch.Tensor, *a: Any, **kw: Any) -> Any:
        tiled.append(z.shape[-1])
        return original(self, z, *a, **kw)

    monkeypatch.setattr(type(vae), "tiled_decode", spy)
    out = rt.generate(t2v_request(steps=1))
    assert out.ok and tiled == [4]  # 32 px = 4 latent columns, above the 2-column tile
    assert tuple(out.artifacts["video"].frames.shape) == (9, 32, 32, 3)
    assert out.metrics["node_seconds"]["vae_decode"] > 0  # decode time, per request
    with pytest.raises(DeployError, match=r"options\.vae_tiling\.tile_size"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"vae_tiling": {"tile_size": 64}})
    with pytest.raises(DeployError, match=r"options\.vae_slicing"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"vae_slicing": "yes"})


# -- GPU: the real inductor path ------------------------------------------------------------------


@pytest.mark.gpu
def test_inductor_compile_on_cuda_matches_eager_within_bf16_tolerance(tiny_ckpt, t2v_request):
    """Inductor on CUDA fuses norms, RoPE and modulation, so bf16 rounding differs from eager.

    Tolerance: relative RMS of the final latents <= 2e-2 (bf16 keeps 8 mantissa bits, ~4e-3
    relative per rounding; a few steps of a 4-block model accumulate a few of those), the same kind
    of bound bench/wan_gpu.py states for the 1.3B model against diffusers.
    """
    torch._dynamo.reset()
    deploy = {"device": "cuda", "dtype": "bfloat16"}
    eager = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), **deploy)
    compiled = Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), compile=True, **deploy)
    ref = eager.generate(t2v_request(steps=4))
    out = compiled.generate(t2v_request(steps=4))
    assert ref.ok and out.ok, (ref.error, out.error)
    a = out.artifacts["latents"].tensor.float()
    b = ref.artifacts["latents"].tensor.float()
    rel_rms = float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())
    assert rel_rms <= 2e-2, rel_rms
    den = out.metrics["denoise"]
    assert den["compile"]["enabled"] and den["compile"]["backend"] == "inductor"


# -- options.qkv: fused ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_qkv_fused_uses_one_projection_and_matches_separate(tiny_ckpt, wan_runtime, t2v_request, i2v_request, variant):
    """``options.qkv: fused`` (diffusers' ``fuse_projections``): every attention computes Q/K/V (cross-
    attention K/V, I2V's image K/V) with one GEMM over the concatenated weights — the separate linears
    are never called — and the latents equal the separate path's up to float32 summation order."""
    body = t2v_request() if variant == "t2v" else i2v_request()
    base = wan_runtime(variant)
    fused = Runtime.from_model(tiny_ckpt(variant), manager=wan_manager(), options={"qkv": "fused"})
    assert fused.model.config["qkv"] == "fused" and base.model.config["qkv"] == "separate"
    tf = fused.model.components["transformer"]
    attns = [m for m in tf.modules() if hasattr(m, "fuse_projections")]
    assert attns and all(m.fused_projections for m in attns)
    unused = [m.to_k for m in attns] + [m.to_v for m in attns] + [m.to_q for m in attns if not m.is_cross_attention]
    calls: list[str] = []
    hooks = [lin.register_forward_hook(lambda *_: calls.append("separate")) for lin in unused]
    try:
        a, b = base.generate(body), fused.generate(body)
    finally:
        for h in hooks:
            h.remove()
    assert a.ok and b.ok and calls == []
    la, lb = a.artifacts["latents"].tensor, b.artifacts["latents"].tensor
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)


def test_qkv_option_is_checked_at_load(tiny_ckpt):
    with pytest.raises(DeployError, match=r"options\.qkv: must be one of separate, fused"):
        Runtime.from_model(tiny_ckpt("t2v"), manager=wan_manager(), options={"qkv": "yes"})
