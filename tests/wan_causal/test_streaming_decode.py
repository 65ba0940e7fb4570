"""Chunked VAE decode (feature cache kept between chunks) equals a whole-clip decode."""

from __future__ import annotations

import pytest
import torch

from omniloop_wan.causal import CausalOptions, CausalWan, StreamingDecoder


@pytest.mark.parametrize("split", [[3, 3, 3], [1, 2, 3, 3], [9]])
def test_chunked_decode_equals_full_decode(vae, split):
    g = torch.Generator().manual_seed(3)
    lat = torch.randn(1, 16, sum(split), 4, 4, generator=g)
    full = StreamingDecoder(vae).full_decode_reference(lat)
    dec = StreamingDecoder(vae)
    parts, start = [], 0
    for n in split:
        parts.append(dec.decode(lat[:, :, start : start + n]))
        start += n
    # frames per part: the first latent frame gives 1 frame, every later one 4 (temporal x4)
    assert [p.shape[2] for p in parts] == [1 + 4 * (split[0] - 1)] + [4 * n for n in split[1:]]
    chunked = torch.cat(parts, dim=2)
    assert chunked.shape == full.shape
    # the same per-frame decoder calls with the same cache; only post_quant_conv (a 1x1x1 conv)
    # runs on a shorter tensor, which on CPU fp32 gives the same bits
    assert torch.equal(chunked, full)


def test_rollout_emits_decoded_chunks_equal_to_decoding_the_clip(transformer, vae, text):
    eng = CausalWan(transformer, vae, options=CausalOptions(chunk_frames=3, steps=2, kv_slabs=4), height=32, width=32)
    stream = eng.open_stream(seed=5)
    outs = list(eng.run(stream, text, 3))
    assert [o.video.shape[2] for o in outs] == [9, 12, 12]
    assert all(o.video.shape[-2:] == (32, 32) for o in outs)
    lat = torch.cat([o.latents for o in outs], dim=2)
    full = StreamingDecoder(vae).full_decode_reference(lat)
    assert torch.equal(torch.cat([o.video for o in outs], dim=2), full)
    assert stream.decoder.state_bytes() > 0
    stream.free()
