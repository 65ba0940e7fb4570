"""The node classes this compiler knows, with their inputs in ComfyUI's schema.

One table serves three readers: the editor-format converter (:mod:`.ui`: which widget value is
which input, in order), the input checks of the compiler (types, ranges, choices: every problem a
node error in ComfyUI's shape) and ``GET /object_info`` (:func:`object_info`).

Names, input names, defaults and ranges are ComfyUI's (its built-in nodes); the sampler and
scheduler lists are ComfyUI's too — a value outside the list is ``value_not_in_list`` as there, and
a listed value this runtime has no same-math sampler for is refused by the compiler
(:data:`omniloop_comfyui.compiler.SAMPLER_TABLE`).
"""

from __future__ import annotations

from typing import Any

from attrs import define, field

#: ComfyUI's seed range (``0xffffffffffffffff``); omniloop's seed is at most 2**63 - 1 (checked by the compiler)
MAX_SEED = 0xFFFFFFFFFFFFFFFF
MAX_RESOLUTION = 16384

SAMPLERS = (
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
    "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp",
    "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu",
    "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm",
    "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp", "res_multistep_ancestral",
    "res_multistep_ancestral_cfg_pp", "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde",
    "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2",
)
SCHEDULERS = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
              "linear_quadratic", "kl_optimal")
CLIP_TYPES = ("stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
              "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2",
              "ovis")
DUAL_CLIP_TYPES = ("sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image", "hunyuan_video_15",
                   "kandinsky5", "kandinsky5_image", "ltxv", "newbie", "ace")
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")


@define(frozen=True)
class In:
    """One input. ``kind``: a link type (``MODEL``, ``LATENT``, ...), ``INT``, ``FLOAT``, ``STRING``,
    ``BOOLEAN`` or ``COMBO`` (``choices``; ``file`` marks a file-name combo: loaders, LoadImage)."""

    name: str
    kind: str
    default: Any = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False
    multiline: bool = False
    #: a UI-only widget value follows this one in the editor's ``widgets_values`` (seed's "randomize")
    control_after_generate: bool = False
    #: a file-name combo (loaders, LoadImage): its choices are the served names, not a fixed list
    file: str | None = None

    @property
    def widget(self) -> bool:
        return self.kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")

    def takes(self, link_type: str) -> bool:
        """Whether an output of ``link_type`` may feed this input (``*``: any; a widget takes an
        output of its own kind, an ``INT``/``FLOAT`` the other number kind; a combo a ``STRING`` or ``*``)."""
        if self.kind == "*" or link_type == "*" or link_type == self.kind:
            return True
        if self.kind in ("INT", "FLOAT") and link_type in ("INT", "FLOAT"):
            return True
        return self.kind == "COMBO" and link_type == "STRING"


@define(frozen=True)
class NodeSpec:
    name: str
    inputs: tuple[In, ...]
    outputs: tuple[tuple[str, str], ...]  # (type, name)
    category: str
    output_node: bool = False
    #: UI-only widget values after the inputs' (LoadImage's "upload")
    trailing_ui_widgets: int = 0
    description: str = ""
    display_name: str | None = None
    _index: dict[str, In] = field(factory=dict, eq=False, repr=False)

    def input(self, name: str) -> In | None:
        if not self._index:
            self._index.update({i.name: i for i in self.inputs})
        return self._index.get(name)


def _int(name: str, default: int, lo: int, hi: int, **kw: Any) -> In:
    return In(name, "INT", default, lo, hi, **kw)


def _float(name: str, default: float, lo: float, hi: float, step: float = 0.01, **kw: Any) -> In:
    return In(name, "FLOAT", default, lo, hi, step, **kw)


def _combo(name: str, choices: tuple[str, ...], default: str | None = None, **kw: Any) -> In:
    return In(name, "COMBO", default if default is not None else choices[0], choices=choices, **kw)


def _file(name: str, folder: str, **kw: Any) -> In:
    return In(name, "COMBO", None, file=folder, **kw)


def _size(name: str, default: int) -> In:
    return In(name, "INT", default, 16, MAX_RESOLUTION, 16)


def _spec(name: str, inputs: list[In], outputs: list[tuple[str, str]], category: str, **kw: Any) -> NodeSpec:
    return NodeSpec(name=name, inputs=tuple(inputs), outputs=tuple(outputs), category=category, **kw)


_M, _C, _V, _L, _I, _CO = "MODEL", "CLIP", "VAE", "LATENT", "IMAGE", "CONDITIONING"

SPECS: dict[str, NodeSpec] = {s.name: s for s in [
    # -- loaders ------------------------------------------------------------------------------
    _spec("CheckpointLoaderSimple", [_file("ckpt_name", "checkpoints")], [(_M, "MODEL"), (_C, "CLIP"), (_V, "VAE")],
          "loaders"),
    _spec("UNETLoader", [_file("unet_name", "diffusion_models"), _combo("weight_dtype", WEIGHT_DTYPES)],
          [(_M, "MODEL")], "advanced/loaders"),
    _spec("CLIPLoader", [_file("clip_name", "text_encoders"), _combo("type", CLIP_TYPES),
                         _combo("device", ("default", "cpu"), optional=True)], [(_C, "CLIP")], "advanced/loaders"),
    _spec("DualCLIPLoader", [_file("clip_name1", "text_encoders"), _file("clip_name2", "text_encoders"),
                             _combo("type", DUAL_CLIP_TYPES), _combo("device", ("default", "cpu"), optional=True)],
          [(_C, "CLIP")], "advanced/loaders"),
    _spec("TripleCLIPLoader", [_file("clip_name1", "text_encoders"), _file("clip_name2", "text_encoders"),
                               _file("clip_name3", "text_encoders")], [(_C, "CLIP")], "advanced/loaders"),
    _spec("VAELoader", [_file("vae_name", "vae")], [(_V, "VAE")], "loaders"),
    _spec("CLIPVisionLoader", [_file("clip_name", "clip_vision")], [("CLIP_VISION", "CLIP_VISION")], "loaders"),
    _spec("LoraLoader", [In("model", _M), In("clip", _C), _file("lora_name", "loras"),
                         _float("strength_model", 1.0, -100.0, 100.0), _float("strength_clip", 1.0, -100.0, 100.0)],
          [(_M, "MODEL"), (_C, "CLIP")], "loaders"),
    _spec("LoraLoaderModelOnly", [In("model", _M), _file("lora_name", "loras"),
                                  _float("strength_model", 1.0, -100.0, 100.0)], [(_M, "MODEL")], "loaders"),
    # -- conditioning -------------------------------------------------------------------------
    _spec("CLIPTextEncode", [In("text", "STRING", "", multiline=True), In("clip", _C)], [(_CO, "CONDITIONING")],
          "conditioning"),
    _spec("CLIPTextEncodeFlux", [In("clip", _C), In("clip_l", "STRING", "", multiline=True),
                                 In("t5xxl", "STRING", "", multiline=True), _float("guidance", 3.5, 0.0, 100.0, 0.1)],
          [(_CO, "CONDITIONING")], "advanced/conditioning/flux"),
    _spec("FluxGuidance", [In("conditioning", _CO), _float("guidance", 3.5, 0.0, 100.0, 0.1)],
          [(_CO, "CONDITIONING")], "advanced/conditioning/flux"),
    _spec("ConditioningZeroOut", [In("conditioning", _CO)], [(_CO, "CONDITIONING")], "advanced/conditioning"),
    _spec("CLIPVisionEncode", [In("clip_vision", "CLIP_VISION"), In("image", _I),
                               _combo("crop", ("center", "none"))], [("CLIP_VISION_OUTPUT", "CLIP_VISION_OUTPUT")],
          "conditioning"),
    _spec("WanImageToVideo", [In("positive", _CO), In("negative", _CO), In("vae", _V), _size("width", 832),
                              _size("height", 480), _int("length", 81, 1, MAX_RESOLUTION, step=4),
                              _int("batch_size", 1, 1, 4096),
                              In("clip_vision_output", "CLIP_VISION_OUTPUT", optional=True),
                              In("start_image", _I, optional=True)],
          [(_CO, "positive"), (_CO, "negative"), (_L, "latent")], "conditioning/video_models"),
    # -- latents ------------------------------------------------------------------------------
    _spec("EmptyLatentImage", [_int("width", 512, 16, MAX_RESOLUTION, step=8), _int("height", 512, 16, MAX_RESOLUTION, step=8),
                               _int("batch_size", 1, 1, 4096)], [(_L, "LATENT")], "latent"),
    _spec("EmptySD3LatentImage", [_size("width", 1024), _size("height", 1024), _int("batch_size", 1, 1, 4096)],
          [(_L, "LATENT")], "latent/sd3"),
    _spec("EmptyHunyuanLatentVideo", [_size("width", 848), _size("height", 480),
                                      _int("length", 25, 1, MAX_RESOLUTION, step=4), _int("batch_size", 1, 1, 4096)],
          [(_L, "LATENT")], "latent/video"),
    _spec("Wan22ImageToVideoLatent", [In("vae", _V), _int("width", 1280, 32, MAX_RESOLUTION, step=32),
                                      _int("height", 704, 32, MAX_RESOLUTION, step=32),
                                      _int("length", 49, 1, MAX_RESOLUTION, step=4), _int("batch_size", 1, 1, 4096),
                                      In("start_image", _I, optional=True)], [(_L, "LATENT")], "conditioning/inpaint"),
    _spec("VAEEncode", [In("pixels", _I), In("vae", _V)], [(_L, "LATENT")], "latent"),
    _spec("VAEDecode", [In("samples", _L), In("vae", _V)], [(_I, "IMAGE")], "latent"),
    # -- model sampling -----------------------------------------------------------------------
    _spec("ModelSamplingSD3", [In("model", _M), _float("shift", 3.0, 0.0, 100.0)], [(_M, "MODEL")],
          "advanced/model"),
    _spec("ModelSamplingFlux", [In("model", _M), _float("max_shift", 1.15, 0.0, 100.0), _float("base_shift", 0.5, 0.0, 100.0),
                                _int("width", 1024, 16, MAX_RESOLUTION, step=8), _int("height", 1024, 16, MAX_RESOLUTION, step=8)],
          [(_M, "MODEL")], "advanced/model"),
    # -- sampling -----------------------------------------------------------------------------
    _spec("KSampler", [In("model", _M), _int("seed", 0, 0, MAX_SEED, control_after_generate=True),
                       _int("steps", 20, 1, 10000), _float("cfg", 8.0, 0.0, 100.0, 0.1),
                       _combo("sampler_name", SAMPLERS), _combo("scheduler", SCHEDULERS), In("positive", _CO),
                       In("negative", _CO), In("latent_image", _L), _float("denoise", 1.0, 0.0, 1.0)],
          [(_L, "LATENT")], "sampling"),
    _spec("KSamplerAdvanced", [In("model", _M), _combo("add_noise", ("enable", "disable")),
                               _int("noise_seed", 0, 0, MAX_SEED, control_after_generate=True),
                               _int("steps", 20, 1, 10000), _float("cfg", 8.0, 0.0, 100.0, 0.1),
                               _combo("sampler_name", SAMPLERS), _combo("scheduler", SCHEDULERS), In("positive", _CO),
                               In("negative", _CO), In("latent_image", _L), _int("start_at_step", 0, 0, 10000),
                               _int("end_at_step", 10000, 0, 10000),
                               _combo("return_with_leftover_noise", ("disable", "enable"))],
          [(_L, "LATENT")], "sampling"),
    # -- images and video ---------------------------------------------------------------------
    _spec("LoadImage", [_file("image", "input")], [(_I, "IMAGE"), ("MASK", "MASK")], "image",
          trailing_ui_widgets=1),
    _spec("SaveImage", [In("images", _I), In("filename_prefix", "STRING", "ComfyUI")], [], "image", output_node=True),
    _spec("PreviewImage", [In("images", _I)], [], "image", output_node=True),
    _spec("SaveAnimatedWEBP", [In("images", _I), In("filename_prefix", "STRING", "ComfyUI"),
                               _float("fps", 6.0, 0.01, 1000.0), In("lossless", "BOOLEAN", True),
                               _int("quality", 80, 0, 100), _combo("method", ("default", "fastest", "slowest"))],
          [], "image/animation", output_node=True),
    _spec("SaveWEBM", [In("images", _I), In("filename_prefix", "STRING", "ComfyUI"), _combo("codec", ("vp9", "av1")),
                       _float("fps", 24.0, 0.01, 1000.0), _float("crf", 32.0, 0.0, 63.0, 1.0)],
          [], "image/video", output_node=True),
    _spec("CreateVideo", [In("images", _I), _float("fps", 30.0, 1.0, 120.0, 1.0), In("audio", "AUDIO", optional=True)],
          [("VIDEO", "VIDEO")], "image/video"),
    # -- values and logic (ComfyUI's core primitive, switch and math nodes) --------------------
    _spec("PrimitiveInt", [_int("value", 0, -(2**63), 2**63 - 1, control_after_generate=True)], [("INT", "INT")],
          "utils/primitive"),
    _spec("PrimitiveFloat", [_float("value", 0.0, -1e300, 1e300)], [("FLOAT", "FLOAT")], "utils/primitive"),
    _spec("PrimitiveBoolean", [In("value", "BOOLEAN", False)], [("BOOLEAN", "BOOLEAN")], "utils/primitive"),
    _spec("PrimitiveString", [In("value", "STRING", "")], [("STRING", "STRING")], "utils/primitive"),
    _spec("PrimitiveStringMultiline", [In("value", "STRING", "", multiline=True)], [("STRING", "STRING")],
          "utils/primitive"),
    _spec("ComfySwitchNode", [In("switch", "BOOLEAN", False), In("on_false", "*", optional=True),
                              In("on_true", "*", optional=True)], [("*", "output")], "logic",
          description="the on_true input when switch is true, else on_false; the other branch is not compiled"),
    _spec("ComfyMathExpression", [In("expression", "STRING", "a + b"), In("values.a", "*", optional=True),
                                  In("values.b", "*", optional=True), In("values.c", "*", optional=True)],
          [("FLOAT", "FLOAT"), ("INT", "INT")], "utils",
          description="arithmetic on a, b, c (+ - * / // % **, floor ceil round abs min max sqrt); nothing else"),
    _spec("SaveVideo", [In("video", "VIDEO"), In("filename_prefix", "STRING", "video/ComfyUI"),
                        _combo("format", ("auto", "mp4")), _combo("codec", ("auto", "h264"))],
          [], "image/video", output_node=True),
]}

#: editor-only nodes: no inputs to compile (``Note``) or pass-throughs resolved by :mod:`.ui`
UI_ONLY = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})


def _schema(i: In, names: dict[str, list[str]]) -> list[Any]:
    opts: dict[str, Any] = {}
    if i.kind == "COMBO":
        choices = list(i.choices) if i.choices is not None else list(names.get(i.file or "", []))
        if i.file == "input":
            opts["image_upload"] = True
        if i.default is not None:
            opts["default"] = i.default
        return [choices, opts]
    if i.kind in ("INT", "FLOAT", "STRING", "BOOLEAN"):
        if i.default is not None:
            opts["default"] = i.default
        if i.min is not None:
            opts["min"] = i.min
        if i.max is not None:
            opts["max"] = i.max
        if i.step is not None:
            opts["step"] = i.step
        if i.multiline:
            opts["multiline"] = True
        if i.control_after_generate:
            opts["control_after_generate"] = True
        return [i.kind, opts] if opts else [i.kind]
    return [i.kind]


def object_info(names: dict[str, list[str]] | None = None, only: str | None = None) -> dict[str, Any]:
    """``GET /object_info`` (ComfyUI's schema): every supported node class with its inputs; the
    file-name combos list ``names[folder]`` (the served model and the deploy's aliases)."""
    names = names or {}
    out: dict[str, Any] = {}
    for spec in SPECS.values():
        if only is not None and spec.name != only:
            continue
        req = {i.name: _schema(i, names) for i in spec.inputs if not i.optional}
        opt = {i.name: _schema(i, names) for i in spec.inputs if i.optional}
        out[spec.name] = {
            "input": {"required": req, **({"optional": opt} if opt else {})},
            "input_order": {"required": list(req), **({"optional": list(opt)} if opt else {})},
            "output": [t for t, _ in spec.outputs], "output_is_list": [False] * len(spec.outputs),
            "output_name": [n for _, n in spec.outputs], "name": spec.name,
            "display_name": spec.display_name or spec.name, "description": spec.description,
            "python_module": "omniloop_comfyui", "category": spec.category, "output_node": spec.output_node,
        }
    return out
