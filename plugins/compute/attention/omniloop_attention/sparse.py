"""``sparse-tile``: training-free sliding-tile attention over a video's (T, H, W) token grid.

What runs: the tokens of one self-attention call — a ``T x H x W`` latent grid in frame-major
order (frames, then rows, then columns: Wan's order after patchify) — are gathered into
tile-major order: 3-D tiles of ``tile = (tt, th, tw)`` tokens (default ``2 x 8 x 8`` = 128, the
attention kernel's block), each tile's tokens contiguous. Every run of 128 consecutive tokens of
that order is one attention tile (a whole ``tile`` wherever the grid divides evenly, else the
pieces of two neighbouring edge tiles — still a compact 3-D region). Each query tile attends to
the ``density`` fraction of key tiles nearest to it in the grid (distance between the tiles'
centroids, measured in tiles: Chebyshev, ties by Euclidean distance, then order) — a 3-D window
around the query tile that slides inward at the grid's edges instead of shrinking, so every
query tile keeps the same number of key tiles (sliding-tile attention, as in Zhang et al., "Fast
Video Generation with Sliding Tile Attention", 2025). ``global_frames`` > 0 adds the tiles
holding the first frames to every query's keys (an attention sink).

Because a tile *is* a kernel block, every (query tile, key tile) pair is computed in full or
skipped: the kernel visits exactly the kept fraction of blocks and never evaluates a mask inside
a block. ``density`` is the deploy knob (``attention_options: {density: 0.3}``): the fraction of
key tiles kept per query tile (rounded to whole tiles); ``density: 1.0`` keeps every tile, i.e.
dense attention computed by the sparse kernel (equal to SDPA within float rounding).
:attr:`TileLayout.density` is the fraction of (query, key) token pairs actually computed.

How: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built once per (grid, device)
and cached; the output is scattered back to frame-major order. On CUDA ``flex_attention`` is
``torch.compile``-d (a Triton kernel); on the CPU it runs eager (a reference: it materialises
the scores and applies the same mask token by token; tests and small shapes only).

Where the grid comes from: the backend callable declares ``accepts_grid = True``; a family that
knows its token grid passes ``grid=(T, H, W)`` to self-attention calls (Wan does:
``omniloop_wan.attention.set_token_grid``). A call without ``grid`` (cross-attention, a family
that does not pass one), or with an attention mask, is dense SDPA — the sparse pattern only ever
applies where the family said the keys are the query's own video grid.

Distribution-altering: refused for ``exact: true`` requests. Refused at load when this torch has
no ``flex_attention`` (torch < 2.5), and wherever the deployment would never pass a grid, so the
backend would compute dense attention under its sparse name (``omniloop.placement.check_attention_grid``:
a family that declares no ``capabilities.attention_grid``, or one that objects — Wan under ``parallel.sp > 1``
or the causal rollout).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from attrs import define, field

#: flex_attention's block size: one attention tile (the granularity at which keys are skipped)
BLOCK = 128
DEFAULT_TILE = (2, 8, 8)
#: ``kernel_options`` for the CUDA flex kernel (None: torch's defaults for the GPU and head dim);
#: ``bench/attention_sparse.py`` times alternatives
KERNEL_OPTIONS: dict[str, Any] | None = None


@define(frozen=True)
class SparseTileOptions:
    """The deploy's ``attention_options`` for ``sparse-tile``."""

    #: fraction of key tiles each query tile attends to, in (0, 1]; 1.0 is dense
    density: float = field(default=0.5, metadata={"gt": 0, "le": 1})
    #: the tiles that order the tokens, in latent tokens (frames, rows, columns); 128 tokens fill a block
    tile: list[int] = field(factory=lambda: list(DEFAULT_TILE))
    #: the first N latent frames' tiles are keys of every query (0: none)
    global_frames: int = field(default=0, metadata={"ge": 0})


def flex_available() -> str | None:
    """None when flex_attention exists in this torch, else the reason it does not."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"this torch ({torch.__version__}) has no torch.nn.attention.flex_attention (needs torch >= 2.5): {exc}"
    if not hasattr(BlockMask, "from_kv_blocks"):
        return f"this torch ({torch.__version__}) has no BlockMask.from_kv_blocks (needs torch >= 2.5)"
    return None


def check_options(density: Any, tile: Any, global_frames: Any) -> tuple[float, tuple[int, int, int], int]:
    """Validated ``(density, tile, global_frames)``; a ``ValueError`` naming the option otherwise."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not math.isfinite(density) \
            or not 0.0 < density <= 1.0:
        raise ValueError(f"attention_options.density: must be a number in (0, 1], got {density!r}")
    if (not isinstance(tile, Sequence) or isinstance(tile, str) or len(tile) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in tile)):
        raise ValueError(f"attention_options.tile: must be three integers >= 1 (frames, rows, columns), got {tile!r}")
    if isinstance(global_frames, bool) or not isinstance(global_frames, int) or global_frames < 0:
        raise ValueError(f"attention_options.global_frames: must be an integer >= 0, got {global_frames!r}")
    t, h, w = (int(x) for x in tile)
    return float(density), (t, h, w), int(global_frames)


def tile_order(grid: tuple[int, int, int], tile: tuple[int, int, int]) -> torch.Tensor:
    """``perm``: frame-major token indices in tile-major order — tile by tile, each tile's tokens
    frame-major. The tiles follow a 3-D snake (columns of tiles alternate direction from one row of
    tiles to the next, rows from one frame of tiles to the next), so consecutive tiles are always
    neighbours: a block that spans two edge tiles is still one compact region."""
    T, H, W = grid
    tt, th, tw = tile
    nh, nw = -(-H // th), -(-W // tw)
    t = torch.arange(T).view(T, 1, 1).expand(T, H, W).reshape(-1)
    h = torch.arange(H).view(1, H, 1).expand(T, H, W).reshape(-1)
    w = torch.arange(W).view(1, 1, W).expand(T, H, W).reshape(-1)
    it, ih, iw = t // tt, h // th, w // tw
    row = it * nh + torch.where(it % 2 == 1, nh - 1 - ih, ih)
    rank = row * nw + torch.where(row % 2 == 1, nw - 1 - iw, iw)
    inner = ((t % tt) * th + h % th) * tw + w % tw
    return torch.argsort(rank * (tt * th * tw) + inner)


class TileLayout:
    """Everything one (grid, tile, density) needs: the token permutation, the block-level mask
    (``allowed[query block, key block]``) and the flex ``BlockMask`` (built on the CPU, moved to
    ``device``)."""

    def __init__(self, grid: tuple[int, int, int], tile: tuple[int, int, int], density: float,
                 global_frames: int = 0, device: torch.device | str = "cpu", block: int = BLOCK) -> None:
        T, H, W = (int(x) for x in grid)
        tile = tuple(min(a, b) for a, b in zip(tile, (T, H, W), strict=True))  # type: ignore[assignment]
        self.grid, self.tile, self.block = (T, H, W), tile, block
        L = T * H * W
        self.length = L
        perm = tile_order(self.grid, tile)
        self.perm_cpu = perm
        self.inv_cpu = torch.argsort(perm)
        nb = -(-L // block)
        self.n_blocks = nb
        # each block's centroid, in tiles
        coords = torch.stack([perm // (H * W), (perm // W) % H, perm % W], dim=1).double()
        block_of = torch.arange(L) // block
        sizes = torch.bincount(block_of, minlength=nb).double()
        centroid = torch.zeros(nb, 3, dtype=torch.float64).index_add_(0, block_of, coords) / sizes.view(-1, 1)
        centroid = centroid / torch.tensor(tile, dtype=torch.float64)
        diff = (centroid.view(nb, 1, 3) - centroid.view(1, nb, 3)).abs()
        cheb = diff.amax(dim=-1)
        eucl = diff.pow(2).sum(dim=-1)
        # rank key blocks per query block: Chebyshev distance, then Euclidean, then index (stable sorts)
        order = torch.argsort(eucl, dim=1, stable=True)
        order = order.gather(1, torch.argsort(cheb.gather(1, order), dim=1, stable=True))
        self.keep = max(1, min(nb, round(density * nb)))
        allowed = torch.zeros(nb, nb, dtype=torch.bool)
        allowed.scatter_(1, order[:, :self.keep], True)
        if global_frames > 0:
            first = torch.zeros(nb, dtype=torch.bool)
            first[block_of[coords[:, 0] < global_frames]] = True
            allowed |= first.view(1, -1)
        self.allowed = allowed
        #: fraction of (query, key) token pairs computed
        self.density = float((sizes.view(-1, 1) * allowed.double() * sizes.view(1, -1)).sum() / (L * L))
        #: fraction of (query block, key block) pairs the kernel visits
        self.block_density = float(allowed.double().mean())
        counts = allowed.sum(dim=1).to(torch.int32)
        # each row: the kept blocks first, in index order (the kernel reads the first ``count``)
        kept_first = torch.argsort((~allowed).to(torch.int8), dim=1, stable=True).to(torch.int32)
        self._full = (counts.view(1, 1, nb), kept_first.view(1, 1, nb, nb))
        self._partial = (torch.zeros(1, 1, nb, dtype=torch.int32), torch.zeros(1, 1, nb, nb, dtype=torch.int32))
        self.to(device)

    def to(self, device: torch.device | str) -> TileLayout:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.perm = self.perm_cpu.to(device)
        self.inv = self.inv_cpu.to(device)
        self.block_mask = self._make_block_mask(device)
        return self

    def _make_block_mask(self, device: torch.device) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        B, L, nb = self.block, self.length, self.n_blocks
        allowed = self.allowed.reshape(-1).to(device)  # flat [query block * nb + key block]

        # Every kept block is a full block: the CUDA kernel never calls this. The eager (CPU)
        # flex_attention applies it token by token, so it must say the same thing.
        def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return allowed[(q_idx // B).clamp(max=nb - 1) * nb + (kv_idx // B).clamp(max=nb - 1)]

        kv_num, kv_idx = (x.to(device) for x in self._partial)
        full_num, full_idx = (x.to(device) for x in self._full)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                        seq_lengths=(L, L))

    def token_mask(self) -> torch.Tensor:
        """The ``[L, L]`` boolean mask in frame-major token order (reference and tests; small grids only)."""
        block_raw = self.inv_cpu // self.block  # block of each frame-major token
        return self.allowed[block_raw.view(-1, 1), block_raw.view(1, -1)]

    def __repr__(self) -> str:
        return (f"TileLayout(grid={self.grid}, tile={self.tile}, blocks={self.n_blocks}, keep={self.keep}, "
                f"density={self.density:.3f})")


_FLEX_LOCK = threading.Lock()
_COMPILED: dict[str, Any] = {}


def _flex_for(device: torch.device) -> Any:
    """flex_attention: compiled (Triton) on CUDA, eager elsewhere; inside a compiled region (Wan's
    ``compile: true`` blocks) the plain function, which the enclosing graph compiles."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    fn = _COMPILED.get("cuda")
    if fn is None:
        with _FLEX_LOCK:
            fn = _COMPILED.get("cuda")
            if fn is None:
                fn = _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return fn


class SparseTileAttention:
    """The ``sparse-tile`` backend's callable for one set of options: ``fn(q, k, v, grid=(T, H, W))``
    with ``[B, heads, T*H*W, D]`` q/k/v; without ``grid``: dense SDPA."""

    #: families pass the self-attention token grid as ``grid=(T, H, W)`` to callables declaring this
    accepts_grid = True

    def __init__(self, density: float = 0.5, tile: Sequence[int] = DEFAULT_TILE, global_frames: int = 0,
                 block: int | None = None) -> None:
        self.density, self.tile, self.global_frames = check_options(density, list(tile), global_frames)
        self.block = BLOCK if block is None else int(block)
        self._layouts: dict[tuple[Any, ...], TileLayout] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, options: SparseTileOptions) -> SparseTileAttention:
        return cls(options.density, options.tile, options.global_frames)

    def layout(self, grid: Sequence[int], device: torch.device | str = "cpu") -> TileLayout:
        """The cached :class:`TileLayout` for ``grid`` on ``device`` (built on first use)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = (tuple(int(x) for x in grid), dev.type, dev.index)
        lay = self._layouts.get(key)
        if lay is None:
            with self._lock:
                lay = self._layouts.get(key)
                if lay is None:
                    lay = self._layouts[key] = TileLayout(key[0], self.tile, self.density, self.global_frames, dev,
                                                          self.block)
        return lay

    def prepare_grid(self, grid: Sequence[int], device: torch.device | str) -> None:
        """Build the layout for ``grid`` now (called outside compiled code, before the blocks run)."""
        self.layout(grid, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Sequence[int] | None = None,
                 **kw: Any) -> torch.Tensor:
        if grid is None:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        extra = sorted(k_ for k_, v_ in kw.items() if v_ is not None and v_ is not False)
        if extra:
            raise ValueError(f"sparse-tile backend: a call with a token grid takes no {', '.join(extra)}")
        T, H, W = (int(x) for x in grid)
        L = T * H * W
        if q.shape[-2] != L or k.shape[-2] != L or v.shape[-2] != L:
            raise ValueError(f"sparse-tile backend: grid {T}x{H}x{W} is {L} tokens, but q/k/v have "
                             f"{q.shape[-2]}/{k.shape[-2]}/{v.shape[-2]}")
        lay = self.layout((T, H, W), q.device)
        qp, kp, vp = (x.index_select(-2, lay.perm) for x in (q, k, v))
        if q.device.type == "cuda":
            out = _flex_for(q.device)(qp, kp, vp, block_mask=lay.block_mask, kernel_options=KERNEL_OPTIONS)
        elif torch.compiler.is_compiling():
            out = _flex_for(q.device)(qp, kp, vp, block_mask=lay.block_mask)
        else:
            with warnings.catch_warnings():  # eager flex on the CPU: a reference, and it says so each call
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                out = _flex_for(q.device)(qp, kp, vp, block_mask=lay.block_mask)
        return out.index_select(-2, lay.inv)

    def __repr__(self) -> str:
        return f"SparseTileAttention(density={self.density}, tile={self.tile}, global_frames={self.global_frames})"


def configure(options: SparseTileOptions) -> SparseTileAttention:
    """The backend callable for the deploy's validated ``attention_options``."""
    return SparseTileAttention.from_options(options)


#: the callable registered before any options are applied (the defaults)
sparse_tile = SparseTileAttention()

__all__ = [
    "BLOCK",
    "DEFAULT_TILE",
    "SparseTileAttention",
    "SparseTileOptions",
    "TileLayout",
    "check_options",
    "configure",
    "flex_available",
    "sparse_tile",
    "tile_order",
]
