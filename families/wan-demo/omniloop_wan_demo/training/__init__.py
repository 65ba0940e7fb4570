"""Training recipe of the demo checkpoint (GPU): train_vae, train_dit, gpu_run (a time-boxed session)."""
