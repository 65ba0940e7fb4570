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
from omniloop_attention.sparse import SparseTileAttention, TileLayout, choose_window

SPEC = {b.name: b for b in BACKENDS}["sparse-tile"]

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def brute_force_mask(grid, tile, window, global_frames=0):
    """The definition, token by token in frame-major order: query token q attends key token k iff
    k's tile lies, in every dimension, inside the k-wide window of q's tile (slid inward at the
    edges), or k's tile starts within the first ``global_frames`` frames."""
    T, H, W = grid
    ns = [math.ceil(g / t) for g, t in zip(grid, tile, strict=True)]
    coords = list(itertools.product(range(T), range(H), range(W)))
    tiles = [tuple(c // t for c, t in zip(xyz, tile, strict=True)) for xyz in coords]

    def window_of(i, n, k):
        start = min(max(i - k // 2, 0), n - k)
        return range(start, start + k)

    L = len(coords)
    m = torch.zeros(L, L, dtype=torch.bool)
    for a in range(L):
        wins = [window_of(i, n, k) for i, n, k in zip(tiles[a], ns, window, strict=True)]
        for b in range(L):
            inside = all(j in w for j, w in zip(tiles[b], wins, strict=True))
            sink = tiles[b][0] * tile[0] < global_frames
            m[a, b] = inside or sink
    return m


@pytest.mark.parametrize("grid,tile,density,global_frames", [
    ((4, 6, 10), (2, 3, 4), 0.5, 0),
    ((5, 5, 7), (2, 2, 3), 0.2, 0),   # uneven edge tiles in every dimension
    ((5, 4, 6), (1, 2, 2), 0.3, 2),   # plus the first two frames as global keys
    ((3, 4, 4), (1, 1, 1), 1.0, 0),
])
def test_token_mask_matches_brute_force(grid, tile, density, global_frames):
    lay = TileLayout(grid, tile, density, global_frames)
    ref = brute_force_mask(grid, lay.tile, lay.window, global_frames)
    assert torch.equal(lay.token_mask(), ref)
    assert lay.density == pytest.approx(ref.double().mean().item(), abs=1e-12)
    if density == 1.0:
        assert ref.all()


@pytest.mark.parametrize("block", [8, 16, 128])
def test_block_tables_reproduce_the_token_mask(block):
    """What the GPU kernel computes: empty blocks skipped, full blocks unmasked, partial blocks
    through mask_mod. Rebuilt from the BlockMask's tables, that is exactly the token mask (in
    tile-major order); and each block's kind is the brute-force any/all of the mask over it."""
    lay = TileLayout((5, 5, 7), (2, 2, 3), 0.3, block=block)
    L, nb = lay.length, lay.n_blocks
    perm_mask = lay.token_mask()[lay.perm_cpu][:, lay.perm_cpu]
    bm = lay.block_mask
    rebuilt = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    q_idx = torch.arange(nb * block).view(-1, 1)
    kv_idx = torch.arange(nb * block).view(1, -1)
    mod = bm.mask_mod(0, 0, q_idx, kv_idx)
    for qb in range(nb):
        rows = slice(qb * block, (qb + 1) * block)
        for j in range(int(bm.kv_num_blocks[0, 0, qb])):
            kb = int(bm.kv_indices[0, 0, qb, j])
            cols = slice(kb * block, (kb + 1) * block)
            rebuilt[rows, cols] = mod[rows, cols]
        for j in range(int(bm.full_kv_num_blocks[0, 0, qb])):
            kb = int(bm.full_kv_indices[0, 0, qb, j])
            rebuilt[rows, kb * block:(kb + 1) * block] = True
    assert torch.equal(rebuilt[:L, :L], perm_mask)
    for qb, kb in itertools.product(range(nb), range(nb)):
        sub = perm_mask[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
        want = 0 if not sub.any() else (2 if sub.all() else 1)
        assert int(lay.block_kind[qb, kb]) == want
    if block == 8:
        assert (lay.block_kind == 0).any() and (lay.block_kind == 2).any()  # really sparse, really full


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


def test_window_choice():
    assert choose_window((7, 4, 7), 1.0) == (7, 4, 7)
    assert choose_window((4, 4, 4), 0.125) == (2, 2, 2)
    kt, kh, kw = choose_window((7, 4, 7), 0.3)
    assert abs(kt * kh * kw / 196 - 0.3) < 0.02


def test_wan_480p_layout_density():
    """The Wan 1.3B 480x832x81 grid (21x30x52 tokens) at the default tile: the kept fraction of
    token pairs is close to the requested density, and the skipped 128-blocks track it."""
    for density in (0.5, 0.3, 0.15):
        lay = TileLayout((21, 30, 52), (3, 8, 8), density)
        assert abs(lay.density - density) < 0.05, lay
        computed = (lay.block_kind > 0).double().mean().item()
        assert density - 0.05 < computed < density + 0.12, (lay, computed)


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
        Deployment({"model": {"path": str(toy_checkpoint)}, "attention_options": {"density": 0.5}},
                   manager=make_manager(("attention", plugin)))


def test_refused_at_load_without_flex_attention(toy_checkpoint, monkeypatch):
    import attrs

    from omniloop.runtime import Deployment
    from omniloop_attention import backends

    patched = attrs.evolve(SPEC, available=lambda: "this torch (2.4.0) has no torch.nn.attention.flex_attention")
    monkeypatch.setattr(plugin, "BACKENDS", [patched if b.name == "sparse-tile" else b for b in backends.BACKENDS])
    with pytest.raises(DeployError, match="attention_backend: 'sparse-tile' cannot run here: this torch"):
        Deployment({"model": {"path": str(toy_checkpoint)}, "attention_backend": "sparse-tile"},
                   manager=make_manager(("attention", plugin)))


def test_options_reach_the_backend_and_exact_requests_are_refused(toy_checkpoint):
    from omniloop.runtime import Runtime
    from omniloop.testing import toy_request

    rt = Runtime.from_model(toy_checkpoint, manager=make_manager(("attention", plugin)), attention_backend="sparse-tile",
                            attention_options={"density": 0.25, "tile": [1, 2, 2], "global_frames": 1})
    fn = rt.attention.fn
    assert isinstance(fn, SparseTileAttention) and (fn.density, fn.tile, fn.global_frames) == (0.25, (1, 2, 2), 1)
    assert rt.attention.distribution_altering
    with pytest.raises(RequestError, match="attention backend 'sparse-tile' alters outputs; exact requests cannot use it"):
        rt.generate(toy_request(exact=True))


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


def test_wan_tiny_runs_end_to_end(wan_ckpt):
    """9 frames at 32x64: a 3x2x4 latent token grid. tile [1, 1, 1] and density 0.25 make the
    self-attention really sparse; density 1.0 gives the dense (sdpa) result within float32
    rounding; exact requests are refused on the sparse deployment."""
    lat_dense = _wan_runtime(wan_ckpt).generate(_wan_request()).artifacts["latents"].tensor

    sparse_rt = _wan_runtime(wan_ckpt, attention_backend="sparse-tile",
                             attention_options={"density": 0.25, "tile": [1, 1, 1]})
    fn = sparse_rt.attention.fn
    out = sparse_rt.generate(_wan_request())
    assert out.status.value == "completed"
    assert list(fn._layouts) == [((3, 2, 4), "cpu", None)]  # the processor passed the self-attention grid
    lay = next(iter(fn._layouts.values()))
    assert lay.window != lay.tiles and lay.density < 0.5
    lat_sparse = out.artifacts["latents"].tensor
    assert torch.isfinite(lat_sparse).all()
    assert (lat_sparse - lat_dense).abs().max() > 1e-4  # sparse attention changed the sample

    full = _wan_runtime(wan_ckpt, attention_backend="sparse-tile", attention_options={"density": 1.0, "tile": [1, 1, 1]})
    lat_full = full.generate(_wan_request()).artifacts["latents"].tensor
    # density 1.0: the same attention up to summation order; 2 steps of a tiny float32 model
    torch.testing.assert_close(lat_full, lat_dense, rtol=0, atol=1e-4)

    with pytest.raises(RequestError, match="exact requests cannot use it"):
        sparse_rt.generate(_wan_request(exact=True))
