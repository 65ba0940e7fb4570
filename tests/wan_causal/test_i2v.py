"""Image conditioning of the causal rollout's first chunk (engine level): the given clean latent
frames stay fixed with their tokens at the context timestep (Wan2.2 TI2V's scheme); the cached
rollout equals the masked full-sequence reference; a whole-chunk image is chunk 0 itself."""

from __future__ import annotations

import pytest
import torch

from omniloop.errors import RequestError
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_wan import plugin as wan_plugin
from omniloop_wan.causal import CausalOptions, CausalWan, SessionStore, StreamingDecoder, encode_first_frame

from .conftest import other_text

# as test_rollout.py / test_cfg.py: cached slabs vs one masked sequence, fp32 rounding only
ATOL = RTOL = 1e-5


def _image(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, 32, 32, generator=g) * 2 - 1


@pytest.mark.parametrize(("chunk_frames", "cfg"), [(3, False), (3, True), (1, False), (1, True)])
def test_image_conditioned_rollout_equals_the_masked_reference(transformer, vae, text, chunk_frames, cfg):
    eng = CausalWan(transformer, vae, options=CausalOptions(chunk_frames=chunk_frames, steps=3, kv_slabs=16),
                    height=32, width=32)
    first = encode_first_frame(vae, _image())
    assert first.shape == (1, 16, 1, 4, 4)
    kw = {"uncond": other_text(transformer, 40), "guidance": 4.0} if cfg else {}
    stream = eng.open_stream(seed=3, cfg=cfg, first_latents=first)
    outs = list(eng.run(stream, text, 3, decode=False, **kw))
    cached = torch.cat([o.latents for o in outs], dim=2)
    ref = eng.reference(text, 3, seed=3, first_latents=first, **kw)
    torch.testing.assert_close(cached, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(cached[:, :, :1], first)  # the image's latent frame is kept as given
    # the image conditions what follows
    plain = eng.reference(text, 3, seed=3, **kw)
    assert not torch.allclose(plain[:, :, chunk_frames:], ref[:, :, chunk_frames:], atol=1e-4)
    stream.free()
    assert eng.manager.used_blocks == 0


def test_a_whole_chunk_image_is_chunk_zero_and_decodes_to_its_reconstruction(transformer, vae, text):
    eng = CausalWan(transformer, vae, options=CausalOptions(chunk_frames=1, steps=2, kv_slabs=8), height=32, width=32)
    first = encode_first_frame(vae, _image(1))
    stream = eng.open_stream(seed=0, first_latents=first)
    outs = list(eng.run(stream, text, 2))
    assert torch.equal(outs[0].latents, first)
    assert outs[0].video.shape == (1, 3, 1, 32, 32) and outs[1].video.shape == (1, 3, 4, 32, 32)
    ref = StreamingDecoder(vae).full_decode_reference(torch.cat([o.latents for o in outs], dim=2))
    assert torch.equal(torch.cat([o.video for o in outs], dim=2), ref.clamp(-1, 1))
    stream.free()


def test_sessions_take_the_image_too(transformer, vae, text):
    eng = CausalWan(transformer, vae, options=CausalOptions(chunk_frames=1, steps=2, kv_slabs=8), height=32, width=32)
    store = SessionStore(eng)
    first = encode_first_frame(vae, _image(2))
    s = store.create(seed=5, first_latents=first)
    a = [o.latents for o in store.generate(s.id, text, 1, decode=False)]
    a += [o.latents for o in store.generate(s.id, other_text(transformer, 1), 2, decode=False)]
    ref_stream = eng.open_stream(seed=5, first_latents=first)
    b = [o.latents for o in eng.run_schedule(ref_stream, [(text, 1), (other_text(transformer, 1), 2)], decode=False)]
    ref_stream.free()
    store.close(s.id)
    assert torch.equal(torch.cat(a, dim=2), torch.cat(b, dim=2))


def test_bad_images_and_latents_are_refused(transformer, vae):
    eng = CausalWan(transformer, vae, options=CausalOptions(chunk_frames=3), height=32, width=32)
    with pytest.raises(ValueError, match=r"first_latents: expected \[1, 16, 1\.\.3, 4, 4\]"):
        eng.open_stream(seed=0, first_latents=torch.zeros(1, 16, 4, 4, 4))
    with pytest.raises(ValueError, match=r"first_latents: expected"):
        eng.open_stream(seed=0, first_latents=torch.zeros(1, 16, 1, 8, 8))
    with pytest.raises(ValueError, match="non-finite"):
        eng.open_stream(seed=0, first_latents=torch.full((1, 16, 1, 4, 4), float("nan")))
    with pytest.raises(ValueError, match=r"image: expected \[1, 3, H, W\]"):
        encode_first_frame(vae, torch.zeros(3, 32, 32))
    with pytest.raises(ValueError, match="image: has non-finite"):
        encode_first_frame(vae, torch.full((1, 3, 32, 32), float("inf")))
    assert eng.manager.sequences == 0


def test_the_runtime_refuses_i2v_with_rollout_causal_in_one_line(tiny_wan, tmp_path):
    from PIL import Image

    png = tmp_path / "first.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(png)
    rt = Runtime.from_model(tiny_wan, manager=make_manager(("wan", wan_plugin), toy=False),
                            options={"rollout": "causal", "rollout_options": {"chunk_frames": 3}})
    with pytest.raises(RequestError) as err:
        rt.generate({"task": "i2v", "prompt": "a fox", "inputs": [{"type": "image", "path": str(png)}],
                     "diffusion": {"frames": 9}})
    assert "\n" not in str(err.value) and str(err.value).startswith("task")
