"""The conformance kit catches the mistakes it exists for, and passes a correct plugin."""

import warnings

import pytest

from omniloop.errors import HookDeprecationWarning
from omniloop.hookspecs import hookimpl
from omniloop.testing import conformance, toy_runtime


class Identity:
    name = "identity"
    graph_safe = True
    distribution_altering = False
    needs_eager = False

    def open(self, step, loop, params=None):
        return {"n": 0}

    def run(self, blocks, hidden, ctx, call):
        for b in blocks:
            hidden = call(b, hidden)
        ctx.state["n"] += 1
        return hidden

    def close(self, state):
        pass

    def metrics(self, state):
        return {"forwards": state["n"]}


class SharedState(Identity):
    """Wrong: keeps per-request state on the instance, so interleaved requests leak into each other."""

    name = "shared"

    def __init__(self):
        self.prev = None

    def run(self, blocks, hidden, ctx, call):
        out = super().run(blocks, hidden, ctx, call)
        if self.prev is not None and self.prev.shape == out.shape:
            out = out + 1e-3 * self.prev
        self.prev = out.detach()
        return out


class Patcher(Identity):
    """Wrong: patches the shared blocks and never restores them."""

    name = "patcher"

    def run(self, blocks, hidden, ctx, call):
        for b in blocks:
            b.mlp[2].bias.data.add_(0.01) if not getattr(b, "_patched", False) else None
            b._patched = True
        return super().run(blocks, hidden, ctx, call)


class Undeclared:
    name = "undeclared"

    def open(self, step, loop):
        return None


class OneDotZero(Identity):
    """Written against the 1.0 hook signature ``open(step, loop)``: still runs in the 1.x series, with a warning."""

    name = "one-dot-zero"

    def open(self, step, loop):
        return {"n": 0}


def test_a_correct_interceptor_passes():
    with warnings.catch_warnings():  # the kit calls open(step, loop, params) as the runtime does: no deprecation
        warnings.simplefilter("error", HookDeprecationWarning)
        conformance.check_block_interceptor(Identity)


def test_an_interceptor_with_the_1_0_open_passes_with_its_deprecation_warning():
    with pytest.warns(HookDeprecationWarning, match="one-dot-zero"):
        conformance.check_block_interceptor(OneDotZero)


def test_state_on_the_instance_is_caught():
    with pytest.raises(AssertionError, match=r"interleaved|different outputs"):
        conformance.check_block_interceptor(SharedState)


def test_leftover_patching_is_caught():
    with pytest.raises(AssertionError, match=r"left patched|different outputs"):
        conformance.check_block_interceptor(Patcher)


def test_undeclared_capabilities_are_caught():
    with pytest.raises(AssertionError, match="graph_safe"):
        conformance.check_block_interceptor(Undeclared)


class StepCounter:
    name = "counter"
    needs_eager = False

    def __init__(self):
        self.n = 0

    @hookimpl
    def omniloop_step_end(self, request, node, step):
        self.n += 1


class Mutator(StepCounter):
    @hookimpl
    def omniloop_tap(self, name, value):
        if name == "latents":
            value.mul_(1.01)


def test_observer_checks():
    conformance.check_observer(StepCounter)
    with pytest.raises(AssertionError, match="read-only"):
        conformance.check_observer(Mutator)


def test_toy_family_passes_the_family_kit(toy_checkpoint):
    conformance.check_family(lambda: toy_runtime(toy_checkpoint), {"task": "t2v", "prompt": "a red circle"})
