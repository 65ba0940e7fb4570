"""The flux-demo architecture: configs, word-level tokenizers, component construction and the
diffusers ``FluxPipeline`` folder layout.

A FLUX.1 [schnell]-style checkpoint (no guidance embedding; constant shift) at toy size:

* ``vae``: ``AutoencoderKL``, block_out_channels (32, 64, 64) -> 4x spatial downsampling,
  8 latent channels (a 64x64 image is an 8x16x16 latent, 64 packed tokens of 32 values);
* ``transformer``: ``FluxTransformer2DModel``, 2 double-stream + 6 single-stream blocks,
  4 heads x 32 (width 128), rope axes (8, 12, 12), T5 width 64, CLIP width 64;
* ``text_encoder`` / ``text_encoder_2``: ``CLIPTextModel`` / ``T5EncoderModel``, 2 layers,
  width 64, trained jointly with the transformer;
* ``tokenizer`` / ``tokenizer_2``: word-level ``PreTrainedTokenizerFast`` over the demo
  vocabulary, built here with ``tokenizers`` (CLIP: ``<|startoftext|> ... <|endoftext|>``, padded
  with ``<pad>`` to 16; T5: ``... </s>``, padded to the request's ``max_sequence_length``, 16 by
  default in ``omniloop.json``);
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler``, shift 1.0, no dynamic shifting.

Heavy imports happen inside functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: text length the model is trained with (T5 padding; CLIP's model_max_length)
TEXT_LEN = 16
SIZE = 64
LATENT_CHANNELS = 8
SHIFT = 1.0

VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
    up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[32, 64, 64], layers_per_block=1,
    latent_channels=LATENT_CHANNELS, norm_num_groups=16, sample_size=SIZE, scaling_factor=1.0,
    shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
)
TEXT_DIM = 64
TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=6, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM, guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
    "num_train_timesteps": 1000, "shift": SHIFT, "use_dynamic_shifting": False,
}
#: smoke-run sizes (CPU, seconds)
SMOKE_TRANSFORMER: dict[str, Any] = dict(num_layers=1, num_single_layers=1, num_attention_heads=2)
SMOKE_VAE: dict[str, Any] = dict(block_out_channels=[16, 16, 16], norm_num_groups=8)

CLIP_SPECIAL = ["<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>"]
T5_SPECIAL = ["<pad>", "</s>", "<unk>"]


def vocabulary() -> list[str]:
    """The prompt words (``omniloop_wan_demo.prompts.vocabulary_words("image")``)."""
    from omniloop_wan_demo.prompts import vocabulary_words

    return list(vocabulary_words("image"))


def build_tokenizer(kind: str, save_dir: str | Path | None = None) -> Any:
    """A word-level fast tokenizer over :func:`vocabulary` (lower-cased, punctuation dropped,
    whitespace split; unknown words -> ``<unk>``). ``kind``: ``"clip"`` (BOS/EOS around the words,
    ``model_max_length`` :data:`TEXT_LEN`) or ``"t5"`` (EOS appended)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    if kind not in ("clip", "t5"):
        raise ValueError(f"tokenizer kind must be 'clip' or 't5', got {kind!r}")
    special = CLIP_SPECIAL if kind == "clip" else T5_SPECIAL
    vocab = {w: i for i, w in enumerate([*special, *vocabulary()])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    # punctuation is a word separator ("top-left", "star,"), as in the prompt parser of wan-demo's data
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                           normalizers.Replace(Regex(r"[^a-z0-9\s]"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "clip":
        bos, eos = "<|startoftext|>", "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token=bos, eos_token=eos,
                                       unk_token="<unk>", model_max_length=TEXT_LEN, padding_side="right")
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                       model_max_length=512, padding_side="right")
    if save_dir is not None:
        fast.save_pretrained(str(save_dir))
        cfg_path = Path(save_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5 alike
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return fast


def build_components(seed: int = 0, *, smoke: bool = False) -> dict[str, Any]:
    """Fresh (random) modules and tokenizers, deterministic in ``seed``; the global RNG is left alone."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = build_tokenizer("clip"), build_tokenizer("t5")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=TEXT_DIM, intermediate_size=4 * TEXT_DIM, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=TEXT_LEN, projection_dim=TEXT_DIM, hidden_act="gelu",
            pad_token_id=clip_tok.pad_token_id, bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
        ))
        t5 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=TEXT_DIM, d_kv=16, d_ff=4 * TEXT_DIM, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=TEXT_LEN, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=0,
        ))
        vae = AutoencoderKL(**{**VAE_CONFIG, **(SMOKE_VAE if smoke else {})})
        tf = FluxTransformer2DModel(**{**TRANSFORMER_CONFIG, **(SMOKE_TRANSFORMER if smoke else {})})
    sched = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG)
    return {"vae": vae, "transformer": tf, "text_encoder": clip, "text_encoder_2": t5,
            "tokenizer": clip_tok, "tokenizer_2": t5_tok, "scheduler": sched}


def save_pipeline(comps: dict[str, Any], out: str | Path, *, omniloop_json: dict[str, Any], fp16: bool = True) -> Path:
    """Write ``comps`` as a diffusers ``FluxPipeline`` folder (transformer + VAE in fp16 when
    ``fp16``; text encoders fp32) with ``omniloop.json``; returns the folder."""
    import copy

    import diffusers
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        m = copy.deepcopy(comps[name]).to("cpu").eval()
        if fp16 and name in ("transformer", "vae"):
            m = m.to(torch.float16)
        m.save_pretrained(out / name)
    build_tokenizer("clip", out / "tokenizer")
    build_tokenizer("t5", out / "tokenizer_2")
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": diffusers.__version__, **SCHEDULER_CONFIG},
        indent=2))
    from omniloop_flux.tiny import MODEL_INDEX

    # FLUX's components, the two tokenizers saved as plain ``tokenizers`` files
    index = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__, **MODEL_INDEX,
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    (out / "omniloop.json").write_text(json.dumps(omniloop_json, indent=2, sort_keys=True))
    return out


def count_params(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())
