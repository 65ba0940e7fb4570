"""Shared pieces of the demo recipe: vocabulary/tokenizer, model configs, text encoding exactly as
diffusers' ``WanPipeline`` does it, the training loop's learning-rate schedule, batch sampling and
optimizer step, pipeline assembly and checkpoint I/O.

Heavy imports (torch, diffusers, transformers) happen inside functions so that importing this
module stays cheap.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

from .render import COLORS, DIRECTIONS, SHAPES

# ------------------------------------------------------------------------------------------
# Vocabulary and tokenizer
# ------------------------------------------------------------------------------------------

SPECIAL = ["<pad>", "</s>", "<unk>"]
#: wan-demo v1's words, in v1's token-id order (v1's text encoder has exactly these 26 rows)
V1_WORDS = ["a", "an", "the", "moving", "to", "towards", "is", "shape", ".", ",",
            "red", "green", "blue", "yellow", "cyan", "magenta", "circle", "square", "triangle",
            "left", "right", "up", "down"]
#: words the data vocabulary added since v1 (e.g. ``star``) get ids after v1's, so a v1 text
#: encoder's embedding rows keep their meaning (:func:`grow_text_encoder`)
WORDS = V1_WORDS + [w for w in (*COLORS, *SHAPES, *DIRECTIONS) if w not in V1_WORDS]
VOCAB: list[str] = SPECIAL + WORDS
V1_VOCAB_SIZE = len(SPECIAL) + len(V1_WORDS)
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def build_tokenizer(save_dir: str | Path | None = None):
    """A word-level tokenizer over :data:`VOCAB` (lower-cased, whitespace/punctuation split,
    ``</s>`` appended), wrapped as a transformers fast tokenizer; saved when ``save_dir`` is set.

    It loads back with ``transformers.AutoTokenizer.from_pretrained(save_dir)``."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", EOS_ID)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
        padding_side="right",
    )
    if save_dir is not None:
        fast.save_pretrained(str(save_dir))
        _portable_tokenizer_class(Path(save_dir))
    return fast


def _portable_tokenizer_class(folder: Path) -> None:
    """Name the class ``PreTrainedTokenizerFast`` (transformers 4 and 5) rather than v5's
    ``TokenizersBackend``."""
    f = folder / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    f.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_tokenizer(path: str | Path | None = None):
    from transformers import AutoTokenizer

    from omniloop_wan_demo.checkpoint_path import tokenizer_dir

    return AutoTokenizer.from_pretrained(str(path or tokenizer_dir()))


# ------------------------------------------------------------------------------------------
# Model configs
# ------------------------------------------------------------------------------------------

TEXT_DIM = 64

VAE_CONFIG: dict[str, Any] = dict(
    base_dim=32,
    z_dim=16,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True, True],
    dropout=0.0,
    scale_factor_spatial=4,
    scale_factor_temporal=4,
    latents_mean=[0.0] * 16,
    latents_std=[1.0] * 16,
)

DIT_CONFIG: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=5,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    text_dim=TEXT_DIM,
    freq_dim=128,
    ffn_dim=640,
    num_layers=10,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=256,
)

TEXT_ENCODER_CONFIG: dict[str, Any] = dict(
    vocab_size=len(VOCAB),
    d_model=TEXT_DIM,
    d_kv=16,
    d_ff=256,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    use_cache=False,
    pad_token_id=PAD_ID,
    eos_token_id=EOS_ID,
    decoder_start_token_id=PAD_ID,
    tie_word_embeddings=False,
)

#: flow shift used both to sample training sigmas and in the shipped scheduler
FLOW_SHIFT = 3.0

#: defaults recorded next to the checkpoint (``omniloop_demo.json``) for families/CLIs
DEMO_DEFAULTS: dict[str, Any] = dict(height=64, width=64, frames=17, fps=8.0, steps=20, guidance_scale=5.0)

#: how wan-demo v2 samples by default (``training.v2`` writes it into the pipeline's ``omniloop.json``
#: defaults): the Wan family's ``flow-euler`` sampler with diffusers' ``stochastic_sampling`` (each
#: step predicts x0 and re-noises it with fresh noise from the request's generator), CFG 2, flow
#: shift 5. Chosen on 3 072 GPU clips (bench/results/adherence-wan-demo-v2-sde-gpu-2026-12-02.json):
#: duplicate objects 136 -> 9 against UniPC at CFG 3, shape 97.7 -> 99.0 %. ``few-step``'s options
#: are the schedule of the ``fast`` LoRA (issue 41): a request naming the sampler and the adapter
#: (``--adapter fast --steps 4 --guidance 1 --node-param denoise.sampler=few-step``) needs no timesteps
V2_SAMPLING: dict[str, Any] = dict(sampler="flow-euler",
                                   sampler_options={"flow-euler": {"stochastic_sampling": True},
                                                    "few-step": {"timesteps": [1000, 750, 500, 250], "grid_shift": 8.0}},
                                   guidance_scale=2.0, shift=5.0)


def build_vae(config: dict[str, Any] | None = None):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**(config or VAE_CONFIG))


def build_transformer(config: dict[str, Any] | None = None):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**(config or DIT_CONFIG))


def build_text_encoder(config: dict[str, Any] | None = None):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**(config or TEXT_ENCODER_CONFIG)))


def build_scheduler(kind: str = "unipc", shift: float = FLOW_SHIFT):
    if kind == "unipc":
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler(
            num_train_timesteps=1000,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=shift,
            solver_order=2,
            final_sigmas_type="zero",
        )
    if kind == "euler":
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    raise ValueError(f"unknown scheduler kind {kind!r}")


def param_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------
# Text encoding (mirrors WanPipeline._get_t5_prompt_embeds)
# ------------------------------------------------------------------------------------------


def tokenize(tokenizer, prompts: list[str]):
    """``(ids [B, L], mask [B, L])`` padded to the longest prompt (``""`` -> just ``</s>``)."""
    t = tokenizer(prompts, padding="longest", truncation=True, max_length=512, add_special_tokens=True,
                  return_attention_mask=True, return_tensors="pt")
    return t.input_ids, t.attention_mask


def encode_tokens(text_encoder, ids, mask, pad_to: int):
    """Embeddings ``[B, pad_to, D]``: the encoder's output on the real tokens, zeros after them,
    exactly as WanPipeline builds ``prompt_embeds`` (it zero-pads to ``max_sequence_length``)."""
    import torch

    emb = text_encoder(ids, mask).last_hidden_state
    emb = emb * mask[..., None].to(emb.dtype)
    if emb.shape[1] < pad_to:
        emb = torch.cat([emb, emb.new_zeros(emb.shape[0], pad_to - emb.shape[1], emb.shape[2])], dim=1)
    return emb[:, :pad_to]


# ------------------------------------------------------------------------------------------
# Training-loop pieces (train_dit and train_causal)
# ------------------------------------------------------------------------------------------


def schedule_lr(opt, lr: float, *, step: int, elapsed: float, budget_s: float, max_steps: int | None,
                warmup: int, decay_frac: float) -> None:
    """Set every param group's learning rate: linear warm-up over ``warmup`` steps, flat, then a
    linear decay over the last ``decay_frac`` of the run (floored at 0.1x). The run's progress is
    ``step / max_steps`` when a step count is set, else ``elapsed / budget_s``."""
    frac = elapsed / budget_s if max_steps is None else step / max_steps
    w = min(1.0, (step + 1) / warmup)
    dec = 1.0 if frac < 1 - decay_frac else max(0.1, (1 - frac) / decay_frac)
    for g in opt.param_groups:
        g["lr"] = lr * w * dec


def sample_batch(lat, pid, batch: int, *, uncond: int, cfg_drop: float, gen, device: str):
    """``(x0, prompt ids, pad_to)``: ``batch`` latents and their prompt ids drawn with replacement,
    each id replaced by ``uncond`` with probability ``cfg_drop``, and the text length to pad to
    (512 as the pipeline pads, half the time; else 8 to 64 tokens). Draws from ``gen`` in a fixed
    order, so a seeded run is reproducible."""
    import torch

    idx = torch.randint(0, lat.shape[0], (batch,), device=device, generator=gen)
    x0 = lat[idx]
    p = pid[idx]
    drop = torch.rand(batch, device=device, generator=gen) < cfg_drop
    p = torch.where(drop, torch.full_like(p, uncond), p)
    pad_to = 512 if torch.rand((), generator=gen, device=device).item() < 0.5 else int(
        torch.randint(8, 65, (), generator=gen, device=device).item())
    return x0, p, pad_to


def optimizer_step(opt, params, loss, ema, ema_step: int) -> None:
    """Backward ``loss``, clip the gradient norm of ``params`` to 1, step ``opt`` and update the EMA."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    ema.update(ema_step)


# ------------------------------------------------------------------------------------------
# Pipeline assembly and checkpoint I/O
# ------------------------------------------------------------------------------------------


def assemble_pipeline(vae, transformer, text_encoder, tokenizer, scheduler=None):
    from diffusers import WanPipeline

    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler or build_scheduler(),
    )


def save_pipeline(pipe, out_dir: str | Path, *, dtype: str = "float16", meta: dict[str, Any] | None = None) -> Path:
    """Save ``pipe`` in diffusers format with weights cast to ``dtype`` (the modules are copied;
    ``pipe`` is left as it was)."""
    import copy

    import torch

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    td = getattr(torch, dtype)
    comps = {}
    for name in ("vae", "transformer", "text_encoder"):
        m = copy.deepcopy(getattr(pipe, name)).to("cpu")
        # the text encoder is tiny: keep it fp32 (transformers would otherwise load it as saved)
        comps[name] = m.to(torch.float32 if name == "text_encoder" else td)
    p2 = assemble_pipeline(comps["vae"], comps["transformer"], comps["text_encoder"], pipe.tokenizer, pipe.scheduler)
    p2.save_pretrained(str(out_dir), safe_serialization=True)
    _portable_tokenizer_class(out_dir / "tokenizer")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    # read by the omniloop Wan family (request defaults) and by `omniloop eval adherence`
    info = {"variant": "wan-demo", "defaults": dict(DEMO_DEFAULTS), "training": dict(meta or {})}
    (out_dir / "omniloop.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_dir


def tar_dir(src: str | Path, dst: str | Path) -> Path:
    src, dst = Path(src), Path(dst)
    with tarfile.open(dst, "w") as tf:
        tf.add(src, arcname=src.name)
    return dst


def untar(src: str | Path, dst_parent: str | Path) -> None:
    with tarfile.open(src) as tf:
        tf.extractall(dst_parent)


def save_split(state: dict[str, Any], prefix: str | Path, *, max_bytes: int = 15 * 2**20) -> list[Path]:
    """Save a flat tensor dict as ``prefix-0.safetensors``, ``prefix-1...``, each under ``max_bytes``."""
    from safetensors.torch import save_file

    prefix = Path(prefix)
    files, cur, size = [], {}, 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if cur and size + n > max_bytes:
            files.append(cur)
            cur, size = {}, 0
        cur[k] = v.detach().to("cpu").contiguous()
        size += n
    if cur:
        files.append(cur)
    paths = []
    for i, part in enumerate(files):
        p = prefix.parent / f"{prefix.name}-{i}.safetensors"
        save_file(part, str(p))
        paths.append(p)
    return paths


def load_split(prefix: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    prefix = Path(prefix)
    state: dict[str, Any] = {}
    for p in sorted(prefix.parent.glob(f"{prefix.name}-*.safetensors")):
        state.update(load_file(str(p)))
    if not state:
        raise FileNotFoundError(f"no {prefix}-*.safetensors")
    return state


def grow_text_encoder(text_encoder, vocab_size: int | None = None):
    """``text_encoder`` with its (tied) token embedding grown to ``vocab_size`` rows (default
    ``len(VOCAB)``): existing rows unchanged, each new row the mean of the rows of the words of
    its kind (a new shape starts as the mean shape word). Returns a new ``UMT5EncoderModel``."""
    import torch

    vocab_size = vocab_size or len(VOCAB)
    old = text_encoder.get_input_embeddings().weight.detach()
    if old.shape[0] >= vocab_size:
        return text_encoder
    cfg = dict(TEXT_ENCODER_CONFIG, vocab_size=vocab_size)
    new = build_text_encoder(cfg)
    state = {k: v for k, v in text_encoder.state_dict().items() if v.shape == new.state_dict()[k].shape}
    new.load_state_dict(state, strict=False)
    emb = torch.empty(vocab_size, old.shape[1], dtype=old.dtype)
    emb[: old.shape[0]] = old
    for i in range(old.shape[0], vocab_size):
        word = VOCAB[i]
        kind = next((k for k in (COLORS, SHAPES, DIRECTIONS) if word in k), None)
        peers = [VOCAB.index(w) for w in (kind or ()) if w != word and VOCAB.index(w) < old.shape[0]]
        emb[i] = old[peers].mean(0) if peers else old.mean(0)
    new.set_input_embeddings(torch.nn.Embedding.from_pretrained(emb, freeze=False))
    new.encoder.embed_tokens = new.shared
    return new.to(old.device)
