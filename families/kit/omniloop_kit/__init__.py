"""omniloop-kit: shared machinery for diffusers-format denoiser families (a library, no plugin).

* :mod:`omniloop_kit.policies` — the denoise node's policy menu from the deploy's ``policies:``
  (validated by the :class:`~omniloop_kit.policies.DeployPolicies` schema).
* :mod:`omniloop_kit.stages` — stage helpers (image artifact, devices, params, latents return).
* :mod:`omniloop_kit.inputs` — image parts and token counts a resolve reads.
* :mod:`omniloop_kit.options` — shared family options (dtypes).
* :mod:`omniloop_kit.lazy` — a family package's lazy exports.
* :mod:`omniloop_kit.tiny` — tiny-checkpoint builders (a T5 tokenizer, ``omniloop.json``).
* :mod:`omniloop_kit.progress` — the demo families' ``eval`` progress bar over clips (needs ``rich``).
* :mod:`omniloop_kit.loading` — a pipeline folder's components loaded by the classes ``model_index.json`` names.
* :mod:`omniloop_kit.attention`, :mod:`omniloop_kit.parallel`, :mod:`omniloop_kit.textcache`,
  :mod:`omniloop_kit.ffn`, :mod:`omniloop_kit.causal` — mechanisms a family switches on: the attention
  backend in its attention modules, CFG/sequence-parallel steps, a text-embedding cache, the fused
  GELU projection, a causal chunk-by-chunk rollout (Wan uses them all); the attention module's joint
  (MMDiT) processor and ``options.qkv`` are FLUX.1's and SD3's.
* :mod:`omniloop_kit.lora` — LoRA files in kohya / ComfyUI layouts converted to diffusers' keys
  (FLUX.1, Wan).
* :mod:`omniloop_kit.presets` — a shipped preset's checkpoint folder, or one clear ``DeployError``.
* :mod:`omniloop_kit.blocks` — a family's own block forwards put in place of diffusers' blocks, sharing
  their modules (FLUX.1's and Wan's ``blocks`` modules).

Importing the package imports nothing heavy (no torch).
"""
