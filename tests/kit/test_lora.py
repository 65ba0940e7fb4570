"""omniloop-kit's LoRA key conversion (kohya / ComfyUI layouts -> diffusers' keys).

A fused module's LoRA split into parts is the same product (``B·A`` row blocks equal each part's
``B_i·A``, exactly: the rows are copied, not recomputed); suffixes, alphas and the refusals (unknown
keys by name, a missing half, a non-matrix, rows that do not divide, a non-scalar alpha) are one
``AdapterFormatError`` each.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.capabilities import AdapterFormatError
from omniloop_kit import lora


def _target(src: str) -> lora.Target | None:
    """A toy original layout: ``blk.N.qkv`` is diffusers' to_q/to_k/to_v, ``blk.N.mlp_in`` 1:3 parts."""
    if src.startswith("blk.") and src.endswith(".qkv"):
        n = src.split(".")[1]
        return tuple(f"transformer.blocks.{n}.attn.to_{p}" for p in "qkv"), (1, 1, 1)
    if src == "blk.0.mlp_in":
        return ("transformer.blocks.0.a", "transformer.blocks.0.b"), (1, 3)
    if src == "blk.0.out":
        return ("transformer.blocks.0.attn.to_out.0",), (1,)
    return None


def test_parse_and_split_rows() -> None:
    assert lora.parse("lora_unet_x_qkv.lora_down.weight") == ("lora_unet_x_qkv", "A")
    assert lora.parse("a.b.lora_B.weight") == ("a.b", "B")
    assert lora.parse("a.b.alpha") == ("a.b", "alpha")
    assert lora.parse("a.b.weight") is None
    assert lora.split_rows(12, (1, 1, 1), "m") == [4, 4, 4]
    assert lora.split_rows(16, (1, 3), "m") == [4, 12]
    with pytest.raises(AdapterFormatError, match=r"^m: lora_up has 10 rows, not parts of 1:1:1$"):
        lora.split_rows(10, (1, 1, 1), "m")


def test_a_fused_lora_becomes_the_same_product_split() -> None:
    g = torch.Generator().manual_seed(0)
    down, up = torch.randn(4, 8, generator=g), torch.randn(12, 4, generator=g)
    down2, up2 = torch.randn(2, 8, generator=g), torch.randn(16, 2, generator=g)
    out, alphas = lora.convert({
        "blk.0.qkv.lora_down.weight": down, "blk.0.qkv.lora_up.weight": up, "blk.0.qkv.alpha": torch.tensor(8.0),
        "blk.0.mlp_in.lora_A.weight": down2, "blk.0.mlp_in.lora_B.weight": up2,
    }, _target, "Toy")
    parts = [out[f"transformer.blocks.0.attn.to_{p}.lora_B.weight"] @ out[f"transformer.blocks.0.attn.to_{p}.lora_A.weight"]
             for p in "qkv"]
    assert torch.equal(torch.cat(parts), up @ down)
    assert out["transformer.blocks.0.a.lora_B.weight"].shape == (4, 2)
    assert torch.equal(out["transformer.blocks.0.b.lora_B.weight"], up2[4:])
    assert all(t.is_contiguous() for t in out.values())
    assert alphas == {f"transformer.blocks.0.attn.to_{p}": 8.0 for p in "qkv"}


@pytest.mark.parametrize(("sd", "match"), [
    ({"blk.0.qkv.lora_down.weight": torch.zeros(2, 8), "head.lora_down.weight": torch.zeros(1), "junk": torch.zeros(1)},
     r"^2 key\(s\) not understood as Toy LoRA: head\.lora_down\.weight, junk$"),
    ({"blk.0.qkv.lora_down.weight": torch.zeros(2, 8)}, r"^blk\.0\.qkv: has no lora_up weight$"),
    ({"blk.0.out.lora_B.weight": torch.zeros(8, 2)}, r"^blk\.0\.out: has no lora_down weight$"),
    ({"blk.0.out.lora_A.weight": torch.zeros(2, 8), "blk.0.out.lora_B.weight": torch.zeros(8)},
     r"^blk\.0\.out: lora_up is not a matrix$"),
    ({"blk.0.qkv.lora_A.weight": torch.zeros(2, 8), "blk.0.qkv.lora_B.weight": torch.zeros(7, 2)},
     r"^blk\.0\.qkv: lora_up has 7 rows, not parts of 1:1:1$"),
    ({"blk.0.out.lora_A.weight": torch.zeros(2, 8), "blk.0.out.lora_B.weight": torch.zeros(8, 2),
      "blk.0.out.alpha": torch.ones(2)}, r"^blk\.0\.out\.alpha: not a scalar$"),
])
def test_bad_files_are_one_error_naming_the_key(sd: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(AdapterFormatError, match=match):
        lora.convert(sd, _target, "Toy")
