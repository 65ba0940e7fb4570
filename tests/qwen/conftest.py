"""Fixtures for the Qwen family tests: tiny random Qwen2 / Qwen3 checkpoints (built once per
session, GQA: 4 query heads over 2 KV heads), runtimes over them, and transformers references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import omniloop_qwen.plugin as qwen_plugin
import omniloop_scheduler.plugin as scheduler_plugin
from omniloop.runtime import Runtime
from omniloop.testing import make_manager
from omniloop_qwen.tiny import build_tiny_checkpoint

PROMPTS = (
    "the quick brown fox",
    "hello",
    "write a short story about a cat who sails across the sea at night under the bright stars.",
    "0 1 2 3",
)


def qwen_manager() -> Any:
    """The Qwen family and the real schedulers (serial, step); nothing discovered."""
    return make_manager(("qwen", qwen_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_qwen(arch)`` → path of a tiny checkpoint of ``qwen2`` or ``qwen3``."""
    cache: dict[str, Path] = {}

    def get(arch: str = "qwen2") -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def qwen_runtime(tiny_qwen):
    """``qwen_runtime(arch, scheduler="serial", **deploy)`` → a CPU float32 runtime (cached per arguments)."""
    cache: dict[Any, Runtime] = {}

    def get(arch: str = "qwen2", scheduler: str = "serial", **deploy: Any) -> Runtime:
        key = (arch, scheduler, repr(sorted(deploy.items())))
        if key not in cache:
            cache[key] = Runtime.from_model(tiny_qwen(arch), manager=qwen_manager(), scheduler=scheduler, **deploy)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_qwen):
    """``hf_reference(arch, prompt_ids, max_new_tokens)`` → transformers ``generate(do_sample=False)`` new tokens."""
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}

    def run(arch: str, ids: list[int], max_new_tokens: int) -> list[int]:
        if arch not in models:
            models[arch] = AutoModelForCausalLM.from_pretrained(tiny_qwen(arch), dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            out = models[arch].generate(x, do_sample=False, max_new_tokens=max_new_tokens)
        return [int(t) for t in out[0, x.shape[1]:]]

    return run


def reason(prompt: str, max_tokens: int = 16, temperature: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"task": "reason", "inputs": [{"type": "text", "text": prompt}],
            "sampling": {"max_tokens": max_tokens, "temperature": temperature}, **extra}


@pytest.fixture
def req():
    """``req(prompt, max_tokens=16, temperature=0.0, **extra)`` → a reason request dict."""
    return reason


@pytest.fixture
def prompts() -> tuple[str, ...]:
    """Prompts of different lengths (1 to ~30 tokens)."""
    return PROMPTS


@pytest.fixture
def runtime_at():
    """``runtime_at(path, **deploy)`` → a fresh runtime over a checkpoint folder."""
    return lambda path, **deploy: Runtime.from_model(path, manager=qwen_manager(), **deploy)


@pytest.fixture
def run_interpreted_child():
    """Run a test file's ``*_interpreted`` tests in a fresh pytest process started with
    TRITON_INTERPRET=1 (Triton picks the interpreter when it is first imported, so it cannot be
    switched inside this process); they must all pass and none may skip."""

    def run(test_file: str) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", str(Path(test_file)), "-q", "-k", "interpreted and not child_process",
             "-p", "no:cacheprovider", "-W", "ignore"],
            env=env, capture_output=True, text=True, timeout=900, check=False,
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
        assert proc.returncode == 0, tail
        assert " passed" in tail and "skipped" not in tail and "deselected" in tail, tail

    return run
