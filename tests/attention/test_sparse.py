"""sparse-tile: the sliding-tile mask against a brute-force definition, the flex BlockMask's block
tables against the token mask, density 1.0 against dense SDPA, the deploy knob's validation at
load, exact requests refused, and the tiny Wan checkpoint end to end (the processor hands the
self-attention calls their (T, H, W) grid; cross-attention stays dense)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from omniloop.errors import DeployError, RequestError
from omniloop.testing import make_manager
from omniloop_attention import plugin
from omniloop_attention.backends import BACKENDS
from omniloop_attention.sparse import SparseTileAttention, TileLayout

SPEC = {b.name: b for b in BACKENDS}["sparse-tile"]

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_thread")]



def brute_force_mask(grid, tile, density, global_frames=0, block=128):
    """The definition, in plain Python: tokens in tile order (tiles in a 3-D snake, each tile
    frame-major), cut into blocks; query block i keeps the round(density * blocks) key blocks
    whose centroid (in tiles) is nearest — Chebyshev, then Euclidean, then index — plus the blocks
    holding a token of the first ``global_frames`` frames. Returned per token, frame-major."""
    T, H, W = grid
    tile = [min(a, b) for a, b in zip(tile, grid, strict=True)]
    nh, nw = math.ceil(H / tile[1]), math.ceil(W / tile[2])

    def key(xyz):
        t, h, w = xyz
        it, ih, iw = t // tile[0], h // tile[1], w // tile[2]
        row = it * nh + (nh - 1 - ih if it % 2 else ih)
        rank = row * nw + (nw - 1 - iw if row % 2 else iw)
        inner = ((t % tile[0]) * tile[1] + h % tile[1]) * tile[2] + w % tile[2]
        return (rank, inner)

    order = sorted(itertools.product(range(T), range(H), range(W)), key=key)
    blocks = [order[i:i + block] for i in range(0, len(order), block)]
    nb = len(blocks)
    cent = [[sum(x[d] for x in blk) / len(blk) / tile[d] for d in range(3)] for blk in blocks]
    keep = max(1, min(nb, round(density * nb)))
    allowed = [[False] * nb for _ in range(nb)]
    for i in range(nb):
        def dist(j, i=i):
            diff = [abs(cent[i][d] - cent[j][d]) for d in range(3)]
            return (max(diff), sum(x * x for x in diff), j)
        for j in sorted(range(nb), key=dist)[:keep]:
            allowed[i][j] = True
        for j, blk in enumerate(blocks):
            if any(x[0] < global_frames for x in blk):
                allowed[i][j] = True
    block_of = {xyz: i // block for i, xyz in enumerate(order)}
    raw = [block_of[xyz] for xyz in itertools.product(range(T), range(H), range(W))]
    return torch.tensor([[allowed[a][b] for b in raw] for a in raw])


@pytest.mark.parametrize("grid,tile,density,global_frames,block", [
    ((4, 6, 10), (2, 3, 4), 0.5, 0, 16),
    ((5, 5, 7), (2, 2, 3), 0.2, 0, 8),    # uneven edge tiles in every dimension: blocks span tiles
    ((5, 4, 6), (1, 2, 2), 0.3, 2, 4),    # plus the first two frames as global keys
    ((3, 4, 4), (1, 1, 1), 1.0, 0, 8),
])
def test_token_mask_matches_brute_force(grid, tile, density, global_frames, block):
    lay = TileLayout(grid, tile, density, global_frames, block=block)
    ref = brute_force_mask(grid, tile, density, global_frames, block)
    assert torch.equal(lay.token_mask(), ref)
    assert lay.density == pytest.approx(ref.double().mean().item(), abs=1e-12)
    if density == 1.0:
        assert ref.all()
    else:
        assert not ref.all()


@pytest.mark.parametrize("block", [8, 16, 128])
def test_block_tables_reproduce_the_token_mask(block):
    """What the GPU kernel computes: empty blocks skipped, full blocks without a mask (there are
    no partial blocks: a tile is a block). Rebuilt from the BlockMask's tables that is exactly the
    token mask, and the eager path's mask_mod says the same token by token."""
    lay = TileLayout((5, 5, 7), (2, 2, 3), 0.3, block=block)
    L, nb = lay.length, lay.n_blocks
    perm_mask = lay.token_mask()[lay.perm_cpu][:, lay.perm_cpu]
    bm = lay.block_mask
    assert int(bm.kv_num_blocks.sum()) == 0  # no partial blocks
    rebuilt = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    for qb in range(nb):
        for j in range(int(bm.full_kv_num_blocks[0, 0, qb])):
            kb = int(bm.full_kv_indices[0, 0, qb, j])
            rebuilt[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block] = True
    assert torch.equal(rebuilt[:L, :L], perm_mask)
    idx = torch.arange(L)
    assert torch.equal(bm.mask_mod(0, 0, idx.view(-1, 1), idx.view(1, -1)), perm_mask)
    counts = bm.full_kv_num_blocks[0, 0]
    assert (counts == lay.keep).all() and 0 < lay.keep < nb  # every query block keeps the same number


@pytest.mark.parametrize("density", [0.5, 0.25])
def test_output_equals_masked_sdpa(density):
    torch.manual_seed(0)
    grid = (4, 6, 10)
    fn = SparseTileAttention(density, tile=(2, 3, 4))
    q, k, v = (torch.randn(2, 3, 240, 16) for _ in range(3))
    out = fn(q, k, v, grid=grid)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=fn.layout(grid).token_mask())
    # float32; flex (eager) and SDPA differ in summation order only: a few ulps of O(1) values
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    dense = F.scaled_dot_product_attention(q, k, v)
    assert (out - dense).abs().max() > 1e-2  # the mask matters


def test_density_one_equals_dense_sdpa():
    """density 1.0 keeps every tile: dense attention by the sparse path (permute, flex, un-permute).
    float32 on the CPU: equal to SDPA within 2e-6 absolute (outputs O(1); summation order only)."""
    torch.manual_seed(1)
    grid = (3, 5, 7)
    fn = SparseTileAttention(1.0, tile=(2, 2, 2))
    assert fn.layout(grid).density == 1.0
    q, k, v = (torch.randn(1, 2, 105, 32) for _ in range(3))
    torch.testing.assert_close(fn(q, k, v, grid=grid), F.scaled_dot_product_attention(q, k, v), rtol=0, atol=2e-6)


def test_without_grid_it_is_dense_sdpa_and_a_wrong_grid_is_an_error():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    fn = SparseTileAttention(0.3)
    assert torch.equal(fn(q, k, v), F.scaled_dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match=r"grid 2x3x5 is 30 tokens, but q/k/v have 24/24/24"):
        fn(q, k, v, grid=(2, 3, 5))
    with pytest.raises(ValueError, match="takes no attn_mask"):
        fn(q, k, v, grid=(2, 3, 4), attn_mask=torch.ones(24, 24, dtype=torch.bool))


def test_wan_480p_layout_density():
    """The Wan 1.3B 480x832x81 grid (21x30x52 tokens) at the default tile: the kernel visits the
    requested fraction of blocks (to one block per row), and each block is a compact region."""
    for density in (0.5, 0.3, 0.15):
        lay = TileLayout((21, 30, 52), (2, 8, 8), density)
        assert abs(lay.block_density - density) <= 1 / lay.n_blocks, lay
        assert abs(lay.density - density) < 0.01, lay
    _, H, W = lay.grid
    for b in range(lay.n_blocks):
        p = lay.perm_cpu[b * 128:(b + 1) * 128]
        t, h, w = p // (H * W), (p // W) % H, p % W
        extent = [int(x.max() - x.min() + 1) for x in (t, h, w)]
        # compact: its bounding box holds at most 3x its 128 tokens (frame-major 128-token runs: 1x3x52)
        assert extent[0] * extent[1] * extent[2] <= 3 * 128, (b, extent)


# -------------------------------------------------------------------------------------------
# the deploy knob, at load
# -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,match", [
    ({"density": 0}, r"attention_options\.density: must be > 0"),
    ({"density": -0.5}, r"attention_options\.density: must be > 0"),
    ({"density": 1.5}, r"attention_options\.density: must be <= 1"),
    ({"density": float("nan")}, r"attention_options\.density: must be a finite number"),
    ({"density": "half"}, r"attention_options\.density"),
    ({"tile": [1, 2]}, r"attention_options\.tile: must be three integers >= 1"),
    ({"tile": [1, 0, 2]}, r"attention_options\.tile: must be three integers >= 1"),
    ({"global_frames": -1}, r"attention_options\.global_frames: must be >= 0"),
    ({"dense": True}, r"attention_options"),
])
def test_bad_options_are_refused_at_load(toy_checkpoint, options, match):
    from omniloop.runtime import Deployment

    with pytest.raises(DeployError, match=match) as info:
        Deployment({"model": {"path": str(toy_checkpoint)}, "attention_backend": "sparse-tile",
                    "attention_options": options}, manager=make_manager(("attention", plugin)))
    assert "\n" not in str(info.value)


def test_options_for_a_backend_without_any_are_refused(toy_checkpoint):
    from omniloop.runtime import Deployment

    with pytest.raises(DeployError, match=r"attention_options: backend 'sdpa' takes no options, got \['density'\]"):
        Deployment({"model": {"path": str(toy_checkpoint)}, "attention_backend": "sdpa",
                    "attention_options": {"density": 0.5}},
                   manager=make_manager(("attention", plugin)))


def test_refused_at_load_without_flex_attention(toy_checkpoint, monkeypatch):
    import attrs

    from omniloop.runtime import Deployment
    from omniloop_attention import backends

    patched = attrs.evolve(SPEC, available=lambda: "this torch (2.4.0) has no torch.nn.attention.flex_attention")
    monkeypatch.setattr(backends, "BACKENDS", [patched if b.name == "sparse-tile" else b for b in backends.BACKENDS])
    with pytest.raises(DeployError, match="attention_backend: 'sparse-tile' cannot run here: this torch"):
        Deployment({"model": {"path": str(toy_checkpoint)}, "attention_backend": "sparse-tile"},
                   manager=make_manager(("attention", plugin)))


def test_options_reach_the_backend_and_exact_requests_are_refused(wan_ckpt):
    """(The toy family passes no token grid, so sparse-tile is refused there: test_sparse_refusals.py.)"""
    rt = _wan_runtime(wan_ckpt, attention_backend="sparse-tile",
                      attention_options={"density": 0.25, "tile": [1, 2, 2], "global_frames": 1})
    fn = rt.attention.fn
    assert isinstance(fn, SparseTileAttention) and (fn.density, fn.tile, fn.global_frames) == (0.25, (1, 2, 2), 1)
    assert rt.attention.distribution_altering
    with pytest.raises(RequestError, match="attention backend 'sparse-tile' alters outputs; exact requests cannot use it"):
        rt.generate(_wan_request(exact=True))


# -------------------------------------------------------------------------------------------
# the tiny Wan checkpoint, end to end
# -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan_ckpt(tmp_path_factory):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from omniloop_wan.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-wan-sparse"))


def _wan_request(**extra):
    return {
        "task": "t2v", "prompt": "a red fox",
        "diffusion": {"steps": 2, "guidance_scale": 5.0, "seed": 7, "height": 32, "width": 64, "frames": 9},
        "outputs": {"return_latents": True}, **extra,
    }


def _wan_runtime(ckpt, **deploy):
    import omniloop_wan.plugin as wan_plugin
    from omniloop.runtime import Runtime

    return Runtime.from_model(ckpt, manager=make_manager(("wan", wan_plugin), ("attention", plugin), toy=False), **deploy)


def test_wan_tiny_runs_end_to_end(wan_ckpt, monkeypatch):
    """9 frames at 32x64: a 3x2x4 latent token grid (24 tokens). With 4-token blocks (the module's
    BLOCK, patched: 128 would make this grid one block), tile [1, 1, 1] and density 0.25 the
    self-attention is really sparse; density 1.0 gives the dense (sdpa) result within float32
    rounding; exact requests are refused on the sparse deployment."""
    from omniloop_attention import sparse

    monkeypatch.setattr(sparse, "BLOCK", 4)
    lat_dense = _wan_runtime(wan_ckpt).generate(_wan_request()).artifacts["latents"].tensor

    sparse_rt = _wan_runtime(wan_ckpt, attention_backend="sparse-tile",
                             attention_options={"density": 0.25, "tile": [1, 1, 1]})
    fn = sparse_rt.attention.fn
    out = sparse_rt.generate(_wan_request())
    assert out.status.value == "completed"
    assert list(fn._layouts) == [((3, 2, 4), "cpu", None)]  # the processor passed the self-attention grid
    lay = next(iter(fn._layouts.values()))
    assert lay.n_blocks == 6 and lay.keep == 2 and lay.density < 0.5
    lat_sparse = out.artifacts["latents"].tensor
    assert torch.isfinite(lat_sparse).all()
    assert (lat_sparse - lat_dense).abs().max() > 1e-4  # sparse attention changed the sample

    full = _wan_runtime(wan_ckpt, attention_backend="sparse-tile", attention_options={"density": 1.0, "tile": [1, 1, 1]})
    lat_full = full.generate(_wan_request()).artifacts["latents"].tensor
    # density 1.0: the same attention up to summation order; 2 steps of a tiny float32 model
    torch.testing.assert_close(lat_full, lat_dense, rtol=0, atol=1e-4)

    with pytest.raises(RequestError, match="exact requests cannot use it"):
        sparse_rt.generate(_wan_request(exact=True))


def test_wan_processor_passes_the_grid_to_self_attention_only():
    """A backend declaring ``accepts_grid`` gets ``grid=(T, H, W)`` on every self-attention call of a
    Wan forward and never on cross-attention; a backend without it is called as before."""
    pytest.importorskip("diffusers")
    from diffusers import WanTransformer3DModel

    from omniloop.builtin import sdpa
    from omniloop.family import AttentionBackendSpec
    from omniloop_wan import attention
    from omniloop_wan.transformer import wan_forward

    class Spy:
        accepts_grid = True

        def __init__(self):
            self.calls = []

        def __call__(self, q, k, v, grid=None, **kw):
            self.calls.append((q.shape[-2], k.shape[-2], grid))
            return F.scaled_dot_product_attention(q, k, v, **kw)

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=8, freq_dim=16, ffn_dim=16, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32,
    ).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 3, 4, 8, generator=g)  # latent grid 3 x 2 x 4 after 2x2 patches
    text = torch.randn(1, 512, 8, generator=g)
    attention.install(model, AttentionBackendSpec(name="sdpa", fn=sdpa))
    with torch.no_grad():
        ref = wan_forward(model, x, torch.tensor([500.0]), text, None, None)
    spy = Spy()
    attention.install(model, AttentionBackendSpec(name="spy", fn=spy))
    with torch.no_grad():
        out = wan_forward(model, x, torch.tensor([500.0]), text, None, None)
    assert sorted(spy.calls, key=str) == sorted([(24, 24, (3, 2, 4))] * 2 + [(24, 512, None)] * 2, key=str)
    assert torch.equal(out, ref)  # the spy computes what sdpa does
