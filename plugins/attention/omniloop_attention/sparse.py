"""``sparse-tile``: training-free sliding-tile attention over a video's (T, H, W) token grid.

What runs: the tokens of one self-attention call — a ``T x H x W`` latent grid in frame-major
order (frames, then rows, then columns: Wan's order after patchify) — are cut into 3-D tiles of
``tile = (tt, th, tw)`` tokens (the last tile of a dimension may be smaller). Each query tile
attends to the key tiles inside a ``kt x kh x kw`` window of tiles around it; at the grid's edges
the window slides inward instead of shrinking, so every query tile keeps the same number of key
tiles (sliding-tile attention, as in Zhang et al., "Fast Video Generation with Sliding Tile
Attention", 2025). ``global_frames`` > 0 adds the tiles holding the first frames to every
query's keys (an attention sink; rounded up to whole tiles).

``density`` (the deploy knob, ``attention_options: {density: 0.3}``) is the fraction of key
tiles each query tile keeps: the window is the ``(kt, kh, kw)`` whose ``kt*kh*kw / tiles`` is
closest to it (ties: the window most like the grid's shape). ``density: 1.0`` keeps every tile,
i.e. dense attention computed by the sparse kernel (equal to SDPA within float rounding).
:attr:`TileLayout.density` is the fraction of (query, key) token pairs actually computed.

How: the tokens are gathered into tile-major order (each tile's tokens contiguous), attention is
``torch.nn.attention.flex_attention`` with a ``BlockMask`` (128-token blocks; a block pair is
skipped when none of its tile pairs is in a window, computed without a mask when all are) built
once per (grid, device) and cached, and the output is scattered back to frame-major order. On
CUDA ``flex_attention`` is ``torch.compile``-d (a Triton kernel); on the CPU it runs eager (a
reference: materialises the scores; tests and small shapes only).

Where the grid comes from: the backend callable declares ``accepts_grid = True``; a family that
knows its token grid passes ``grid=(T, H, W)`` to self-attention calls (Wan does:
``omniloop_wan.attention.set_token_grid``). A call without ``grid`` (cross-attention, a family
that does not pass one), or with an attention mask, is dense SDPA — the sparse pattern only ever
applies where the family said the keys are the query's own video grid.

Distribution-altering: refused for ``exact: true`` requests. Refused at load when this torch has
no ``flex_attention`` (torch < 2.5).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from attrs import define, field

#: flex_attention's block size: the granularity at which key blocks are skipped
BLOCK = 128
DEFAULT_TILE = (3, 8, 8)


@define(frozen=True)
class SparseTileOptions:
    """The deploy's ``attention_options`` for ``sparse-tile``."""

    #: fraction of key tiles each query tile attends to, in (0, 1]; 1.0 is dense
    density: float = field(default=0.5, metadata={"gt": 0, "le": 1})
    #: tile size in latent tokens (frames, rows, columns)
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


def choose_window(tiles: tuple[int, int, int], density: float) -> tuple[int, int, int]:
    """The window ``(kt, kh, kw)`` (in tiles) whose share of all tiles is closest to ``density``;
    ties go to the window whose per-dimension fractions ``k/n`` are most alike."""
    nt, nh, nw = tiles
    total = nt * nh * nw
    best: tuple[float, float, tuple[int, int, int]] | None = None
    for kt in range(1, nt + 1):
        for kh in range(1, nh + 1):
            for kw in range(1, nw + 1):
                err = abs(kt * kh * kw / total - density)
                logs = [math.log(k / n) for k, n in ((kt, nt), (kh, nh), (kw, nw))]
                mean = sum(logs) / 3
                shape = sum((x - mean) ** 2 for x in logs)
                cand = (round(err, 12), shape, (kt, kh, kw))
                if best is None or cand < best:
                    best = cand
    assert best is not None
    return best[2]


def _starts(n: int, k: int) -> torch.Tensor:
    """Per tile index ``i`` of a dimension with ``n`` tiles: the first tile of its ``k``-wide window."""
    i = torch.arange(n)
    return (i - k // 2).clamp(min=0).clamp(max=n - k)


class TileLayout:
    """Everything one (grid, tile, window) needs: the token permutation, the tile-level mask and
    the flex ``BlockMask`` (built on the CPU, moved to ``device``)."""

    def __init__(self, grid: tuple[int, int, int], tile: tuple[int, int, int], density: float,
                 global_frames: int = 0, device: torch.device | str = "cpu", block: int = BLOCK) -> None:
        T, H, W = grid
        tt, th, tw = (min(a, b) for a, b in zip(tile, grid, strict=True))
        self.grid, self.tile, self.block = (T, H, W), (tt, th, tw), block
        nt, nh, nw = -(-T // tt), -(-H // th), -(-W // tw)
        self.tiles = (nt, nh, nw)
        self.window = choose_window(self.tiles, density)
        kt, kh, kw = self.window
        L = T * H * W
        self.length = L
        # token -> tile, and the tile-major order (tile id, then position inside the tile)
        t = torch.arange(T).view(T, 1, 1).expand(T, H, W).reshape(-1)
        h = torch.arange(H).view(1, H, 1).expand(T, H, W).reshape(-1)
        w = torch.arange(W).view(1, 1, W).expand(T, H, W).reshape(-1)
        tile_id = ((t // tt) * nh + h // th) * nw + w // tw
        inner = ((t % tt) * th + h % th) * tw + w % tw
        perm = torch.argsort(tile_id * (tt * th * tw) + inner)
        self.perm_cpu = perm
        self.inv_cpu = torch.argsort(perm)
        self.tile_of = tile_id[perm]  # tile of each token in tile-major order (non-decreasing)
        # tile-level mask: allowed[query tile, key tile]
        n_tiles = nt * nh * nw
        idx = torch.arange(n_tiles)
        it, ih, iw = idx // (nh * nw), (idx // nw) % nh, idx % nw
        st, sh, sw = _starts(nt, kt)[it], _starts(nh, kh)[ih], _starts(nw, kw)[iw]

        def inside(start: torch.Tensor, k: int, j: torch.Tensor) -> torch.Tensor:
            return (j.view(1, -1) >= start.view(-1, 1)) & (j.view(1, -1) < start.view(-1, 1) + k)

        allowed = inside(st, kt, it) & inside(sh, kh, ih) & inside(sw, kw, iw)
        if global_frames > 0:
            allowed |= (it < -(-min(global_frames, T) // tt)).view(1, -1)
        self.allowed = allowed
        sizes = torch.bincount(tile_id, minlength=n_tiles).double()
        #: fraction of (query, key) token pairs computed
        self.density = float((sizes.view(-1, 1) * allowed.double() * sizes.view(1, -1)).sum() / (L * L))
        self._block_tables()
        self._device_state: dict[str, Any] = {}
        self.to(device)

    def _block_tables(self) -> None:
        L, B = self.length, self.block
        nb = -(-L // B)
        n_tiles = self.allowed.shape[0]
        pos = torch.arange(L)
        inc = torch.zeros(nb, n_tiles, dtype=torch.float64)
        inc[pos // B, self.tile_of] = 1.0  # block touches tile
        allowed = self.allowed.double()
        any_ = (inc @ allowed @ inc.T) > 0
        none_bad = (inc @ (1.0 - allowed) @ inc.T) == 0
        full = any_ & none_bad
        partial = any_ & ~full
        #: per (query block, key block): 0 skipped, 1 partial (mask applied), 2 full
        self.block_kind = partial.to(torch.int8) + 2 * full.to(torch.int8)
        self.n_blocks = nb

        def table(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            counts = sel.sum(dim=1).to(torch.int32)
            # indices of the selected blocks first (stable), the rest after (ignored by flex)
            order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True).to(torch.int32)
            return counts.view(1, 1, nb), order.view(1, 1, nb, nb)

        self._partial = table(partial)
        self._full = table(full)

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

        B, L = self.block, self.length
        padded = self.n_blocks * B
        # per-token tile ids, padded to whole blocks (the kernel masks positions past L itself)
        tile_of = torch.zeros(padded, dtype=torch.int32)
        tile_of[:L] = self.tile_of.to(torch.int32)
        tile_of = tile_of.to(device)
        allowed = self.allowed.to(device)

        def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return allowed[tile_of[q_idx], tile_of[kv_idx]]

        kv_num, kv_idx = (x.to(device) for x in self._partial)
        full_num, full_idx = (x.to(device) for x in self._full)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                        seq_lengths=(L, L))

    def token_mask(self) -> torch.Tensor:
        """The ``[L, L]`` boolean mask in frame-major token order (reference and tests; small grids only)."""
        tile_raw = self.tile_of[self.inv_cpu]
        return self.allowed[tile_raw.view(-1, 1), tile_raw.view(1, -1)]

    def __repr__(self) -> str:
        return (f"TileLayout(grid={self.grid}, tile={self.tile}, tiles={self.tiles}, window={self.window}, "
                f"density={self.density:.3f})")


_FLEX_LOCK = threading.Lock()
_COMPILED: dict[str, Any] = {}


def _flex_for(device: torch.device) -> Any:
    """flex_attention: compiled (Triton) on CUDA, eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
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
                 block: int = BLOCK) -> None:
        self.density, self.tile, self.global_frames = check_options(density, list(tile), global_frames)
        self.block = block
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
    "choose_window",
    "configure",
    "flex_available",
    "sparse_tile",
]
