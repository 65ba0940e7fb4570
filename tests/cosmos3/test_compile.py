"""Deploy ``compile: true``: the gen pathway's layer body under one ``torch.compile`` shared by
every layer (here the ``aot_eager`` backend: no C++ toolchain needed); the result equals eager
within float32 rounding (the compiled graph's decompositions may round differently)."""

from __future__ import annotations

import torch

from omniloop.request import Status

from .conftest import c3_runtime


def test_compiled_gen_layer(tiny_ckpt, runtime, t2v):
    rt = c3_runtime(tiny_ckpt("nemotron"), compile=True, options={"compile_backend": "aot_eager"})
    assert rt.model.config["compile"]["backend"] == "aot_eager"
    out = rt.generate(t2v(seed=8, steps=2))
    assert out.status is Status.COMPLETED, out.error
    ref = runtime("nemotron").generate(t2v(seed=8, steps=2)).artifacts["latents"].tensor
    assert torch.allclose(out.artifacts["latents"].tensor, ref, rtol=0, atol=1e-5)
