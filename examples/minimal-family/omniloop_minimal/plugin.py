"""A complete minimal family: a declaration plus its model (CONTRIBUTING.md, "Writing a family")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omniloop import Embeddings, FamilyCapabilities, Latents, Node, PipelineSpec, TaskType, VideoFrames, hookimpl
from omniloop.errors import CheckpointError
from omniloop.family import LoadedModel
from omniloop.testing.toy import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    Decode,
    Denoise,
    EncodeText,
    ToyDecoder,
    ToyTextEncoder,
    ToyTransformer,
)

OMNILOOP_HOOK_API = ">=1.0,<2"


class MinimalFamily:
    name = "minimal"
    tasks = frozenset({TaskType.T2V})
    # everything optional it can do; registration checks it (task_defaults is defined below)
    capabilities = FamilyCapabilities(block_interceptors=True, returns_latents=True, options=(), task_defaults=True)

    def detect(self, path: Path) -> bool:
        f = Path(path) / CONFIG_NAME
        return f.is_file() and json.loads(f.read_text()).get("family") == self.name

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        cfg = json.loads((Path(path) / CONFIG_NAME).read_text())
        comps = {"text_encoder": ToyTextEncoder(cfg["vocab"], cfg["dim"]),
                 "transformer": ToyTransformer(cfg["channels"], cfg["dim"], cfg["layers"]),
                 "decoder": ToyDecoder(cfg["channels"], cfg["scale"])}
        try:
            state = torch.load(Path(path) / WEIGHTS_NAME, map_location="cpu", weights_only=True)
            for name, module in comps.items():
                module.load_state_dict(state[name])
        except (OSError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{Path(path) / WEIGHTS_NAME}: {exc}") from None
        comps = {n: m.to(device=device, dtype=dtype).eval() for n, m in comps.items()}
        return LoadedModel(family=self.name, path=Path(path), components=comps, config=cfg, device=device, dtype=dtype)

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        text = {"prompt_embeds": Embeddings, "negative_embeds": Embeddings}
        return PipelineSpec(family=self.name, task=task, outputs={"video": "video", "latents": "latents"}, nodes=(
            Node("text_encode", EncodeText(), writes=text, uses=("text_encoder",)),
            Node("denoise", Denoise(), reads=text, writes={"latents": Latents}, uses=("transformer",)),
            Node("decode", Decode(), reads={"latents": Latents}, writes={"video": VideoFrames}, uses=("decoder",))))

    def task_defaults(self, model: LoadedModel, task: TaskType) -> dict[str, Any]:
        return {"steps": 4, "guidance_scale": 3.0, "frames": 3, "height": 16, "width": 16, "fps": 8.0}

    def validate_request(self, model: LoadedModel, request: Any, limits: Any) -> list[str]:
        return []  # the core checked types, ranges and limits; nothing of this family's own


@hookimpl
def omniloop_register_families(register: Any) -> None:
    register(MinimalFamily())
