"""Errors raised by policies.

:class:`PolicyError` is a policy built or used wrongly (an unknown option, a knob the bound policy
does not have, a few-step sampler asked for a different number of steps). A checkpoint scheduler
config that no sampler can honour raises :class:`SchedulerConfigError`, which is both a
``CheckpointError`` (the message names the file) and a ``PolicyError``.
"""

from __future__ import annotations

from omniloop.errors import CheckpointError, OmniloopError


class PolicyError(OmniloopError):
    """A policy was configured or called wrongly. The message names the policy."""


class SchedulerConfigError(CheckpointError, PolicyError):
    """A checkpoint's scheduler config is incompatible with the chosen sampler.

    Raised at load (``Sampler.from_config``), never during a step: an incompatible config must be a
    load-time error, not a black video.
    """
