"""Triton kernels defined on first use (omniloop-kit).

A module that ships a ``@triton.jit`` kernel should not import ``triton`` when it is imported (a CPU
deployment, the CLI's start-up), and the kernel must exist before ``torch.compile`` traces a call to
it: dynamo traces the launch of an existing kernel, not Triton's own set-up. :class:`LazyKernel`
holds the definition; the family calls :meth:`LazyKernel.get` at install (outside any trace) and the
call sites call it again, which inside a trace is an attribute read::

    def _define():
        import triton
        import triton.language as tl

        @triton.jit
        def my_kernel(...): ...

        return my_kernel

    KERNEL = LazyKernel(_define)
    KERNEL.get()[(rows,)](x, out, ...)

Used by omniloop-kit's ``qk_norm_rope`` and Wan's fused q/k norm + rotary kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LazyKernel:
    """A kernel made by ``define()`` (which imports triton) the first time :meth:`get` runs."""

    def __init__(self, define: Callable[[], Any]) -> None:
        self._define = define
        #: the kernel once defined, else None
        self.kernel: Any = None

    def get(self) -> Any:
        """The kernel, defined now if it is not yet (call this at install, outside compiled code)."""
        if self.kernel is None:
            self.kernel = self._define()
        return self.kernel


__all__ = ["LazyKernel"]
