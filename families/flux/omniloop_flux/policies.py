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

from omniloop.errors import DeployError
from omniloop.family import LoadedModel

MENU_KEY = "policy_menu"
NODE = "denoise"


def build_menu(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    from omniloop_policies import (
        ConstantShift,
        PolicyError,
        PolicyMenu,
        PrecisionPolicy,
        ResolutionShift,
        SchedulerConfigError,
    )

    comps = model.components
    scheduler = comps["scheduler"]
    sched_config = dict(scheduler.config)
    sched_config.setdefault("_class_name", type(scheduler).__name__)
    source = str(model.path / "scheduler" / "scheduler_config.json") if model.path is not None else "scheduler config"
    dynamic = bool(sched_config.get("use_dynamic_shifting", False))
    shift = ResolutionShift.from_config(sched_config) if dynamic else ConstantShift()
    dtype = comps["transformer"].dtype
    precision = PrecisionPolicy(dtypes={"transformer": dtype}, default_dtype=dtype, step_dtype=None)
    defaults = model.config["defaults"]
    try:
        return PolicyMenu.build(
            sched_config, source=source, samplers=["flow-euler"], cfgs=["embedded", "classic"],
            sampler_options={"flow-euler": {"sigma_schedule": "linear"}}, default_sampler="flow-euler",
            default_cfg="embedded", shift=shift, precision=precision,
            default_guidance_scale=float(defaults["guidance_scale"]), default_steps=int(defaults["steps"]), node=NODE,
        )
    except SchedulerConfigError:
        raise  # a CheckpointError naming the file
    except (PolicyError, TypeError, ValueError) as err:
        raise DeployError(f"policies: {err}") from None


def menu_for(model: LoadedModel, options: Mapping[str, Any] | None = None) -> Any:
    """The model's menu, built on first use and kept in ``model.config["policy_menu"]``."""
    menu = model.config.get(MENU_KEY)
    if menu is None:
        menu = build_menu(model, options)
        model.config[MENU_KEY] = menu
    return menu
