"""bench/cache_demo.py: its SSIM/PSNR against scikit-image's numbers, and ``--smoke`` end to end on the
trained wan-demo checkpoint at 4 steps (the script does not rot)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from omniloop.testing.scripts import load_script, run_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cache_demo.py"


def _checkpoint_installed() -> bool:
    try:
        from omniloop_wan_demo.checkpoint_path import checkpoint_dir
    except ImportError:
        return False
    return (checkpoint_dir() / "model_index.json").exists()


def _pair() -> tuple[np.ndarray, np.ndarray]:
    t, y, x, ch = np.meshgrid(np.arange(5), np.arange(64), np.arange(64), np.arange(3), indexing="ij")
    c = (128 + 100 * np.sin(x / 7 + t + ch) * np.cos(y / 9)).round().astype(np.uint8)
    d = np.clip(c.astype(int) + 9 * ((x * y + 3 * t + ch) % 5 - 2), 0, 255).astype(np.uint8)
    return c, d


@pytest.mark.skipif(not BENCH.exists(), reason="bench/cache_demo.py not in this checkout")
def test_ssim_psnr_match_scikit_image():
    mod = load_script(BENCH)
    c, d = _pair()
    # scikit-image 0.26: mean over frames of structural_similarity(c[t], d[t], gaussian_weights=True,
    # sigma=1.5, use_sample_covariance=False, data_range=255, channel_axis=-1); peak_signal_noise_ratio
    assert mod.ssim(c, d) == pytest.approx(0.6945230806054888, abs=1e-9)
    assert mod.psnr(c, d) == pytest.approx(26.035653463252793, abs=1e-9)
    assert mod.ssim(c, c) == pytest.approx(1.0, abs=1e-12)
    assert mod.ssim(c, d) == pytest.approx(mod.ssim(d, c), abs=1e-12)
    assert math.isinf(mod.psnr(c, c))


@pytest.mark.skipif(not BENCH.exists(), reason="bench/cache_demo.py not in this checkout")
def test_setting_tags():
    mod = load_script(BENCH)
    assert mod.parse_setting("baseline") == (None, {})
    assert mod.parse_setting("cache-dit:F1B0_R0.2_W2_T1") == (
        "cache-dit",
        {
            "Fn": 1,
            "Bn": 0,
            "residual_diff_threshold": 0.2,
            "max_warmup_steps": 2,
            "taylorseer": True,
            "taylorseer_order": 1,
        },
    )
    assert mod.parse_setting("fbcache:R0.12_W2_MC-1") == (
        "fbcache",
        {"threshold": 0.12, "warmup_steps": 2, "max_consecutive_cached": -1},
    )
    with pytest.raises(SystemExit):
        mod.parse_setting("fbcache:F1B0")
    # @reference / @fast: the runtime's vae_cpu_kernels, else the command's default
    assert mod.parse_setting("cache-dit:F1B0_R0.3_W2@reference") == mod.parse_setting("cache-dit:F1B0_R0.3_W2")
    assert mod.parse_setting("baseline@reference") == (None, {})
    assert mod.setting_kernels("baseline@reference", "fast") == "reference"
    assert mod.setting_kernels("fbcache:R0.2_W2", "fast") == "fast"
    with pytest.raises(SystemExit):
        mod.setting_kernels("baseline@turbo", "fast")


@pytest.mark.slow
@pytest.mark.skipif(not BENCH.exists(), reason="bench/cache_demo.py not in this checkout")
@pytest.mark.skipif(not _checkpoint_installed(), reason="omniloop_wan_demo's checkpoint is not installed")
def test_cache_demo_smoke(tmp_path):
    doc = run_script(BENCH, ["--smoke", "--steps", "4"], tmp_path, "cache_demo-*-smoke.json")
    assert doc["command"].startswith("python bench/cache_demo.py --smoke")
    assert doc["clips"] == 2 and doc["machine"]["torch_threads"] >= 1
    base, cached = doc["settings"]
    assert base["setting"] == "baseline" and base["cached_fraction"] == 0
    assert base["identical_clips"] == 2  # the baseline is its own reference
    assert cached["plugin"] == "cache-dit" and cached["cached_fraction"] > 0  # something was skipped
    assert cached["identical_clips"] < 2 and 0 < cached["ssim_mean"] < 1 and cached["psnr_mean"] > 10
    assert doc["summary"]["amdahl_ceiling_e2e"] > 1
    for s in ("baseline", cached["setting"]):
        assert len(doc["clips_detail"][s]) == 2
