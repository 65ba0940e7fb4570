"""Deploy ``options.noise_prefetch: true``: the next step's Brownian-tree noise, computed while the DiT runs.

diffusers' ``CosineDPMSolverMultistepScheduler`` draws each step's noise from a torchsde Brownian
tree (``BrownianTreeNoiseSampler(sigma, sigma_next)``): tens of milliseconds of Python per query
at Stable Audio Open's size (the tree bisects down to a tolerance of 1e-6, a fresh generator and a
``randn`` at every level), which is most of a compiled step on a GPU — and it depends only on the
request's seed and the step's two sigmas, not on the model's prediction. So, with the option,
after a step the family asks a worker thread for the next step's query (:class:`PrefetchedNoise`); the thread's
Python runs while the main thread launches the DiT and waits for it (waiting releases the GIL).
The scheduler's next ``step`` takes the result. The values are the tree's own — the same queries
in the same order — so the results are bit-for-bit those of diffusers' loop (the parity tests run
through this path). Each request's tree stays its own (one sampler per request's scheduler). Off by default: both
threads run Python, so the gain is the time the main thread spends waiting for the device (see
bench/stable_audio_gpu.py for what it measured).
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

#: torchsde's Brownian interval warns when a query falls outside its ``[t0, t1]``; diffusers'
#: scheduler builds the tree from the float32 sigmas' min/max and then queries the float64 values of
#: the same sigmas, which can lie one float32 ulp outside (``tb=500.00006 and t1=500.0``). The tree
#: answers those queries as diffusers' own pipeline does (the parity tests compare the values), so
#: the four lines a tone-demo run printed were noise to a user: ignored, for exactly these messages
#: from exactly that module.
warnings.filterwarnings("ignore", message=r"Should have t[ab](<=t1|>=t0) but got", category=UserWarning,
                        module=r"torchsde\._brownian\.brownian_interval")

_POOL: ThreadPoolExecutor | None = None
_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="omniloop-sa-noise")
        return _POOL


def _query(sampler: Any, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return sampler(sigma, sigma_next)  # type: ignore[no-any-return]


class PrefetchedNoise:
    """diffusers' noise sampler with one query computed ahead in a worker thread."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.pending: tuple[tuple[float, float], Future[torch.Tensor]] | None = None

    def prefetch(self, sigma: torch.Tensor, sigma_next: torch.Tensor) -> None:
        self.settle()
        self.pending = ((float(sigma), float(sigma_next)), _pool().submit(_query, self.sampler, sigma, sigma_next))

    def settle(self) -> tuple[tuple[float, float], torch.Tensor] | None:
        """Wait for a pending query (the tree is not used by two threads at once)."""
        if self.pending is None:
            return None
        key, fut = self.pending
        self.pending = None
        return key, fut.result()

    def __call__(self, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        done = self.settle()
        if done is not None and done[0] == (float(sigma), float(sigma_next)):
            return done[1]
        return self.sampler(sigma, sigma_next)  # type: ignore[no-any-return]


def prefetch_next(scheduler: Any) -> None:
    """After ``scheduler.step``: start the next step's noise query (none after the last step)."""
    sampler = getattr(scheduler, "noise_sampler", None)
    i = scheduler.step_index
    if sampler is None or i is None or i + 1 >= len(scheduler.sigmas):
        return
    if not isinstance(sampler, PrefetchedNoise):
        sampler = scheduler.noise_sampler = PrefetchedNoise(sampler)
    sampler.prefetch(scheduler.sigmas[i], scheduler.sigmas[i + 1])


__all__ = ["PrefetchedNoise", "prefetch_next"]
