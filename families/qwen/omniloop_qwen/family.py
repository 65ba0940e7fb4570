"""The Qwen family: task ``reason`` on Qwen2 / Qwen2.5 / Qwen3 causal-LM checkpoints.

Deploy options (``options:`` in the deploy file, all optional):

* ``kv_cache_tokens`` — tokens the KV pool holds (default: what 1 GiB holds, at most 131072);
* ``kv_cache_gib`` — the KV pool's byte budget instead (one of the two);
* ``kv_block_size`` — tokens per KV block (default 16);
* ``prefill_chunk`` — prompt tokens per prefill step (default 512): a long prompt is prefilled
  over several steps so it does not stall the decode steps of other sequences;
* ``max_tokens`` — new tokens when a request leaves ``sampling.max_tokens`` unset (default:
  ``generation_config.json``'s ``max_new_tokens``, else 256);
* ``paged_attention`` — ``auto`` (default: the Triton kernel on CUDA when ``triton`` imports, else
  the torch path), ``torch`` or ``triton`` (refused at load where it cannot run); see
  :mod:`omniloop_qwen.paged_attention`;
* ``decode_cuda_graphs`` — ``true``: decode steps replay CUDA graphs (needs CUDA and the triton
  backend; default ``false``); see :class:`omniloop_qwen.model.DecodeGraphs`;
* ``decode_fused`` — decode steps run the fused kernels of :mod:`omniloop_qwen.fused` (~11
  launches per layer instead of ~45; needs the triton backend). ``auto`` (default): on exactly when
  ``decode_cuda_graphs`` is on (the combination measured on the H200: 14.2x faster than a 1k-token
  re-prefill at batch 1, vs 6.2x for the unfused graphs); ``false`` opts out; ``true`` also runs
  it without graphs (eager fused step).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Conditioning, Text
from omniloop.capabilities import FamilyCapabilities
from omniloop.errors import DeployError
from omniloop.family import LoadedModel
from omniloop.graph import Node, PipelineSpec
from omniloop.request import OmniRequest, TaskType
from omniloop_kvcache import CacheManager, KVLayout

from . import FAMILY_NAME
from .checkpoint import CheckpointInfo, load_checkpoint, load_tokenizer, looks_like_qwen, validate_checkpoint
from .model import PagedQwen
from .paged_attention import BACKENDS, resolve_backend
from .stages import Decode, DecodeParams, Prompt, ReasonResolved, resolve_reason

GIB = 1024**3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_TOKENS = 256
_INT_OPTIONS = ("kv_cache_tokens", "kv_block_size", "prefill_chunk", "max_tokens")


def _int_option(options: dict[str, Any], name: str, default: int | None) -> int | None:
    v = options.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise DeployError(f"options.{name}: must be a positive integer, got {v!r}")
    return v


def resolve_fused(value: bool | str, *, graphs: bool) -> bool:
    """``options.decode_fused`` as it runs: ``auto`` is on exactly when the decode steps replay CUDA
    graphs (which already needs CUDA and the triton backend); ``true`` / ``false`` as given."""
    return graphs if value == "auto" else bool(value)


class QwenFamily:
    name = FAMILY_NAME
    tasks = frozenset({TaskType.REASON})
    #: text in, text out (streamed as it decodes): no block interceptors, no latents
    capabilities = FamilyCapabilities(streams_partial=True, inspect=True, resolve=True)

    def detect(self, path: Path) -> bool:
        return looks_like_qwen(Path(path))

    def _resolve(self, path: Path, options: dict[str, Any], dtype: torch.dtype) -> tuple[CheckpointInfo, dict[str, Any]]:
        """Validate the deploy options and the checkpoint's files; the model config (no weights read)."""
        opts = {n: _int_option(options, n, None) for n in _INT_OPTIONS}
        gib = options.get("kv_cache_gib")
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0):
            raise DeployError(f"options.kv_cache_gib: must be a positive number, got {gib!r}")
        if gib is not None and opts["kv_cache_tokens"] is not None:
            raise DeployError("options: give kv_cache_tokens or kv_cache_gib, not both")
        attention = options.get("paged_attention", "auto")
        if attention not in BACKENDS:
            raise DeployError(f"options.paged_attention: must be one of {', '.join(BACKENDS)}, got {attention!r}")
        graphs = options.get("decode_cuda_graphs", False)
        if not isinstance(graphs, bool):
            raise DeployError(f"options.decode_cuda_graphs: must be true or false, got {graphs!r}")
        fused = options.get("decode_fused", "auto")
        if not isinstance(fused, bool) and fused != "auto":
            raise DeployError(f"options.decode_fused: must be true, false or 'auto', got {fused!r}")
        info = validate_checkpoint(Path(path))  # every file checked before any weight loads
        layout = KVLayout(layers=int(info.config["num_hidden_layers"]), kv_heads=info.kv_heads, head_dim=info.head_dim,
                          dtype=dtype)
        block = opts["kv_block_size"] or 16
        if gib is not None:
            blocks = int(gib * GIB) // (layout.bytes_per_token * block)
            if blocks < 1:
                raise DeployError(f"options.kv_cache_gib: {gib} GiB holds no KV block of {block} tokens")
        else:
            tokens = opts["kv_cache_tokens"] or min(131072, GIB // layout.bytes_per_token)
            blocks = -(-tokens // block)
        gen_max = info.generation.get("max_new_tokens")
        max_tokens = opts["max_tokens"] or (gen_max if isinstance(gen_max, int) and gen_max > 0 else DEFAULT_MAX_TOKENS)
        config = {
            "model_type": info.model_type, "max_positions": info.max_positions, "eos_token_ids": list(info.eos_token_ids),
            "max_tokens": max_tokens, "prefill_chunk": opts["prefill_chunk"] or 512,
            "kv_cache": {"block_size": block, "num_blocks": blocks, "bytes_per_block": layout.bytes_per_token * block},
            "tasks": [TaskType.REASON.value], "paged_attention": attention, "decode_cuda_graphs": graphs,
            "decode_fused": fused,
        }
        return info, config

    def inspect(self, path: Path, *, options: dict[str, Any]) -> LoadedModel:
        """The checkpoint validated from its config files and safetensors headers, with its tokenizer
        (no weights): the runtime's weight-free request checks run ``validate_request`` on it."""
        dtype = _DTYPES.get(getattr(options.get("deploy"), "dtype", "float32"), torch.float32)
        info, config = self._resolve(Path(path), options, dtype)
        return LoadedModel(
            family=self.name, path=Path(path), components={"tokenizer": load_tokenizer(info)}, config=config,
            dtype=dtype, tasks=frozenset({TaskType.REASON}), defaults={TaskType.REASON: {"max_tokens": config["max_tokens"]}},
        )

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        info, config = self._resolve(Path(path), options, dtype)
        try:  # the backend that runs: 'auto' resolved for this device (before any weight loads)
            config["paged_attention"] = resolve_backend(config["paged_attention"], device)
        except ValueError as exc:
            raise DeployError(f"options.paged_attention: {exc}") from None
        if config["decode_cuda_graphs"] and (config["paged_attention"] != "triton" or torch.device(device).type != "cuda"):
            raise DeployError(f"options.decode_cuda_graphs: needs a CUDA device and paged_attention triton "
                              f"(device {str(device)!r}, paged_attention {config['paged_attention']!r})")
        config["decode_fused"] = resolve_fused(config["decode_fused"], graphs=config["decode_cuda_graphs"])
        if config["decode_fused"] and config["paged_attention"] != "triton":
            raise DeployError(f"options.decode_fused: needs paged_attention triton (paged_attention {config['paged_attention']!r})")
        tokenizer, hf = load_checkpoint(info, device=device, dtype=dtype)
        paged = PagedQwen(hf, attention=config["paged_attention"], cuda_graphs=config["decode_cuda_graphs"],
                          fused=config["decode_fused"])
        kv = config["kv_cache"]
        cache = CacheManager(paged.layout(), block_size=kv["block_size"], num_blocks=kv["num_blocks"], name="text-kv")
        return LoadedModel(
            family=self.name, path=Path(path), components={"model": hf, "paged": paged, "tokenizer": tokenizer, "kv_cache": cache},
            config=config, device=device, dtype=dtype, tasks=frozenset({TaskType.REASON}),
            defaults={TaskType.REASON: {"max_tokens": config["max_tokens"]}},
        )

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        c = model.config
        decode = Decode(eos=c["eos_token_ids"], max_tokens=c["max_tokens"], max_positions=c["max_positions"],
                        prefill_chunk=c["prefill_chunk"], cache=model.components.get("kv_cache"),
                        tokenizer=model.components.get("tokenizer"))
        return PipelineSpec(
            family=self.name, task=task,
            nodes=(
                Node("prompt", Prompt(), writes={"prompt_ids": Conditioning}, uses=("tokenizer",)),
                Node("decode", decode, reads={"prompt_ids": Conditioning}, writes={"text": Text}, emits={"text": Text},
                     params_schema=DecodeParams, uses=("model", "kv_cache")),
            ),
            outputs={"text": "text"},
        )

    def resolve(self, model: LoadedModel, request: OmniRequest, limits: Any, *,
                node_params: Any = None) -> ReasonResolved:
        """The request resolved once — tokenized, sizes, sampling values, stop strings and the KV
        budget checked — before any compute (``Runtime.prepare``; on an inspected model too)."""
        params = (node_params or {}).get("decode")
        return resolve_reason(model.components["tokenizer"], model.config, request, params)

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        """The warnings of :meth:`resolve`."""
        return list(self.resolve(model, request, limits).warnings)


def checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Validate a checkpoint folder without loading it (for tools and tests)."""
    return validate_checkpoint(Path(path))
