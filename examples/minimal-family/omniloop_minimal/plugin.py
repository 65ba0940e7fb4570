"""A complete minimal family on omniloop-kit: a tiny diffusers-format text-to-image model (T5, Sana
transformer, AutoencoderKL, flow matching; ``omniloop_minimal.tiny`` builds one) — CONTRIBUTING.md."""

from __future__ import annotations

from typing import Any

from omniloop import Embeddings, LoopState, PipelineSpec, TaskType, hookimpl
from omniloop_kit import checkpoint as ck
from omniloop_kit.denoise import DenoiseLoop, randn, request_generator
from omniloop_kit.family import DiffusersFamily, capabilities
from omniloop_kit.policies import build_menu, cached_menu, deploy_policies
from omniloop_kit.resolve import ImageParams, resolve_image
from omniloop_kit.stages import Validate, image_nodes, params_of, vae_scale_factor
from omniloop_policies.stepping import stack_rows

OMNILOOP_HOOK_API = ">=1.0,<2"
TEXT = {"prompt_embeds": Embeddings, "negative_embeds": Embeddings}


class TextEncode:  # the prompt and the negative prompt (classifier-free guidance), T5 states
    def forward(self, ctx: Any, state: Any) -> None:
        p, tok, te = params_of(state), ctx.components["tokenizer"], ctx.components["text_encoder"]
        for edge, text in (("prompt_embeds", p.prompt), ("negative_embeds", p.negative_prompt or "")):
            ids = tok([text], padding="max_length", max_length=p.max_sequence_length, truncation=True,
                      return_tensors="pt").input_ids.to(ctx.device)
            state.write(edge, Embeddings(tensor=te(ids).last_hidden_state), ctx.node.name)


class Denoise(DenoiseLoop):  # the kit's loop; the model's own: its latents, inputs and forward
    def init(self, ctx: Any, state: Any) -> LoopState:
        p, tf, gen, loop = params_of(state), ctx.components["transformer"], request_generator(state), LoopState()
        vsf = vae_scale_factor(ctx.components["vae"])
        shape = (1, tf.config.in_channels, p.height // vsf, p.width // vsf)
        p.policies.init(loop, device=ctx.device, generator=gen, seq_len=shape[2] * shape[3])
        loop.tensors["latents"] = randn(shape, gen, ctx.device, tf.dtype)
        return loop

    def inputs(self, ctx: Any, state: Any, loop: LoopState, pol: Any, expert: str | None) -> Any:
        text = {"cond": state.read("prompt_embeds").tensor, "uncond": state.read("negative_embeds").tensor}
        return loop.tensors["latents"], pol.timestep(loop).expand(1), text

    def stack(self, inputs: Any, group: tuple[str, ...]) -> dict[str, Any]:
        return stack_rows(inputs, group, lambda i, b: {"hidden_states": i[0], "timestep": i[1],
                                                       "encoder_hidden_states": i[2][b]})

    def rows(self, inputs: Any) -> int:
        return 1

    def forward(self, ctx: Any, expert: str, batch: dict[str, Any], block_ctx: Any) -> Any:
        return ctx.components["transformer"](**batch, return_dict=False)[0]


class MinimalFamily(DiffusersFamily):
    name, tasks = "minimal", frozenset({TaskType.T2I})
    layout = ck.Layout(what="a minimal checkpoint", pipelines=("MinimalPipeline",), transformer_class="SanaTransformer2DModel",
                       required=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"))
    # what it serves: the kit's loop (batched steps, latents returned); no offload, no block interceptors
    capabilities = capabilities(offload=None, block_interceptors=False, options=frozenset())

    def model_config(self, components: dict[str, Any], defaults: Any, options: Any, **extra: Any) -> tuple[dict, dict]:
        return {"tasks": self.tasks, "size_multiple": vae_scale_factor(components["vae"]), "defaults": dict(defaults or {})}, {}

    def menu(self, model: Any, options: Any = None) -> Any:
        return cached_menu(model, lambda: build_menu(model, options or {}, deploy_policies(options or {}, self.name),
                                                     default_cfg="classic"))

    def build_pipeline(self, model: Any, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        validate = Validate(model, resolve=lambda r, lim: self.resolve_request(model, r, lim), params_type=ImageParams)
        nodes = image_nodes(validate, TextEncode(), Denoise(self.menu(model, options)), i2i=False,
                            text_uses=("text_encoder",), denoise_reads=TEXT)
        return PipelineSpec(family=self.name, task=task, nodes=nodes, outputs={"image": "image", "latents": "latents"})

    def resolve_request(self, model: Any, request: Any, limits: Any, **kw: Any) -> tuple[ImageParams, list[str]]:
        return resolve_image(model, request, self.menu(model), kw.get("node_params"), who="the minimal family")


@hookimpl
def omniloop_register_families(register: Any) -> None:
    register(MinimalFamily())
