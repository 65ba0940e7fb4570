"""Training, evaluation and installation of the flux-demo checkpoint (heavy imports inside)."""
