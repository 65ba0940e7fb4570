"""omniloop's FLUX.1 block forwards (omniloop_flux.blocks) and deploy ``options.modulation``.

* Installed in place of diffusers' blocks they share their modules (same state-dict keys) and, with
  nothing asked of them, give diffusers' transformer output bit for bit; :func:`restore` undoes it.
* A single block's split output projection (``options.ffn_gelu: fused``: no ``[attention ; mlp]``
  concatenation) equals ``proj_out(cat(...))`` up to float reassociation.
* The per-request modulation table gives each step's modulation; a forward fed its row matches the
  forward that computes the time embedding (float32: to reassociation in the table's GEMMs).
* ``options.modulation: per-request`` end to end on the tiny checkpoint: the request's latents match a
  ``per-step`` deployment's, batched requests too; refused values and offload fail before load.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from omniloop.runtime import Runtime
from omniloop.testing import completed_latents
from omniloop_flux import blocks
from omniloop_flux.transformer import flux_forward, time_embedding

from .conftest import flux_manager
from .test_attention import TINY, _inputs


def _pair() -> tuple[Any, Any]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**TINY).eval()
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_owned_blocks_are_bit_exact_and_share_the_modules(fused_mlp: bool) -> None:
    ref, ours = _pair()
    keys = {k: v.data_ptr() for k, v in ours.state_dict().items()}
    double0, single0 = ours.transformer_blocks[0], ours.single_transformer_blocks[0]
    assert blocks.install(ours, fused_mlp=fused_mlp) == TINY["num_layers"] + TINY["num_single_layers"]
    assert isinstance(ours.transformer_blocks[0], blocks.DoubleBlock) and isinstance(ours.single_transformer_blocks[1], blocks.SingleBlock)
    assert {k: v.data_ptr() for k, v in ours.state_dict().items()} == keys  # same tensors, same names
    assert ours.single_transformer_blocks[0].proj_out is single0.proj_out
    x = _inputs()
    with torch.no_grad():
        want = ref(**x, return_dict=False)[0]
        assert torch.equal(flux_forward(ours, **x), want)  # off CUDA the fused MLP is diffusers' form
    assert blocks.restore(ours) == 4 and not blocks.installed(ours)
    assert ours.transformer_blocks[0] is double0 and ours.single_transformer_blocks[0] is single0


def test_the_split_output_projection_equals_the_concatenated_one() -> None:
    _, ours = _pair()
    blocks.install(ours, fused_mlp=True)
    block = ours.single_transformer_blocks[0]
    g = torch.Generator().manual_seed(1)
    x, attn = torch.randn(1, 24, 32, generator=g), torch.randn(1, 24, 32, generator=g)
    with torch.no_grad():
        want = block.proj_out(torch.cat([attn, block.act_mlp(block.proj_mlp(x))], dim=2))
        got = block._mlp_and_out(x, attn)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # two partial sums instead of one


def test_a_forward_fed_its_modulation_row_matches_the_time_embedding_one() -> None:
    _, ours = _pair()
    blocks.install(ours)
    x = _inputs()
    steps = torch.tensor([1.0, 0.7, 0.3])
    with torch.no_grad():
        temb = torch.cat([time_embedding(ours, t.expand(1), x["guidance"], x["pooled_projections"], torch.float32)
                          for t in steps])
        table = blocks.modulation_table(ours, temb)
        assert table.shape == (3, sum(blocks.modulation_widths(ours)))
        dim = TINY["num_attention_heads"] * TINY["attention_head_dim"]
        assert blocks.modulation_widths(ours) == [12 * dim] * 2 + [3 * dim] * 2 + [2 * dim]
        # the first double block's image-stream modulation, as its norm1 computes it at step 1
        row1 = ours.transformer_blocks[0].norm1.linear(torch.nn.functional.silu(temb[1:2]))
        torch.testing.assert_close(table[1:2, :6 * dim], row1, rtol=0, atol=1e-6)
        want = flux_forward(ours, **{**x, "timestep": steps[1:2]})
        rest = {k: v for k, v in x.items() if k not in ("timestep", "guidance", "pooled_projections")}
        got = flux_forward(ours, **rest, timestep=None, guidance=None, pooled_projections=None, modulation=table[1:2])
    # float32: the table's 3-row GEMMs against the 1-row products of the plain forward
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_options_modulation_end_to_end(flux_ckpt, make_t2i) -> None:
    plain = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=flux_manager())
    rt = Runtime.from_model(flux_ckpt("dev"), device="cpu", dtype="float32", manager=flux_manager(),
                            options={"modulation": "per-request"})
    assert plain.model.config["modulation"] == "per-step" and rt.model.config["modulation"] == "per-request"
    assert blocks.installed(rt.model.components["transformer"])
    assert not blocks.installed(plain.model.components["transformer"])
    req = make_t2i(steps=3)
    torch.testing.assert_close(completed_latents(rt.generate(req)), completed_latents(plain.generate(req)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("task", ["t2i", "i2i"])
def test_per_request_modulation_with_true_cfg_and_i2i(flux_runtime, make_t2i, make_i2i, input_png, task) -> None:
    """True CFG gives each branch its own pooled text, so its own table; image-to-image cuts the schedule by
    ``strength``, so the table covers the kept timesteps only. Both match the per-step deployment."""
    req = make_t2i(seed=7, steps=3) if task == "t2i" else make_i2i(input_png, seed=3, steps=5, height=64, width=64)
    req["inputs"] = [*req.get("inputs", []), {"type": "text", "text": "blurry, low quality", "role": "negative_prompt"}]
    req["diffusion"]["guidance_scale"] = 4.0
    req["node_params"] = {"denoise": {"cfg": "classic"}}
    want = completed_latents(flux_runtime("dev").generate(req))
    got = completed_latents(flux_runtime("dev", options={"modulation": "per-request"}).generate(req))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_batched_requests_stack_their_modulation_rows(flux_runtime, make_t2i) -> None:
    reqs = [make_t2i(seed=s, steps=3) for s in (1, 2)]
    reqs[1]["diffusion"]["guidance_scale"] = 5.0  # each request's own guidance, so its own table
    alone = [completed_latents(flux_runtime("dev").generate(r)) for r in reqs]
    rt = flux_runtime("dev", scheduler="step", options={"modulation": "per-request"})
    streams = [rt.stream(r) for r in reqs]
    outs = [[e for e in s if e.output is not None][-1].output for s in streams]
    assert max(len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step") == 2
    for got, want in zip(outs, alone, strict=True):
        torch.testing.assert_close(completed_latents(got), want, rtol=1e-4, atol=1e-4)


def test_refused_values_and_offload_before_load(refused_before_load) -> None:
    refused_before_load("modulation", [("once", r"^options\.modulation: must be one of per-step, per-request, not 'once'$")])
    from omniloop_flux.family import offload_refusal

    assert offload_refusal("sequential", {}) is None
    assert "options.modulation 'per-request'" in (offload_refusal("model", {"modulation": "per-request"}) or "")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused MLP and CUDA graphs need a CUDA device")
def test_fused_mlp_and_per_request_modulation_on_cuda_under_graphs(flux_ckpt, make_t2i) -> None:
    plain = Runtime.from_model(flux_ckpt("dev"), device="cuda", dtype="bfloat16", manager=flux_manager())
    rt = Runtime.from_model(flux_ckpt("dev"), device="cuda", dtype="bfloat16", manager=flux_manager(),
                            options={"ffn_gelu": "fused", "modulation": "per-request", "cuda_graphs": True})
    tf = rt.model.components["transformer"]
    assert blocks.installed(tf) and all(b.fused_mlp for b in tf.single_transformer_blocks)
    req = make_t2i(steps=3)
    want = completed_latents(plain.generate(req)).float()
    for _ in range(2):  # the second request replays the graph captured by the first
        got = completed_latents(rt.generate(req)).float()
        # GELU on the float32 accumulator, two rounded partial products, the table's GEMMs: a few bf16 ulps
        assert (got - want).norm() / want.norm() < 2e-2
