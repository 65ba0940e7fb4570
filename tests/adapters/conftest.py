"""Fixtures for the LoRA adapter tests: tiny checkpoints and random adapters written by diffusers.

Every adapter file here is written by diffusers' own LoRA saving path: a PEFT ``LoraConfig`` added
to the diffusers transformer (``add_adapter``, random ``lora_B`` via ``init_lora_weights=False``),
``get_peft_model_state_dict``, then the pipeline class's ``save_lora_weights`` — with the config as
``transformer_lora_adapter_metadata`` (alpha != rank) or without (alpha = rank, scale 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.testing import torch_threads

pytest.importorskip("diffusers")
pytest.importorskip("peft")


def write_lora(pipeline_cls: Any, transformer_cls: Any, transformer_dir: Path, out: Path, *, rank: int,
               alpha: int | None, targets: list[str], seed: int, as_file: str | None = None) -> Path:
    """Write a random LoRA for the transformer at ``transformer_dir`` with diffusers; returns its path."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tf = transformer_cls.from_pretrained(transformer_dir)
        cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=targets,
                         init_lora_weights=False)
        tf.add_adapter(cfg, adapter_name="x")
        with torch.no_grad():  # large enough to move the output visibly
            for name, p in tf.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.3)
        sd = get_peft_model_state_dict(tf, adapter_name="x")
    meta = cfg.to_dict() if alpha is not None else None
    pipeline_cls.save_lora_weights(out, transformer_lora_layers=sd, transformer_lora_adapter_metadata=meta,
                                   weight_name=as_file)
    return out / as_file if as_file else out


def _diffusers_runs(pipe: Any, setup: dict[str, Path], run: Any, sets: dict[str, tuple[list[str], list[float]]]
                    ) -> dict[str, torch.Tensor]:
    out = {"none": run()}
    pipe.load_lora_weights(setup["a"], adapter_name="a")
    pipe.load_lora_weights(setup["b"], adapter_name="b")
    for key, (names, weights) in sets.items():
        pipe.set_adapters(names, weights)
        out[key] = run()
    return out


@pytest.fixture(scope="session")
def diffusers_runs() -> Any:
    """``diffusers_runs(pipe, setup, run, {key: (adapter names, weights)})`` → the reference outputs:
    ``run()`` with no adapter (key ``"none"``), then with ``setup``'s adapters ``a`` and ``b`` loaded
    (``load_lora_weights``) and each set active in turn (``set_adapters(names, weights)``)."""
    return _diffusers_runs


@pytest.fixture(scope="session")
def wan_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Wan2.1 T2V checkpoint and two adapters: ``a`` (folder; rank 4, alpha 8, attention and
    FFN linears) and ``b`` (a .safetensors file; rank 2, no metadata: alpha = rank, q/v only)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from omniloop_wan.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("wan-lora")
    ckpt = build_tiny_checkpoint(root / "ckpt", variant="t2v", scheduler="flow_euler")
    a = write_lora(WanPipeline, WanTransformer3DModel, ckpt / "transformer", root / "a", rank=4, alpha=8,
                   targets=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"], seed=1)
    b = write_lora(WanPipeline, WanTransformer3DModel, ckpt / "transformer", root / "b", rank=2, alpha=None,
                   targets=["to_q", "to_v"], seed=2, as_file="b.safetensors")
    return {"ckpt": ckpt, "a": a, "b": b, "root": root}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def flux_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny FLUX.1 [dev] checkpoint and two adapters written by ``FluxPipeline.save_lora_weights``:
    ``a`` (rank 4, alpha 2: attention of both block kinds, FFNs, single blocks' proj_mlp/proj_out, and
    the top-level context_embedder / x_embedder / proj_out)
    and ``b`` (rank 2, no metadata, q/k/v only); ``c`` (rank 2, the blocks' AdaLN modulation linears)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from omniloop_flux.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("flux-lora")
    ckpt = build_tiny_checkpoint(root / "ckpt", variant="dev")
    a = write_lora(FluxPipeline, FluxTransformer2DModel, ckpt / "transformer", root / "a", rank=4, alpha=2,
                   targets=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "net.0.proj", "net.2",
                            "proj_mlp", "proj_out", "context_embedder", "x_embedder"], seed=3)
    b = write_lora(FluxPipeline, FluxTransformer2DModel, ckpt / "transformer", root / "b", rank=2, alpha=None,
                   targets=["to_q", "to_k", "to_v"], seed=4, as_file="b.safetensors")
    c = write_lora(FluxPipeline, FluxTransformer2DModel, ckpt / "transformer", root / "c", rank=2, alpha=None,
                   targets=["norm1.linear", "norm1_context.linear", "norm.linear"], seed=6)
    return {"ckpt": ckpt, "a": a, "b": b, "c": c, "root": root}


@pytest.fixture(scope="session")
def sd3_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny SD3.5-medium checkpoint (with T5) and two adapters written by
    ``StableDiffusion3Pipeline.save_lora_weights``."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from omniloop_sd3.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("sd3-lora")
    ckpt = build_tiny_checkpoint(root / "ckpt")
    a = write_lora(StableDiffusion3Pipeline, SD3Transformer2DModel, ckpt / "transformer", root / "a", rank=4, alpha=8,
                   targets=["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "net.0.proj", "net.2"], seed=5)
    b = write_lora(StableDiffusion3Pipeline, SD3Transformer2DModel, ckpt / "transformer", root / "b", rank=2, alpha=None,
                   targets=["to_q", "to_v"], seed=6, as_file="b.safetensors")
    return {"ckpt": ckpt, "a": a, "b": b, "root": root}
