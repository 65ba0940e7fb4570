"""omniloop-wan-demo: a small trained Wan-architecture checkpoint and a prompt-adherence evaluator.

Light on import: nothing heavy (torch, diffusers) is imported here.
"""

from .checkpoint_path import checkpoint_dir, tokenizer_dir

__all__ = ["checkpoint_dir", "tokenizer_dir"]
__version__ = "0.1.0"
