"""omniloop_kit.blocks: a family's own blocks in place of diffusers', sharing their modules."""

from __future__ import annotations

import torch

from omniloop_kit import blocks


class Owned(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.proj = block.proj  # the same child under the same name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_replace_keeps_the_modules_and_restore_undoes_it() -> None:
    model = torch.nn.Module()
    model.a, model.b = torch.nn.ModuleList([Block(), Block()]), torch.nn.ModuleList([Block()])
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    first = model.a[0]
    assert blocks.replace(model, {"a": Owned, "b": Owned}) == 3 and blocks.replaced(model)
    assert all(isinstance(b, Owned) for b in (*model.a, *model.b))
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys  # same tensors, same names
    assert blocks.replace(model, {"a": Owned}) == 3 and model.a[0].proj is first.proj  # once per model
    assert blocks.restore(model) == 3 and model.a[0] is first and not blocks.replaced(model)
    assert blocks.restore(model) == 0  # twice is fine
