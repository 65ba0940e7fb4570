"""Causal Wan: block-causal chunk rollout with chunk-KV slabs, streaming VAE decode, sessions.

``rollout: causal`` (issue 21). :mod:`.model` — the transformer over one chunk with cached
context (and the masked full-sequence reference); :mod:`.kv` — slabs in an
``omniloop_kvcache.CacheManager``; :mod:`.vae` — incremental decode keeping the causal VAE's
feature cache; :mod:`.rollout` — the chunk loop; :mod:`.sessions` — streams kept between
requests. See ``families/wan/README.md`` (causal rollout).
"""

from .kv import ChunkKV, chunk_layout
from .model import block_causal_mask, chunk_forward, chunk_visibility, masked_forward
from .rollout import CausalOptions, CausalWan, ChunkOut, Stream, chunk_noise, encode_first_frame
from .sessions import Cancelled, Session, SessionError, SessionLimit, SessionStore
from .vae import StreamingDecoder

__all__ = [
    "Cancelled",
    "CausalOptions",
    "CausalWan",
    "ChunkKV",
    "ChunkOut",
    "Session",
    "SessionError",
    "SessionLimit",
    "SessionStore",
    "Stream",
    "StreamingDecoder",
    "block_causal_mask",
    "chunk_forward",
    "chunk_layout",
    "chunk_noise",
    "chunk_visibility",
    "encode_first_frame",
    "masked_forward",
]
