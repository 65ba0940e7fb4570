"""An experiment for issue 40, not a deploy mode: FP8 linears only after the first K denoising steps.

Run before an adherence evaluation in the same process (``gpu_fp8lin_flux_demo.sh``'s ``PRELUDE``)::

    PRELUDE='import runpy; runpy.run_path("bench/fp8_dtype_first_steps.py")' FP8_DTYPE_STEPS=5 \\
        RUNS=fp8 bash plugins/compute/quant/scripts/gpu_fp8lin_flux_demo.sh

It patches omniloop-quant so that ``linear_precision: fp8`` keeps the replaced bf16 modules, counts the
denoiser's forwards with a pre-hook on its first transformer block, and routes every FP8 module to the module
it replaced while the forward's index within an image (``count % FP8_STEPS_PER_IMAGE``, default 20: the
evaluation runs one image at a time, one forward per step at guidance 1) is below ``FP8_DTYPE_STEPS``.
``FP8_DTYPE_STEPS=0`` is plain ``fp8``; ``FP8_DTYPE_STEPS=20`` runs every step through the original modules
(must match ``linear_precision: dtype`` verdict for verdict: the control).

The question it answers: whether flux-demo's lost shape verdicts come from FP8 in the early, high-noise steps
(where the layout is decided) — if so, a precision schedule would keep most of FP8's speed.
"""

from __future__ import annotations

import os
from typing import Any

import omniloop_quant
import omniloop_quant.blocks as _blocks
import omniloop_quant.fp8 as _fp8

DTYPE_STEPS = int(os.environ.get("FP8_DTYPE_STEPS", "0"))
STEPS = int(os.environ.get("FP8_STEPS_PER_IMAGE", "20"))
_state = {"forwards": 0}
_install = _fp8.install


def _keep_install(*args: Any, **kwargs: Any) -> dict[str, Any]:
    kwargs["keep_original"] = True
    report = _install(*args, **kwargs)
    for swaps in _fp8._SWAPS.values():
        for _parent, _name, original, new in swaps:
            new.__dict__["_probe_original"] = original  # not a submodule: .to() and state_dict ignore it
    return report


def _early() -> bool:
    return (_state["forwards"] - 1) % STEPS < DTYPE_STEPS


def _routed(cls: type) -> None:
    forward = cls.forward

    def probe_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = self.__dict__.get("_probe_original")
        if original is not None and _early():
            return original(*args, **kwargs)
        return forward(self, *args, **kwargs)

    cls.forward = probe_forward


_apply = _blocks.apply


def _counting_apply(model: Any, family: Any, deploy: Any) -> Any:
    report = _apply(model, family, deploy)
    blocks = _blocks.denoiser_blocks(model.components, family)
    if blocks:
        blocks[0][1].register_forward_pre_hook(lambda *_: _state.__setitem__("forwards", _state["forwards"] + 1))
    return report


_blocks.install = _keep_install
_blocks.apply = _counting_apply
omniloop_quant.apply = _counting_apply  # the plugin's spec calls the package's (lazy) export
for _cls in (_fp8.FP8Linear, _fp8.FP8FeedForward, _fp8.FP8GeluProjection):
    _routed(_cls)
print(f"fp8_dtype_first_steps: the first {DTYPE_STEPS} of every {STEPS} steps through the bf16 modules", flush=True)
