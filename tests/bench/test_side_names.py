"""bench/_sides.py's side names: every word of an ``omniloop-…`` side maps to one deploy setting, and a
name that cannot be deployed is refused before any model is built (a typo costs a device call)."""

from __future__ import annotations

import pytest


def test_words_map_to_deploy_settings(sides):
    st = sides.omniloop_setting("omniloop-fa3-fused-compile-autotune-graphs")
    assert st == {"attention": "flash-attn-3", "linears": "dtype", "keep": (), "qkv": "fused", "ffn_gelu": "reference",
                  "modulation": "per-step", "qk_norm_rope": "reference", "compile": True, "graphs": True,
                  "compile_mode": "max-autotune-no-cudagraphs"}
    assert sides.omniloop_setting("omniloop-fa3-fused-gelu-compile-graphs")["ffn_gelu"] == "fused"
    st = sides.omniloop_setting("omniloop-fa3-fused-gelu-mod-compile-graphs")
    assert (st["ffn_gelu"], st["modulation"]) == ("fused", "per-request")
    assert sides.omniloop_setting("omniloop-fa3-fused-gelu-mod-rope-compile-graphs")["qk_norm_rope"] == "fused"
    assert sides.omniloop_setting("omniloop-cudnn-compile")["compile_mode"] is None
    st = sides.omniloop_setting("omniloop-fa3-fp8lin-keepv-compile")
    assert (st["linears"], st["keep"]) == ("fp8", ("attn.to_v", "attn.add_v_proj"))
    st = sides.omniloop_setting("omniloop-fa3-fused-fp8lin-keepv-compile")  # FLUX: v rows of the fused to_qkv
    assert (st["qkv"], st["keep"]) == ("fused", ("attn.to_v", "attn.add_v_proj"))
    st = sides.omniloop_setting("omniloop-fa3-fp8lin-keepqkv-compile")  # q, k and v of both streams
    assert st["keep"] == ("attn.to_[qkv]", "attn.add_[qkv]_proj")
    st = sides.omniloop_setting("omniloop-fa3-mod-fp8lin-keepqkvmod-compile")  # and the modulation linears
    assert st["keep"][2:] == ("norm1.linear", "norm1_context.linear", "norm.linear") and st["modulation"] == "per-request"


@pytest.mark.parametrize("name, msg", [("omniloop-fa3-autotune", "needs 'compile'"),
                                       ("omniloop-keepv-compile", "needs 'fp8lin'"),
                                       ("omniloop-keepqkv-compile", "needs 'fp8lin'"),
                                       ("omniloop-fp8lin-keepv-keepqkv", "one keep word"),
                                       ("omniloop-fa3-compile-turbo", "omniloop[-")])
def test_bad_names_are_refused(sides, name, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        sides.omniloop_setting(name)


def test_a_side_copy_on_the_cpu_is_a_plain_deep_copy(sides):
    """``copy_if_room`` only measures free memory on a GPU; on the CPU it copies."""
    import torch

    lin = torch.nn.Linear(4, 3)
    twin = sides.copy_if_room(lin)
    assert twin is not lin and torch.equal(twin.weight, lin.weight)
    assert twin.weight.data_ptr() != lin.weight.data_ptr()
