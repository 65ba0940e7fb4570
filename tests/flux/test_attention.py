"""The deploy's attention backend inside FLUX.1's blocks, and deploy ``options.cuda_graphs``.

* With the core ``sdpa`` function, :class:`FluxBackendAttnProcessor` on every block (double- and
  single-stream, separate or fused projections) gives diffusers' transformer output bit for bit.
* A backend registered through ``omniloop_register_attention_backends`` is installed at load and
  called by every block's attention with ``[B, heads, L, D]``; computing the same thing, the
  request's latents equal the default deployment's.
* ``options.cuda_graphs`` (omniloop_kit.graphs) is refused on a CPU deploy before load; on CUDA a
  graphed request equals the plain one (skipped on CPU).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from omniloop.builtin import sdpa
from omniloop.errors import DeployError
from omniloop.family import AttentionBackendSpec
from omniloop.hookspecs import hookimpl
from omniloop.runtime import Runtime
from omniloop.testing import completed_latents
from omniloop_flux.attention import FluxBackendAttnProcessor, attention_modules, diffusers_attention, install, installed
from omniloop_flux.transformer import flux_forward

from .conftest import flux_manager

TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6))


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"),
                          dim=-1).reshape(16, 3)
    return {"hidden_states": torch.randn(1, 16, 16, generator=g), "timestep": torch.tensor([0.7]),
            "guidance": torch.tensor([3.5]), "pooled_projections": torch.randn(1, 32, generator=g),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=g), "img_ids": img_ids,
            "txt_ids": torch.zeros(8, 3)}


@pytest.mark.parametrize("fused", [False, True])
def test_processor_with_core_sdpa_is_bit_exact(fused: bool) -> None:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**TINY).eval()
    if fused:
        ref.fuse_qkv_projections()
    ours = copy.deepcopy(ref)
    x = _inputs()
    with torch.no_grad():
        want = ref(**x, return_dict=False)[0]
        assert install(ours, AttentionBackendSpec(name="sdpa-test", fn=sdpa)) == 4
        assert installed(ours) == "sdpa-test"
        assert all(isinstance(m.processor, FluxBackendAttnProcessor) for m in attention_modules(ours))
        assert torch.equal(flux_forward(ours, **x), want)
        with diffusers_attention(ours):
            assert type(ours.transformer_blocks[0].attn.processor).__name__ == "FluxAttnProcessor"
            assert torch.equal(flux_forward(ours, **x), want)
    assert isinstance(ours.single_transformer_blocks[0].attn.processor, FluxBackendAttnProcessor)  # restored


class CountingBackend:
    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.shapes.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q, k, v, **kw)


def test_the_deploy_backend_is_called_by_every_block(flux_ckpt, flux_runtime, make_t2i) -> None:
    fn = CountingBackend()

    class Plugin:
        OMNILOOP_HOOK_API = ">=1.0,<2"

        @hookimpl
        def omniloop_register_attention_backends(self, register: Any) -> None:
            register(AttentionBackendSpec(name="counting", fn=fn))

    manager = flux_manager()
    manager.add("counting-attention", Plugin())
    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=manager,
                            attention_backend="counting")
    tf = rt.model.components["transformer"]
    assert installed(tf) == "counting" and rt.model.config["attention_backend"] == "counting"
    req = make_t2i(steps=2)
    out = rt.generate(req)
    blocks = len(tf.transformer_blocks) + len(tf.single_transformer_blocks)
    assert len(fn.shapes) == 2 * blocks  # 2 steps, embedded guidance: one forward each
    heads = tf.config.num_attention_heads
    assert all(s[0] == 1 and s[1] == heads and s[3] == tf.config.attention_head_dim for s in fn.shapes)
    # the same computation gives the same latents as the default (diffusers' processors) deployment
    assert flux_runtime("dev").model.config["attention_backend"] == "sdpa"
    assert torch.equal(completed_latents(out), completed_latents(flux_runtime("dev").generate(req)))


def test_cuda_graphs_are_refused_on_a_cpu_deploy_before_load(refused_before_load) -> None:
    refused_before_load("cuda_graphs", [(True, r"^options\.cuda_graphs: CUDA graphs need a CUDA device, not cpu$"),
                                        ("on", r"^options\.cuda_graphs: expected true or false, got 'on'$")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_graphed_request_equals_the_plain_one_on_cuda(flux_ckpt, make_t2i) -> None:
    from omniloop_kit import graphs

    plain = Runtime.from_model(flux_ckpt("dev"), device="cuda", dtype="float32", manager=flux_manager())
    rt = Runtime.from_model(flux_ckpt("dev"), device="cuda", dtype="float32", manager=flux_manager(),
                            options={"cuda_graphs": True})
    req = make_t2i(steps=3)
    got = completed_latents(rt.generate(req))
    assert graphs.captured(rt.model.components["transformer"]) == 1
    assert torch.equal(got, completed_latents(plain.generate(req)))


def test_fused_qkv_option(flux_ckpt, flux_runtime, make_t2i) -> None:
    """``options.qkv: fused``: diffusers' fused projections (one GEMM over [Wq; Wk; Wv]; another GEMM
    shape may round differently: CPU float32 within 1e-5); a bad value is one line before load."""
    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=flux_manager(),
                            options={"qkv": "fused"})
    tf = rt.model.components["transformer"]
    assert rt.model.config["qkv"] == "fused" and all(m.fused_projections for m in attention_modules(tf))
    req = make_t2i(steps=2)
    torch.testing.assert_close(completed_latents(rt.generate(req)),
                               completed_latents(flux_runtime("dev").generate(req)), atol=1e-5, rtol=1e-5)
    with pytest.raises(DeployError, match=r"^options\.qkv: must be one of separate, fused, not 'both'$"):
        Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=flux_manager(),
                           options={"qkv": "both"})


def test_adapters_refuse_fused_qkv() -> None:
    from omniloop_flux.lora import check

    with pytest.raises(DeployError, match=r"^adapters: options\.qkv 'fused' computes Q/K/V without"):
        check(None, {"qkv": "fused"})
    check(None, {"qkv": "separate"})
