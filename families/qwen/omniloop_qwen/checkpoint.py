"""Checkpoint validation and loading for transformers-format Qwen2 / Qwen2.5 / Qwen3 causal LMs.

:func:`validate_checkpoint` reads only small files (JSON, safetensors headers) and raises one
:class:`~omniloop.errors.CheckpointError` naming the file at the first problem: a missing or
malformed ``config.json``, an unsupported ``model_type`` or attention layout, missing weight
shards or tensors, tensor shapes that disagree with the config, missing tokenizer files, a
malformed ``generation_config.json``. Only then :func:`load_checkpoint` loads weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from attrs import define

from omniloop.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@define(frozen=True)
class CheckpointInfo:
    """What validation learned: the parsed config, weight files and generation defaults."""

    path: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]
    eos_token_ids: tuple[int, ...]
    generation: dict[str, Any]

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])

    @property
    def max_positions(self) -> int:
        return int(self.config.get("max_position_embeddings") or 32768)


def _read_json(f: Path, what: str) -> Any:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{f}: malformed JSON: {exc}") from None


def looks_like_qwen(path: Path) -> bool:
    """Cheap detection: a ``config.json`` of a supported model type for causal LM."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") in SUPPORTED_MODEL_TYPES


def validate_checkpoint(path: Path) -> CheckpointInfo:
    """Check every file a load needs, without loading weights; raise CheckpointError naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a transformers-format checkpoint folder is expected)")
    cfg_file = path / "config.json"
    cfg = _read_json(cfg_file, "the model config")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{cfg_file}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for key in _REQUIRED_INTS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"{cfg_file}: {key} must be a positive integer, got {v!r}")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
        raise CheckpointError(f"{cfg_file}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv!r})")
    archs = cfg.get("architectures") or []
    if archs and not any(str(a).endswith("ForCausalLM") for a in archs):
        raise CheckpointError(f"{cfg_file}: architectures {archs} has no *ForCausalLM (only causal LMs are supported)")
    if cfg.get("use_sliding_window"):
        raise CheckpointError(f"{cfg_file}: use_sliding_window=true is not supported by the paged decode loop yet")
    if "sliding_attention" in (cfg.get("layer_types") or []):
        raise CheckpointError(f"{cfg_file}: sliding-window layers are not supported by the paged decode loop yet")
    info_weights = _weight_files(path)
    _check_tensors(cfg_file, cfg, info_weights)
    _check_tokenizer(path)
    gen: dict[str, Any] = {}
    gen_file = path / "generation_config.json"
    if gen_file.exists():
        gen = _read_json(gen_file, "generation defaults")
        if not isinstance(gen, dict):
            raise CheckpointError(f"{gen_file}: expected a JSON object")
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    where = gen_file if "eos_token_id" in gen else cfg_file
    for e in eos_ids:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < cfg["vocab_size"]:
            raise CheckpointError(f"{where}: eos_token_id {eos!r} is not a token id below vocab_size {cfg['vocab_size']}")
    return CheckpointInfo(path=path, config=cfg, weight_files=info_weights, eos_token_ids=tuple(eos_ids), generation=gen)


def _weight_files(path: Path) -> tuple[Path, ...]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return (single,)
    if index.is_file():
        idx = _read_json(index, "the shard index")
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: no weight_map")
        shards = []
        for name in sorted(set(wm.values())):
            shard = path / str(name)
            if Path(str(name)).name != str(name) or not shard.is_file():
                raise CheckpointError(f"{shard}: missing weight shard (listed in {index.name})")
            shards.append(shard)
        return tuple(shards)
    raise CheckpointError(f"{single}: missing weights (no model.safetensors or model.safetensors.index.json)")


def _check_tensors(cfg_file: Path, cfg: dict[str, Any], files: tuple[Path, ...]) -> None:
    from safetensors import safe_open

    shapes: dict[str, tuple[list[int], Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    shapes[k] = (list(sf.get_slice(k).get_shape()), f)
        except Exception as exc:
            raise CheckpointError(f"{f}: cannot read safetensors header: {exc}") from None
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or hidden // heads
    want = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    if not cfg.get("tie_word_embeddings", False):
        want["lm_head.weight"] = [vocab, hidden]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want[p + "self_attn.q_proj.weight"] = [heads * hd, hidden]
        want[p + "self_attn.k_proj.weight"] = [kv * hd, hidden]
        want[p + "self_attn.v_proj.weight"] = [kv * hd, hidden]
        want[p + "self_attn.o_proj.weight"] = [hidden, heads * hd]
        want[p + "mlp.gate_proj.weight"] = [cfg["intermediate_size"], hidden]
        if cfg["model_type"] == "qwen3":
            want[p + "self_attn.q_norm.weight"] = [hd]
            want[p + "self_attn.k_norm.weight"] = [hd]
    where = files[0] if len(files) == 1 else files[0].parent / "model.safetensors.index.json"
    for name, shape in want.items():
        got = shapes.get(name)
        if got is None:
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        if got[0] != shape:
            raise CheckpointError(f"{got[1]}: tensor {name!r} has shape {got[0]}, {cfg_file.name} implies {shape}")


def _check_tokenizer(path: Path) -> None:
    tj = path / "tokenizer.json"
    if tj.exists():
        _read_json(tj, "the tokenizer")
    elif not ((path / "vocab.json").is_file() and (path / "merges.txt").is_file()):
        raise CheckpointError(f"{tj}: missing tokenizer (no tokenizer.json, nor vocab.json + merges.txt)")
    tc = path / "tokenizer_config.json"
    if tc.exists() and not isinstance(_read_json(tc, "the tokenizer config"), dict):
        raise CheckpointError(f"{tc}: expected a JSON object")


def load_tokenizer(info: CheckpointInfo) -> Any:
    """The checkpoint's tokenizer (transformers ``AutoTokenizer``, offline)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(info.path), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{info.path / 'tokenizer.json'}: cannot load the tokenizer: {type(exc).__name__}: {exc}") from None


def load_checkpoint(info: CheckpointInfo, *, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load (tokenizer, transformers model) from a validated checkpoint, offline."""
    import transformers

    tokenizer = load_tokenizer(info)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(info.path), dtype=dtype, local_files_only=True, attn_implementation="sdpa",
        )
    except Exception as exc:
        raise CheckpointError(f"{info.weight_files[0]}: cannot load the weights: {type(exc).__name__}: {exc}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    return tokenizer, model
