"""Our attention processor and compiled joint steps against diffusers' modules."""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop_sd3.attention import install, uninstall
from omniloop_sd3.tiny import transformer_kwargs
from omniloop_sd3.transformer import sd3_forward


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 4, 4, generator=g), torch.tensor([900.0, 900.0]), torch.randn(2, 20, 40, generator=g),
            torch.randn(2, 32, generator=g))


@pytest.mark.parametrize("variant", ["sd3", "sd35-medium"])
def test_processor_with_core_sdpa_is_bit_exact_and_fused_qkv_is_close(variant):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    ref = SD3Transformer2DModel(**transformer_kwargs(variant)).eval()
    ours = copy.deepcopy(ref)
    x, t, e, p = _inputs()
    with torch.no_grad():
        want = ref(hidden_states=x, timestep=t, encoder_hidden_states=e, pooled_projections=p, return_dict=False)[0]
        assert install(ours) == 3 + (2 if variant == "sd35-medium" else 0)
        assert torch.equal(sd3_forward(ours, x, t, e, p), want)
        install(ours, fused_qkv=True)
        # one GEMM over [Wq; Wk; Wv]: same math, another GEMM shape (fp32 CPU: ~1e-7 relative)
        torch.testing.assert_close(sd3_forward(ours, x, t, e, p), want, atol=1e-5, rtol=1e-5)
        uninstall(ours)
        assert torch.equal(sd3_forward(ours, x, t, e, p), want)


def test_deploy_compile_runs_compiled_joint_steps(tiny_ckpt, sd3_runtime, t2i_request):
    """deploy ``compile: true`` with the ``eager`` backend: dynamo traces every joint step with
    ``fullgraph=True`` (a graph break would fail) and the result equals the eager runtime."""
    import omniloop_sd3.plugin as sd3_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import completed_latents, make_manager

    torch._dynamo.reset()
    rt = Runtime.from_model(tiny_ckpt("sd3"), manager=make_manager(("sd3", sd3_plugin), toy=False), compile=True,
                            options={"compile_backend": "eager"})
    assert rt.model.config["compile"]["backend"] == "eager"
    out = rt.generate(t2i_request(steps=2))
    assert out.metrics["denoise"]["compiled_blocks"] is True
    eager = sd3_runtime("sd3").generate(t2i_request(steps=2))
    assert eager.metrics["denoise"]["compiled_blocks"] is False
    assert torch.equal(completed_latents(out), completed_latents(eager))


def test_compiled_steps_with_fused_qkv_equal_eager(tiny_ckpt, sd3_runtime, t2i_request):
    """Regression: the fused projections are module buffers, so every compiled block reads its own
    (a lookup outside the module was baked into the shared compiled graph once)."""
    import omniloop_sd3.plugin as sd3_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import completed_latents, make_manager

    torch._dynamo.reset()
    rt = Runtime.from_model(tiny_ckpt("sd35-medium"), manager=make_manager(("sd3", sd3_plugin), toy=False),
                            compile=True, options={"compile_backend": "eager", "qkv": "fused"})
    out = rt.generate(t2i_request(steps=2))
    assert out.metrics["denoise"]["compiled_blocks"] is True
    want = completed_latents(sd3_runtime("sd35-medium").generate(t2i_request(steps=2)))
    # CPU float32: the fused GEMM gives the same columns as the three separate ones here
    torch.testing.assert_close(completed_latents(out), want, atol=1e-5, rtol=1e-5)


def test_bad_family_options_fail_before_loading(tiny_ckpt):
    import omniloop_sd3.plugin as sd3_plugin
    from omniloop.errors import DeployError
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager

    for options, key in (({"qkv": "both"}, "options.qkv"), ({"compile_backend": 3}, "options.compile_backend")):
        with pytest.raises(DeployError, match=key):
            Runtime.from_model(tiny_ckpt(), manager=make_manager(("sd3", sd3_plugin), toy=False), compile=True,
                               options=options)


def test_joint_sequence_form_equals_the_pair_form_bit_for_bit():
    """With a block context bound (interceptor / taps) the stack runs on [context ; image]; without
    one it carries the pair. Both equal diffusers' forward exactly."""
    from diffusers import SD3Transformer2DModel

    from omniloop.interceptors import BlockContext
    from omniloop.loop import LoopState, StepContext

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**transformer_kwargs("sd35-medium")).eval()
    x, t, e, p = _inputs(1)
    seen = []
    ctx = BlockContext(step=StepContext("r", "denoise", 0, 1, 900.0), loop=LoopState(),
                       block_tap=lambda name, value: seen.append((name, tuple(value.shape))))
    with torch.no_grad():
        want = model(hidden_states=x, timestep=t, encoder_hidden_states=e, pooled_projections=p, return_dict=False)[0]
        assert torch.equal(sd3_forward(model, x, t, e, p), want)
        assert torch.equal(sd3_forward(model, x, t, e, p, ctx), want)
    assert seen == [(f"blocks.{i}", (2, 20 + 4, 16)) for i in range(3)]


def test_cuda_graphs_are_refused_on_a_cpu_deploy_before_load(tiny_ckpt, monkeypatch):
    """deploy ``options.cuda_graphs`` (omniloop_kit.graphs): one line, before any weight is read."""
    import omniloop_sd3.plugin as sd3_plugin
    from omniloop.errors import DeployError
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_sd3 import checkpoint as ck

    def no_load(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ck, "load_model", no_load)
    for value, msg in ((True, r"^options\.cuda_graphs: CUDA graphs need a CUDA device, not cpu$"),
                       (1, r"^options\.cuda_graphs: expected true or false, got 1$")):
        with pytest.raises(DeployError, match=msg):
            Runtime.from_model(tiny_ckpt(), manager=make_manager(("sd3", sd3_plugin), toy=False),
                               options={"cuda_graphs": value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_graphed_cfg_request_equals_the_plain_one_on_cuda(tiny_ckpt, t2i_request):
    import omniloop_sd3.plugin as sd3_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import completed_latents, make_manager
    from omniloop_kit import graphs

    def runtime(**options):
        return Runtime.from_model(tiny_ckpt("sd35-medium"), device="cuda", dtype="float32",
                                  manager=make_manager(("sd3", sd3_plugin), toy=False), options=options)

    rt = runtime(cuda_graphs=True)
    got = completed_latents(rt.generate(t2i_request(steps=3)))
    assert graphs.captured(rt.model.components["transformer"]) == 1  # uncond + cond rows: one forward shape
    assert torch.equal(got, completed_latents(runtime().generate(t2i_request(steps=3))))
