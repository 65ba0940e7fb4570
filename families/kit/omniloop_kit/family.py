"""The family skeleton of a diffusers-format denoiser: its declaration (capabilities with the
offload paths of the usual text encoders), loading a checkpoint by its layout, and the protocol
methods every such family writes the same way (``detect``, ``resolve``, ``validate_request``).

A family subclasses :class:`DiffusersFamily`, sets ``layout`` (:class:`omniloop_kit.checkpoint.Layout`)
and writes ``resolve_request(model, request, limits, *, decode_image=True, node_params=None) ->
(resolved, warnings)``, ``model_config`` and ``build_pipeline``; ``load`` (:func:`load_checkpoint` by
the layout, then the family's ``from_components``) and ``task_defaults`` (the model's defaults)
have defaults a family replaces when its checkpoint or its tasks need more
(examples/minimal-family is a whole family on these).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attrs import define

from omniloop.capabilities import FamilyCapabilities, OffloadSupport
from omniloop.family import LoadedModel
from omniloop.request import OmniRequest

from .checkpoint import Layout, looks_like, read_extra, resolve_root, weight_version

#: ``offload: sequential``'s block list of a CLIP text encoder (its layers moved from
#: ``text_model.encoder`` to ``encoder`` in transformers 5 for some classes: both spellings)
CLIP_TEXT_LAYERS = "text_model.encoder.layers|encoder.layers"
#: the same for a CLIP vision encoder
CLIP_VISION_LAYERS = "encoder.layers|vision_model.encoder.layers"
#: a T5 / UMT5 encoder's blocks
T5_BLOCKS = "encoder.block"


def capabilities(*, offload: Mapping[str, Any] | None, offload_refusal: Callable[..., str | None] | None = None,
                 **more: Any) -> FamilyCapabilities:
    """A diffusers-format denoiser's declaration: its blocks run through ``run_blocks`` (block
    interceptors), post-training rollouts on its denoise loop (``rollout_support``, default: the
    ``denoise`` node with latents as they are), the ``offload`` components (the VAE moves whole;
    None: no offload),
    the final latents returned, ``resolve`` / ``task_defaults`` defined, and the ``denoise`` node's
    batched step retried alone when its forward raises (``step_batch_retry_alone``: the kit's
    :meth:`~omniloop_kit.denoise.DenoiseLoop.step_batch` changes no request state before its
    batched forward returns; the CFG plan's count is per step index); ``more``: the other
    :class:`~omniloop.capabilities.FamilyCapabilities` fields (adapters, options, parallel, ...)."""
    from omniloop.rl import RolloutSupport

    fields: dict[str, Any] = {"block_interceptors": True, "rollout_support": RolloutSupport(),
                              "returns_latents": True, "resolve": True, "task_defaults": True,
                              "step_batch_retry_alone": {"denoise"}}
    fields.update(more)
    support = None if offload is None else OffloadSupport(components=dict(offload), refusal=offload_refusal)
    return FamilyCapabilities(offload=support, **fields)


@define(frozen=True)
class Checkpoint:
    """A checkpoint checked and loaded: its folder, ``model_index.json``, the components present,
    its ``omniloop.json`` (``extra``) and the loaded components."""

    root: Path
    index: dict[str, Any]
    present: list[str]
    extra: dict[str, Any]
    components: dict[str, Any]

    @property
    def weight_version(self) -> str:
        return weight_version(self.root, self.present)


def load_checkpoint(path: str | Path, check: Callable[[Path], tuple[dict[str, Any], list[str]]],
                    load: Callable[..., Any], *, device: Any, dtype: Any,
                    dtypes: Mapping[str, Any] | None = None, names: list[str] | None = None) -> Checkpoint:
    """Find the checkpoint (a Hugging Face cache folder works too), ``check(root) -> (index,
    present)`` every file before any weight is read, then ``load(index, root, name, device=...,
    dtype=...)`` each component (``names``, default: all present) in its dtype (``dtypes`` per
    component, else ``dtype``)."""
    root = resolve_root(path)
    index, present = check(root)
    extra = read_extra(root)
    comps = {n: load(index, root, n, device=device, dtype=(dtypes or {}).get(n, dtype))
             for n in (present if names is None else names)}
    return Checkpoint(root=root, index=index, present=present, extra=extra, components=comps)


def compute_device(options: Mapping[str, Any] | None, device: Any) -> Any:
    """Where the model computes: the deploy's device under ``offload`` (the weights were loaded into
    host memory and move to it as nodes run, omniloop.offload), else the load device."""
    import torch

    deploy = (options or {}).get("deploy")
    if deploy is not None and deploy.offload != "none":
        return torch.device(deploy.device)
    return device


class DiffusersFamily:
    """The protocol methods a diffusers-format family writes the same way (see the module docstring)."""

    name: str
    layout: Layout
    #: the components :meth:`from_components` must be given (default: the layout's required ones)
    needs: tuple[str, ...] | None = None

    def load(self, path: Path, *, device: Any, dtype: Any, options: dict[str, Any]) -> LoadedModel:
        """Every file of the checkpoint checked by the family's ``layout`` first (one
        ``CheckpointError`` naming the file), then each component loaded by the class
        ``model_index.json`` names (local files only); its ``omniloop.json`` defaults apply."""
        from .checkpoint import check_checkpoint, load_component

        got = load_checkpoint(path, lambda root: check_checkpoint(root, self.layout)[:2], load_component,
                              device=device, dtype=dtype)
        return self.from_components(got.components, defaults=got.extra.get("defaults"), device=device, dtype=dtype,
                                    path=got.root, weight_version=got.weight_version, options=options)

    def task_defaults(self, model: LoadedModel, task: Any) -> dict[str, Any]:
        """What a request gets for fields it leaves unset (``Runtime.defaults``): the model's
        ``config["defaults"]`` (a family with per-task defaults writes its own)."""
        return dict(model.config["defaults"])

    def from_components(self, components: dict[str, Any], *, defaults: dict[str, Any] | None = None,
                        device: Any = None, dtype: Any = None, options: Mapping[str, Any] | None = None,
                        path: Path | None = None, weight_version: str = "", **extra: Any) -> LoadedModel:
        """A ``LoadedModel`` over modules already in memory (benchmarks, tests, notebooks; ``load``
        ends here too). ``defaults`` override the checkpoint's request defaults; ``options`` are the
        family options a runtime passes to ``load`` (plus ``deploy``, ``registry``, ``attention``):
        attention processors, compiled blocks and the like are set up *on these modules* (shared by
        whoever else uses them); ``extra``: the family's own (Wan's ``index``, SD3's ``variant``).
        The family writes :meth:`model_config` and :meth:`prepare`."""
        self.require(components, self.layout.required if self.needs is None else self.needs)
        opts = dict(options or {})
        config, more = self.model_config(components, defaults, opts, **extra)
        model = self.loaded_model(components, config, path=path, device=device, dtype=dtype,
                                  weight_version=weight_version, **more)
        self.prepare(model, opts)
        return model

    def model_config(self, components: dict[str, Any], defaults: dict[str, Any] | None, options: dict[str, Any],
                     **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(model.config, more LoadedModel fields)`` of a model over ``components``."""
        raise NotImplementedError

    def prepare(self, model: LoadedModel, options: dict[str, Any]) -> None:
        """Set the loaded modules up for the deployment (compiled blocks, attention, the policy menu
        built so that an incompatible scheduler config fails at load)."""

    def detect(self, path: Path) -> bool:
        """Cheap detection from the checkpoint's ``model_index.json`` and transformer config."""
        return looks_like(path, self.layout)

    @staticmethod
    def require(components: Mapping[str, Any], names: tuple[str, ...]) -> Mapping[str, Any]:
        """``components``, every one of ``names`` present (else one ``CheckpointError`` naming them)."""
        from omniloop.errors import CheckpointError

        missing = [n for n in names if components.get(n) is None]
        if missing:
            raise CheckpointError(f"from_components: missing component(s) {', '.join(missing)}")
        return components

    def loaded_model(self, components: dict[str, Any], config: dict[str, Any], *, path: Path | None = None,
                     device: Any = None, dtype: Any = None, weight_version: str = "", **more: Any) -> LoadedModel:
        """A :class:`~omniloop.family.LoadedModel` of this family over ``components``; without a
        weight version (modules built in memory) the transformer's identity stands for it."""
        import torch

        return LoadedModel(family=self.name, path=path, components=components, config=config,
                           device=device if device is not None else torch.device("cpu"),
                           dtype=dtype if dtype is not None else torch.float32,
                           weight_version=weight_version or f"in-memory:{id(components['transformer']):x}", **more)

    @staticmethod
    def compile_model(model: LoadedModel, options: Mapping[str, Any] | None, blocks: Callable[[Any], Any],
                      experts: tuple[str, ...] = ("transformer",)) -> None:
        """Deploy ``compile: true``: each expert's blocks (``blocks(transformer)``) under
        ``torch.compile`` (:mod:`omniloop_kit.compile`), the settings in ``model.config["compile"]``."""
        from .compile import compile_blocks, compile_options

        settings = compile_options(options or {})
        if settings is None:
            return
        for name in experts:
            if name in model.components:
                compile_blocks(model.components[name], blocks(model.components[name]), **settings)
        model.config["compile"] = dict(settings)

    def resolve_request(self, model: LoadedModel, request: OmniRequest, limits: Any, *, decode_image: bool = True,
                        node_params: Any = None) -> tuple[Any, list[str]]:
        raise NotImplementedError

    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *, node_params: Any = None) -> Any:
        """The request resolved once (``Runtime.prepare`` calls this; the nodes read ``ctx.resolved``)."""
        return self.resolve_request(model, request, limits, node_params=node_params)[0]

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        """The warnings of :meth:`resolve` (without decoding an input image)."""
        return self.resolve_request(model, request, limits, decode_image=False)[1]


__all__ = ["CLIP_TEXT_LAYERS", "CLIP_VISION_LAYERS", "T5_BLOCKS", "Checkpoint", "DiffusersFamily", "capabilities",
           "compute_device", "load_checkpoint"]
