"""omniloop-wan-demo-training: how the wan-demo checkpoints shipped in ``omniloop-wan-demo`` were made.

``render`` (the synthetic clips and images), ``train_vae`` / ``train_dit`` / ``gpu_run`` (v1),
``v2`` (VAE, DiT, decoder fine-tune, distillation, evaluation, ``--ship``), ``train_causal``
(``wan-demo-causal``), ``distill``, ``reflow``, ``vae_decoder``, ``sampling``, ``ship`` and
``detector_check``. Run a step as ``python -m omniloop_wan_demo_training.<step>``; the GPU session
scripts are in ``demos/wan-demo/scripts/``. Nothing here is needed to run the demo.
"""
