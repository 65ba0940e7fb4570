"""The deploy's attention backend runs inside the Wan blocks (omniloop's attention processor).

* With the core ``sdpa`` backend, every attention module (self-attention with QK norm and RoPE,
  cross-attention, Wan2.1 I2V cross-attention with the image key/values, fused projections)
  equals diffusers' own ``WanAttnProcessor`` bit for bit.
* A backend registered through ``omniloop_register_attention_backends`` is really called, once
  per attention (twice in I2V cross-attention: text and image), with ``[B, heads, L, D]``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from omniloop.builtin import sdpa
from omniloop.family import AttentionBackendSpec
from omniloop.hookspecs import hookimpl
from omniloop.runtime import Runtime
from omniloop_wan.attention import WanBackendAttnProcessor, diffusers_attention, install, installed

from .conftest import wan_manager


def _block_inputs(model: Any, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs of one transformer block, as wan_forward builds them (3 latent frames of 4x4)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = torch.randn(1, cfg.in_channels, 3, 4, 4, generator=g)
    text = torch.randn(1, 512, cfg.text_dim, generator=g)
    image = torch.randn(1, 17, cfg.image_dim, generator=g) if cfg.image_dim is not None else None
    rotary = model.rope(x)
    hidden = model.patch_embedding(x).flatten(2).transpose(1, 2)
    _, proj, enc, enc_img = model.condition_embedder(torch.tensor([700]), text, image)
    if enc_img is not None:
        enc = torch.concat([enc_img, enc], dim=1)
    return hidden, enc, proj.unflatten(1, (6, -1)), rotary


@pytest.mark.parametrize("variant", ["t2v", "i2v"], ids=["wan2.1-t2v", "wan2.1-i2v-image-kv"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate-qkv", "fused-qkv"])
def test_processor_with_sdpa_equals_diffusers_per_block(wan_runtime, variant, fused):
    model = wan_runtime(variant).model.components["transformer"]
    if fused:  # on a copy: fusing changes the shared modules
        model = copy.deepcopy(model)
        for m in model.modules():
            if hasattr(m, "fuse_projections") and m is not model:
                m.fuse_projections()
    assert installed(model) in ("sdpa", None)
    install(model, AttentionBackendSpec(name="sdpa", fn=sdpa))
    with torch.no_grad():
        inputs = _block_inputs(model)
        for block in model.blocks:
            assert isinstance(block.attn1.processor, WanBackendAttnProcessor)
            assert isinstance(block.attn2.processor, WanBackendAttnProcessor)
            ours = block(*inputs)
            with diffusers_attention(model):
                assert type(block.attn1.processor).__name__ == "WanAttnProcessor"
                ref = block(*inputs)
            assert torch.equal(ours, ref)
    assert isinstance(model.blocks[0].attn1.processor, WanBackendAttnProcessor)  # restored


class CountingBackend:
    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.shapes.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _runtime_with_backend(ckpt: Any, fn: Any) -> Runtime:
    class Plugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_attention_backends(self, register: Any) -> None:
            register(AttentionBackendSpec(name="counting", fn=fn))

    manager = wan_manager()
    manager.add("counting-attention", Plugin())
    return Runtime.from_model(ckpt, manager=manager, attention_backend="counting")


@pytest.mark.parametrize("variant, per_block", [("t2v", 2), ("i2v", 3), ("wan22", 2)])
def test_the_deploy_backend_is_called_by_every_attention(tiny_ckpt, wan_runtime, t2v_request, i2v_request,
                                                         variant, per_block):
    fn = CountingBackend()
    rt = _runtime_with_backend(tiny_ckpt(variant), fn)
    for name, tf in rt.model.components.items():
        if name.startswith("transformer"):
            assert installed(tf) == "counting"
            assert all(b.attn1.processor.backend == "counting" for b in tf.blocks)
    assert rt.model.config["attention_backend"] == "counting"
    req = (i2v_request if variant == "i2v" else t2v_request)(steps=2)
    out = rt.generate(req)
    heads = rt.model.components["transformer"].config.num_attention_heads
    blocks = len(rt.model.components["transformer"].blocks)
    forwards = 2 * 2  # 2 steps x (cond, uncond)
    assert len(fn.shapes) == forwards * blocks * per_block
    assert all(s[0] == 1 and s[1] == heads for s in fn.shapes)  # [B, heads, L, D]
    assert fn.shapes[0][2] == 12  # self-attention over 3 latent frames x 2x2 patches
    # a backend computing the same thing gives the same video as the default sdpa deployment
    ref = wan_runtime(variant).generate(req)
    assert torch.equal(out.artifacts["latents"].tensor, ref.artifacts["latents"].tensor)
