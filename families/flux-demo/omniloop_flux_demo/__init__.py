"""omniloop-flux-demo: a tiny trained FLUX-architecture image checkpoint (``flux-demo`` preset).

Light on import: nothing heavy (torch, diffusers) is imported here.
"""

from .checkpoint_path import checkpoint_dir, checkpoint_missing

__all__ = ["checkpoint_dir", "checkpoint_missing"]
__version__ = "0.1.0"
