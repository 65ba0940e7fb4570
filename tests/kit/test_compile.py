"""omniloop_kit.compile (omniloop.compile before 0.2): regional compilation shared by the model families (settings, wrappers, picking).

Compilation uses the ``eager`` backend: dynamo traces each block (fullgraph checks included)
without code generation, so these run in seconds on a CPU."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.errors import DeployError
from omniloop_kit.compile import (
    CompiledBlocks,
    blocks_for,
    compile_blocks,
    compile_enabled,
    compile_info,
    compile_options,
    compiled,
    uncompile,
)

ON = DeployConfig(compile=True)
OFF = DeployConfig()


class Tiny(torch.nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def run(self, x: torch.Tensor, blocks: list | None = None) -> torch.Tensor:
        for b in self.blocks if blocks is None else blocks:
            x = b(x)
        return x


def ctx(deploy: DeployConfig = ON, *, eager: bool = False, **components: object) -> SimpleNamespace:
    return SimpleNamespace(options={"deploy": deploy}, eager=eager, components=components)


# -- compile_options ---------------------------------------------------------------------------------


def test_settings_are_none_when_the_deploy_does_not_compile():
    assert compile_options({}) is None
    assert compile_options(None) is None
    assert compile_options({"deploy": OFF, "compile_backend": "eager"}) is None


def test_settings_defaults_and_values():
    assert compile_options({"deploy": ON}) == {"backend": "inductor", "mode": None, "dynamic": False, "options": None}
    got = compile_options({"deploy": ON, "compile_mode": "max-autotune-no-cudagraphs", "compile_dynamic": None})
    assert got == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "dynamic": None, "options": None}
    assert compile_options({"deploy": ON, "compile_backend": "eager", "compile_dynamic": True}) == {
        "backend": "eager", "mode": None, "dynamic": True, "options": None}
    # compile_inductor: torch.compile(options=...), the names checked against this torch's inductor config
    got = compile_options({"deploy": ON, "compile_inductor": {"triton.multi_kernel": 1, "max_autotune": False}})
    assert got == {"backend": "inductor", "mode": None, "dynamic": False,
                   "options": {"triton.multi_kernel": 1, "max_autotune": False}}


@pytest.mark.parametrize("deploy", [ON, OFF], ids=["compile-on", "compile-off"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compile_backend": 3}, "options.compile_backend: expected a torch.compile backend name, got 3"),
        ({"compile_backend": ""}, "options.compile_backend: expected a torch.compile backend name, got ''"),
        ({"compile_backend": None}, "options.compile_backend: expected a torch.compile backend name, got None"),
        ({"compile_mode": 1}, "options.compile_mode: expected a torch.compile mode name, got 1"),
        ({"compile_mode": "max-autotune", "compile_backend": "eager"},
         "options.compile_mode: 'max-autotune' needs compile_backend 'inductor', not 'eager'"),
        ({"compile_mode": "fastest"}, "options.compile_mode: 'fastest' is not an inductor mode (known: "),
        ({"compile_dynamic": "yes"}, "options.compile_dynamic: expected true, false or null, got 'yes'"),
        ({"compile_dynamic": 1}, "options.compile_dynamic: expected true, false or null, got 1"),
        ({"compile": True}, "options.compile: not an option (got True); switch compilation on with the deploy's"),
        ({"compile_inductor": {"triton.multi_kernal": 1}},
         "options.compile_inductor: 'triton.multi_kernal' is not a setting of this torch's inductor (did you mean "
         "triton.multi_kernel"),
        ({"compile_inductor": {"max_autotune": float("nan")}},
         "options.compile_inductor.max_autotune: expected a boolean, a finite number or a string, got nan"),
        ({"compile_inductor": {"max_autotune": [1]}},
         "options.compile_inductor.max_autotune: expected a boolean, a finite number or a string, got [1]"),
        ({"compile_inductor": {}}, "options.compile_inductor: expected a non-empty mapping of inductor settings"),
        ({"compile_inductor": "triton.multi_kernel=1"},
         "options.compile_inductor: expected a non-empty mapping of inductor settings"),
        ({"compile_inductor": {"max_autotune": True}, "compile_mode": "max-autotune"},
         "options.compile_inductor: not with compile_mode (torch.compile takes a mode or inductor settings"),
        ({"compile_inductor": {"max_autotune": True}, "compile_backend": "eager"},
         "options.compile_inductor: needs compile_backend 'inductor', not 'eager'"),
    ],
)
def test_bad_settings_raise_one_line_naming_the_option(deploy, options, message):
    """Checked whether or not compile is on: a typo fails at load, not the day compile is switched on."""
    with pytest.raises(DeployError) as err:
        compile_options({"deploy": deploy, **options})
    text = str(err.value)
    assert text.startswith(message)
    assert "\n" not in text


# -- compile_blocks / compiled / uncompile -----------------------------------------------------------


def test_compiled_blocks_equal_the_eager_blocks_and_leave_them_untouched():
    model = Tiny()
    cb = compile_blocks(model, model.blocks, backend="eager")
    assert isinstance(cb, CompiledBlocks) and len(cb.blocks) == 3
    assert (cb.backend, cb.mode, cb.dynamic) == ("eager", None, False)
    assert compiled(model) is cb
    assert all(type(b) is torch.nn.Linear for b in model.blocks)  # the eager stack is not replaced
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model.run(x, cb.blocks), model.run(x))
    # same settings: the same wrappers; other settings: new ones
    assert compile_blocks(model, model.blocks, backend="eager") is cb
    other = compile_blocks(model, model.blocks, backend="eager", dynamic=None)
    assert other is not cb and compiled(model) is other
    # inductor settings are part of the settings (equal mappings: the same wrappers)
    tuned = compile_blocks(model, model.blocks, backend="eager", dynamic=None, options={"a": 1, "b": 2})
    assert tuned is not other and tuned.options == {"a": 1, "b": 2}
    assert compile_blocks(model, model.blocks, backend="eager", dynamic=None, options={"b": 2, "a": 1}) is tuned
    # blocks replaced since (a family's own block forwards put in): new wrappers, which run the new blocks
    model.blocks[1] = torch.nn.Linear(8, 8)
    swapped = compile_blocks(model, model.blocks, backend="eager", dynamic=None, options={"a": 1, "b": 2})
    assert swapped is not tuned and swapped.blocks[1]._orig_mod is model.blocks[1]
    uncompile(model)
    assert compiled(model) is None
    uncompile(model)  # twice is fine


def test_a_graph_break_inside_a_block_fails_at_its_first_call():
    """fullgraph=True: a block that would fall back to a slow path raises instead."""

    class Breaks(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return x + 1

    model = torch.nn.Module()
    cb = compile_blocks(model, [Breaks()], backend="eager")
    with pytest.raises(Exception, match=r"(?i)graph.break"):
        cb.blocks[0](torch.zeros(2))


def test_compiled_blocks_go_with_their_model():
    model = Tiny(1)
    compile_blocks(model, model.blocks, backend="eager")
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


# -- blocks_for / compile_enabled / compile_info -----------------------------------------------------


def test_blocks_for_picks_the_compiled_blocks_only_when_allowed():
    model = Tiny()
    assert blocks_for(model, ctx()) is None  # on, but nothing compiled at load
    cb = compile_blocks(model, model.blocks, backend="eager")
    assert blocks_for(model, ctx()) is cb.blocks
    assert compile_enabled(ctx()) is True
    for c in (None, ctx(eager=True), ctx(OFF), SimpleNamespace(options=None, eager=False)):
        assert blocks_for(model, c) is None
        assert compile_enabled(c) is False


def test_compile_info_describes_what_a_request_ran_with():
    a, b, other = Tiny(2), Tiny(3), Tiny(1)
    assert compile_info(ctx(OFF, transformer=a)) is None
    assert compile_info(ctx(eager=True, transformer=a)) == {
        "enabled": False, "reason": "an interceptor or observer needs eager execution"}
    assert compile_info(ctx(transformer=a)) == {"enabled": False, "reason": "blocks were not compiled at load"}
    compile_blocks(a, a.blocks, backend="eager")
    compile_blocks(b, b.blocks, backend="eager")
    # every transformer* component counts (two experts); other components do not
    info = compile_info(ctx(transformer=a, transformer_2=b, vae=other))
    assert info == {"enabled": True, "regional": True, "blocks": 5, "backend": "eager", "mode": None, "fullgraph": True}
    assert compile_info(ctx(transformer=a, transformer_2=other))["enabled"] is False  # one expert not compiled
    compile_blocks(a, a.blocks, options={"triton.multi_kernel": 1})  # (lazy: nothing compiles here)
    assert compile_info(ctx(transformer=a))["inductor"] == {"triton.multi_kernel": 1}
    assert compile_info(ctx(), models=[b])["blocks"] == 3
