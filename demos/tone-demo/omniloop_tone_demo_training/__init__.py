"""Training code of the tone-demo checkpoint (see docs/tone-demo-recipe-and-measurements.md)."""
