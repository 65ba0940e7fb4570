"""omniloop-flux-demo-training: how the flux-demo checkpoint shipped in ``omniloop-flux-demo`` was made.

``model`` (the tiny FLUX.1 pipeline), ``train`` (VAE and transformer on ``omniloop_wan_demo_training.render``'s
images), ``evaluate`` (adherence during training), ``gpu_run`` (one time-boxed session), ``ship``
(install weights into ``omniloop_flux_demo/checkpoint/``). Run a step as
``python -m omniloop_flux_demo_training.<step>``; the GPU session script is
``demos/flux-demo/scripts/gpu_session.sh``. Nothing here is needed to run the demo (heavy imports
inside the modules).
"""
