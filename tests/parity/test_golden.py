"""Goldens: the toy family and the tiny Wan checkpoint are pinned by committed recordings.

A golden replays bit for bit on a CPU with the fingerprint it was recorded with, and within a
stated float32 round-off tolerance on any other x86-64 CPU (see ``replay_golden`` below and
:mod:`omniloop.testing.goldens`). Rewrite them after an intended numerical change with
``OMNILOOP_PARITY_REGEN=1 pytest tests/parity/test_golden.py`` (this stamps the CPU fingerprint
into each file) and say why in the commit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from omniloop.schema import request_from_dict
from omniloop.testing import goldens, toy_runtime
from omniloop_parity.compare import ParityResult, Tolerances, compare
from omniloop_parity.recording import Recording
from omniloop_parity.run import record, runtime_with_parity
from omniloop_parity.testing import assert_matches_golden, regen_requested

GOLDEN = Path(__file__).parent / "golden"


def _golden_request(prompt: str, request_id: str) -> dict:
    """The t2v request a golden pins: ``prompt``, negative prompt "blurry", seed 1234."""
    return {"task": "t2v", "prompt": prompt, "negative_prompt": "blurry", "diffusion": {"seed": 1234},
            "request_id": request_id}


TOY_REQUEST = _golden_request("a red cube rolling", "golden-toy")

# ---- the tolerance on a CPU other than the golden's ------------------------------------------
# Each float tap must be within  cross_cpu_ulps(g) * 2**-23 * max|golden tap|, with
#
#     cross_cpu_ulps(g) = FORWARD_ULPS * (2g + 1),   FORWARD_ULPS = 8,   g = the guidance scale.
#
# Derivation. float32 spaces numbers near x by eps·|x| (eps = 2**-23); every operation rounds to
# within eps/2 of the exact result. Another CPU runs other kernels for the same math: ATen's
# vector kernels are 8 (AVX2) or 16 (AVX-512) lanes wide or scalar (DEFAULT), oneDNN's and MKL's
# GEMMs block their K sums by ISA, and vectorised exp/tanh/rsqrt are 1-2 ulp approximations. So a
# dot product or reduction adds the same terms in another order and lands a few rounding steps
# away; layer norms and residual adds keep that relative to the activations' scale rather than
# letting it grow. One forward (a noise prediction) therefore reproduces to a few eps of its scale
# — measured worst 4.9 eps over every pair of {the goldens' first recording, made on another CPU;
# AVX2 here; ATEN_CPU_CAPABILITY=default; ONEDNN_MAX_CPU_ISA=SSE41}; FORWARD_ULPS = 8 leaves x1.6.
# Classifier-free guidance  u + g·(c − u)  turns errors e_c, e_u into (1 − g)·e_u + g·e_c, at most
# (2g − 1) times one error, plus its own rounding: (2g + 1) bounds it (toy g = 3: 56 eps; Wan tiny
# g = 5: 88 eps; measured worst 7.2 and 18.4). Euler latents  x + Δt·guided  take a Δt-weighted sum
# of the guided errors with ΣΔt = 1 over a flow-matching schedule, so they stay inside the same bound
# (Wan tiny's UniPC mixes two model outputs per step with coefficients of that size; measured 6.2).
# A real change stays visible: the 1e-3 block perturbation below is ~8,400 eps at its source.
#
# Integer taps (the uint8 video) may move by one quantisation level, never more — a float a
# little off a rounding boundary rounds to the neighbouring level — and on at most
# MAX_LEVEL_FLIP_FRACTION of the elements: pixel = (x + 1)·127.5 carries the float error
# δ ≈ 88 eps·127.5 ≈ 1.3e-3 levels, so a pixel flips with probability ~2δ ≈ 0.3% (measured 0.007%).
FORWARD_ULPS = 8
MAX_LEVEL_FLIP_FRACTION = 0.01


def cross_cpu_ulps(guidance_scale: float) -> float:
    return FORWARD_ULPS * (2 * guidance_scale + 1)


def _literal_glob(key: str) -> str:
    """A glob (as parity's tolerance overrides take) matching exactly ``key``."""
    return re.sub(r"([*?\[])", r"[\1]", key)


def cross_cpu_tolerances(golden: Recording, ulps: float) -> Tolerances:
    """Per-tap absolute tolerances: ``ulps`` float32 ulps of each tap's largest magnitude (1 level for ints)."""
    override = [
        {"match": _literal_glob(key), "atol": goldens.roundoff_atol(t, ulps)} for key, t in golden.tensors.items()
    ]
    return Tolerances.from_dict({"atol": 0.0, "override": override})


def replay_golden(
    runtime: Any, request: dict[str, Any], golden: Path, *, blocks: str | None = None
) -> tuple[ParityResult, list[str]]:
    """Assert ``runtime`` replays ``golden``; returns (result, why not bit for bit: [] when it was).

    Bit for bit where the golden's CPU fingerprint matches this process's; otherwise within
    :func:`cross_cpu_tolerances` for the request's guidance scale (the runtime's default when the
    request sets none), and with at most MAX_LEVEL_FLIP_FRACTION of each integer tap moved by one
    level. With ``OMNILOOP_PARITY_REGEN=1`` the golden is rewritten and stamped with this CPU.
    """
    if regen_requested():
        result = assert_matches_golden(runtime, request, golden, blocks=blocks)
        goldens.stamp_fingerprint(golden)
        return result, []
    why = goldens.fingerprint_differences(goldens.read_fingerprint(golden)) if golden.is_file() else []
    if not why:
        return assert_matches_golden(runtime, request, golden, blocks=blocks), []
    req = request_from_dict(request)
    g = req.diffusion.guidance_scale
    if g is None:
        g = runtime.defaults(req.task)["guidance_scale"]
    ulps = cross_cpu_ulps(float(g))
    ref = Recording.load(golden)
    new = record(runtime_with_parity(runtime, blocks=blocks), req)
    result = compare(ref, new, cross_cpu_tolerances(ref, ulps))
    result.b_label = "this run"
    note = f"(compared within {ulps:g} float32 ulps, not bit for bit, because this CPU is not the golden's: {'; '.join(why)})"
    assert result.passed, f"{result.explain()}\n{note}"
    for key, t in ref.tensors.items():
        if not t.is_floating_point() and key in new.tensors:
            frac = goldens.level_flip_fraction(t, new.tensors[key])
            assert frac <= MAX_LEVEL_FLIP_FRACTION, f"{key}: {frac:.2%} of the values moved by one level\n{note}"
    return result, why


def test_toy_family_replays_its_golden(ckpt):
    # a plain runtime: the helper enables the parity observer on a runtime built from the same deploy
    result, why = replay_golden(toy_runtime(ckpt), TOY_REQUEST, GOLDEN / "toy-t2v.safetensors")
    assert result.passed
    if not why:  # the golden's CPU: bit for bit
        assert all(c.max_abs == 0 for c in result.comparisons)
    assert (GOLDEN / "toy-t2v.safetensors").stat().st_size < 100_000


def test_the_goldens_carry_a_cpu_fingerprint():
    for name in ("toy-t2v.safetensors", "wan-tiny-t2v.safetensors"):
        fp = goldens.read_fingerprint(GOLDEN / name)
        assert fp is not None, f"{name}: regenerate it with OMNILOOP_PARITY_REGEN=1 (stamps the fingerprint)"
        assert set(fp) == set(goldens.cpu_fingerprint()), name
        assert fp["torch_threads"] == "1", name  # recorded under the suite's one torch thread


def test_a_golden_from_another_cpu_is_compared_within_round_off(h, ckpt, tmp_path):
    # the golden as another CPU would have recorded it: its own round-off (a few ulps of each tap's
    # magnitude) on every float tap, and its own fingerprint
    rec = Recording.load(GOLDEN / "toy-t2v.safetensors")
    gen = torch.Generator().manual_seed(0)
    for key, t in rec.tensors.items():
        if t.is_floating_point():
            noise = torch.randint(-4, 5, t.shape, generator=gen).to(t.dtype)
            rec.tensors[key] = t + noise * goldens.FLOAT32_EPS * t.abs().max()
    golden = rec.save(tmp_path / "toy-t2v.safetensors")
    goldens.stamp_fingerprint(golden, {**goldens.cpu_fingerprint(), "cpu": "GenuineIntel some other CPU"})

    result, why = replay_golden(toy_runtime(ckpt), TOY_REQUEST, golden)
    assert result.passed and len(why) == 1 and why[0].startswith("cpu: 'GenuineIntel some other CPU' when recorded")
    assert any(c.max_abs > 0 for c in result.comparisons)
    latents = next(c for c in result.comparisons if c.key == "final/latents")
    assert latents.tol.atol == goldens.roundoff_atol(rec.tensors["final/latents"], cross_cpu_ulps(3.0))  # toy g = 3
    # ... and a real change (a block's output scaled by 1 + 1e-3 at the last step) still fails
    perturbed = toy_runtime(
        ckpt, ("perturb", h.InterceptorPlugin(h.PerturbBlock(k=1, step=3))), plugins={"perturb": {}}
    )
    with pytest.raises(AssertionError, match=r"(?s)first divergence at step003/.*because this CPU is not the golden's"):
        replay_golden(perturbed, TOY_REQUEST, golden)


def test_goldens_helpers():
    fp = goldens.cpu_fingerprint()
    assert fp["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability() and fp["torch"] == torch.__version__
    assert goldens.fingerprint_differences(fp) == []
    assert goldens.fingerprint_differences(None) == ["the golden has no CPU fingerprint (recorded on an unknown CPU)"]
    other = "AVX2" if fp["aten_cpu_capability"] != "AVX2" else "AVX512"  # not this CPU's, whichever it is
    assert goldens.fingerprint_differences({**fp, "aten_cpu_capability": other}, fp) == [
        f"aten_cpu_capability: {other!r} when recorded, {fp['aten_cpu_capability']!r} here"
    ]
    assert goldens.roundoff_atol(torch.tensor([0.5, -2.0, float("inf")]), 8) == 8 * 2.0**-23 * 2.0
    assert goldens.roundoff_atol(torch.zeros(0), 8) == 0.0
    assert goldens.roundoff_atol(torch.tensor([3, 200], dtype=torch.uint8), 8) == 1.0
    with pytest.raises(ValueError, match="ulps"):
        goldens.roundoff_atol(torch.ones(2), -1)
    a = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert goldens.level_flip_fraction(a, torch.tensor([1, 2, 4, 4], dtype=torch.uint8)) == 0.25
    with pytest.raises(ValueError, match="shapes differ"):
        goldens.level_flip_fraction(a, a[:2])


def test_stamping_keeps_tensors_and_metadata(tmp_path):
    golden = tmp_path / "g.safetensors"
    shutil.copy(GOLDEN / "toy-t2v.safetensors", golden)
    before = Recording.load(golden)
    fp = goldens.stamp_fingerprint(golden, {"cpu": "x"})
    assert fp == {"cpu": "x"} and goldens.read_fingerprint(golden) == {"cpu": "x"}
    after = Recording.load(golden)
    assert after.manifest == before.manifest
    assert after.tensors.keys() == before.tensors.keys()
    assert all(torch.equal(after.tensors[k], t) for k, t in before.tensors.items())
    assert [p.name for p in tmp_path.iterdir()] == ["g.safetensors"]  # no temporary file left


def test_missing_golden_fails_with_how_to_write_it(ckpt, tmp_path, monkeypatch):
    monkeypatch.delenv("OMNILOOP_PARITY_REGEN", raising=False)
    with pytest.raises(AssertionError, match="OMNILOOP_PARITY_REGEN=1"):
        assert_matches_golden(toy_runtime(ckpt), TOY_REQUEST, tmp_path / "g.safetensors")


def test_regen_writes_then_a_divergence_is_explained(h, ckpt, tmp_path, monkeypatch):
    golden = tmp_path / "g.safetensors"
    monkeypatch.setenv("OMNILOOP_PARITY_REGEN", "1")  # (restored by monkeypatch afterwards)
    assert assert_matches_golden(toy_runtime(ckpt), TOY_REQUEST, golden, blocks=r"blocks\.\d+$").regenerated
    monkeypatch.delenv("OMNILOOP_PARITY_REGEN")
    assert assert_matches_golden(toy_runtime(ckpt), TOY_REQUEST, golden, blocks=r"blocks\.\d+$").passed
    perturbed = toy_runtime(
        ckpt, ("perturb", h.InterceptorPlugin(h.PerturbBlock(k=1, step=3))), plugins={"perturb": {}}
    )
    with pytest.raises(AssertionError, match=r"first divergence at step003/cond/blocks\.1 \(step 3"):
        assert_matches_golden(perturbed, TOY_REQUEST, golden, blocks=r"blocks\.\d+$")
    # ... and tolerances given as a mapping accept it
    assert_matches_golden(
        perturbed,
        TOY_REQUEST,
        golden,
        {"atol": 0.05, "override": [{"match": "final/video", "atol": 255}]},
        blocks=r"blocks\.\d+$",
    )


def test_a_request_without_a_seed_is_refused(ckpt, tmp_path):
    with pytest.raises(ValueError, match="seed"):
        assert_matches_golden(toy_runtime(ckpt), {"task": "t2v", "prompt": "x"}, tmp_path / "g.safetensors")


def test_pytest_option_parity_regen_and_fixture(tmp_path):
    test = tmp_path / "test_pinned.py"
    test.write_text(
        textwrap.dedent("""
        from pathlib import Path
        from omniloop.testing import toy_runtime

        def test_pinned(parity_golden, toy_checkpoint):
            req = {"task": "t2v", "prompt": "x", "diffusion": {"seed": 1, "steps": 2}}
            parity_golden(toy_runtime(toy_checkpoint), req, Path(__file__).parent / "pinned.safetensors")
    """)
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)]
    env_free = {k: v for k, v in __import__("os").environ.items() if k != "OMNILOOP_PARITY_REGEN"}
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env_free)
    assert first.returncode == 1 and "--parity-regen" in first.stdout
    regen = subprocess.run([*cmd, "--parity-regen"], cwd=tmp_path, capture_output=True, text=True, env=env_free)
    assert regen.returncode == 0, regen.stdout
    assert (tmp_path / "pinned.safetensors").is_file()
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env_free)
    assert again.returncode == 0, again.stdout


WAN_REQUEST = _golden_request("a cat walking on grass", "golden-wan")


@pytest.mark.slow
def test_wan_tiny_checkpoint_replays_its_golden(tmp_path):
    """Pins the Wan family (tiny t2v checkpoint, CPU float32): bit for bit on the golden's CPU,
    within the cross-CPU tolerance elsewhere. After an intended numerical change, rewrite with
    ``OMNILOOP_PARITY_REGEN=1 pytest tests/parity/test_golden.py -k wan`` and say why in the commit."""
    tiny = pytest.importorskip("omniloop_wan.tiny")
    from omniloop.runtime import Runtime

    ckpt = tiny.build_tiny_checkpoint(tmp_path / "wan-tiny", variant="t2v")
    result, why = replay_golden(Runtime.from_model(str(ckpt)), WAN_REQUEST, GOLDEN / "wan-tiny-t2v.safetensors")
    assert result.passed
    if not why:
        assert all(c.max_abs == 0 for c in result.comparisons)
    assert (GOLDEN / "wan-tiny-t2v.safetensors").stat().st_size < 1_000_000
