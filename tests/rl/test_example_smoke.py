"""examples/rl/flow_grpo.py: one tiny Flow-GRPO iteration on flux-demo (CPU smoke)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("omniloop_flux_demo")
pytest.importorskip("omniloop_wan_demo")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl" / "flow_grpo.py"


def _example():
    """The example script, imported as a module."""
    spec = importlib.util.spec_from_file_location("flow_grpo_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_one_tiny_iteration(tmp_path):
    mod = _example()
    log = mod.main(["--out", str(tmp_path), "--iterations", "1", "--prompts", "2", "--group", "2", "--steps", "3",
                    "--sde-window", "2", "--heldout", "1", "--eval-seeds", "1", "--inner", "1"])
    it = log["iterations"][0]
    # C1: before the update the trainer's own forward recomputes the rollout's log-probs
    assert it["c1_max_abs_logprob_gap"] < 1e-5
    assert it["rollout_weight_versions"] == ["iter-0"]
    assert len(log["heldout"]) == 2 and (tmp_path / "reward.png").stat().st_size > 0
    assert json.loads((tmp_path / "log.json").read_text())["iterations"][0]["iteration"] == 1


@pytest.mark.slow
def test_one_tiny_nft_iteration(tmp_path):
    """--method nft: rollouts capture only latents; the DiffusionNFT step runs and the LoRA is pushed."""
    mod = _example()
    log = mod.main(["--out", str(tmp_path), "--method", "nft", "--iterations", "2", "--prompts", "2", "--group", "2",
                    "--steps", "3", "--sde-window", "2", "--heldout", "1", "--eval-seeds", "2", "--inner", "1",
                    "--nft-times", "2"])
    first, second = log["iterations"]
    assert first["rollout_weight_versions"] == ["iter-0"] and second["rollout_weight_versions"] == ["iter-1"]
    assert all(0 < x < float("inf") for x in first["loss"]) and "c1_max_abs_logprob_gap" not in first
    assert [h["iteration"] for h in log["heldout"]] == [0, 2] and log["heldout"][0]["n"] == 2


def test_bad_arguments_exit_2(tmp_path, capsys):
    mod = _example()
    for bad, name in ((["--group", "1"], "--group"), (["--lr", "nan"], "--lr"), (["--budget-s", "-1"], "--budget-s"),
                      (["--method", "ppo"], "--method")):
        with pytest.raises(SystemExit) as info:
            mod.main(["--out", str(tmp_path), *bad])
        assert info.value.code == 2 and name in capsys.readouterr().err
