"""Every standard observer passes the core's observer conformance check (read-only, runs complete)."""

from __future__ import annotations

import pytest

from omniloop.testing.conformance import check_observer


def _parity():
    from omniloop_parity import ParityConfig, ParityRecorder

    return ParityRecorder(ParityConfig(blocks=r"blocks\.\d+$"))


def _profiler():
    from omniloop_profiler import ProfilerConfig, make_profiler

    return make_profiler(ProfilerConfig(blocks=r"blocks\.\d+$"))


def _nanwatch():
    from omniloop_nanwatch import NanWatch, NanWatchConfig

    return NanWatch(NanWatchConfig(blocks=r"blocks\.\d+$"))


def _trace(path):
    from omniloop_trace import ActivationTrace, TraceConfig

    return lambda: ActivationTrace(TraceConfig(path=str(path), blocks=r"blocks\.\d+$"))


@pytest.mark.parametrize("name", ["parity", "profiler", "nanwatch", "trace"])
def test_observer_is_read_only(name, tmp_path):
    factory = {"parity": _parity, "profiler": _profiler, "nanwatch": _nanwatch, "trace": _trace(tmp_path / "t.jsonl")}
    check_observer(factory[name])
