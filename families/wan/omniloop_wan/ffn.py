"""The fused feed-forward projection (``options.ffn_gelu: fused``): omniloop-kit's
:mod:`omniloop_kit.ffn` (the names this module had)."""

from omniloop_kit.ffn import MODES, FusedGeluProjection, install, installed, restore

__all__ = ["MODES", "FusedGeluProjection", "install", "installed", "restore"]
