"""The FLUX.1 family's denoise policies: one :class:`omniloop_policies.PolicyMenu` per loaded model.

* sampler ``flow-euler`` over the checkpoint's ``FlowMatchEulerDiscreteScheduler`` config, with
  ``sigma_schedule="linear"`` — the ``np.linspace(1, 1/n, n)`` sigmas diffusers' Flux pipelines
  hand to ``set_timesteps`` — and the scheduler step on the tensors as diffusers passes them;
* shift ``resolution`` (``mu`` from the packed image token count, the scheduler config's
  ``base/max_image_seq_len`` and ``base/max_shift``) when the config sets ``use_dynamic_shifting``
  (FLUX.1 [dev]), else ``constant`` (FLUX.1 [schnell]: shift 1.0, ``mu`` unused, as in diffusers);
* CFG ``embedded`` (default): one forward per step, the guidance scale fed to the model's guidance
  embedding (FLUX.1 [dev]); schnell has no guidance input, so the scale is not used.
* CFG ``classic`` (``node_params.denoise.cfg``): diffusers' "true CFG" — a second forward on the
  negative prompt and ``neg + scale * (cond - neg)`` with the request's guidance scale as
  ``true_cfg_scale``; the guidance embedding then gets the checkpoint's default guidance.

With these defaults the denoise loop is ``FluxPipeline`` / ``FluxImg2ImgPipeline``'s op for op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniloop.family import LoadedModel
from omniloop_kit.policies import MENU_KEY, NODE, cached_menu, deploy_policies, model_precision, scheduler_shift
from omniloop_kit.policies import build_menu as kit_menu


def build_menu(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """omniloop-kit's menu with FLUX's fixed choices; the deploy's ``policies:`` takes no key
    (an entry is refused, naming the family)."""
    options = options or {}
    deploy = deploy_policies(options, "flux", keys=())
    return kit_menu(model, options, deploy, samplers=["flow-euler"], cfgs=["embedded", "classic"],
                    sampler_options={"flow-euler": {"sigma_schedule": "linear"}}, default_sampler="flow-euler",
                    default_cfg="embedded", shift=scheduler_shift(model), precision=model_precision(model))


def menu_for(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """The model's menu, built on first use and kept in ``model.config["policy_menu"]``."""
    return cached_menu(model, lambda: build_menu(model, options))


__all__ = ["MENU_KEY", "NODE", "build_menu", "menu_for"]
