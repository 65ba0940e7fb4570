"""The GPU session scripts of issue 41 (``demos/wan-demo/scripts/gpu_causal_dmd.sh``,
``gpu_dmd.sh``, ``gpu_fast_scales.sh``, ``gpu_decoder_specks.sh``): they cannot run here (no GPU, no carried wheels), so what can drift is checked —
bash parses them, every ``--option`` they pass to a training module is one that module's parser
knows, the files they start from are in the package, and each packs its results into one tar."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "demos" / "wan-demo" / "scripts"
MODULES = {"gpu_causal_dmd.sh": "omniloop_wan_demo_training.train_causal_dmd",
           "gpu_dmd.sh": "omniloop_wan_demo_training.dmd_fast",
           "gpu_fast_scales.sh": "omniloop_wan_demo_training.dmd_fast",
           "gpu_decoder_specks.sh": "omniloop_wan_demo_training.decoder_specks"}


def _module_options(module: str) -> set[str]:
    import importlib

    mod = importlib.import_module(module)
    parser_src = Path(mod.__file__).read_text()
    return set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', parser_src))


#: scripts that only evaluate (several calls of the module); the others train ONE run per session
EVALUATION_ONLY = {"gpu_fast_scales.sh"}


def _script_calls(text: str, module: str) -> list[str]:
    """The command lines (continuation lines joined, up to their first pipe) that run ``python3 -m module``."""
    joined = text.replace("\\\n", " ")
    lines = [ln for ln in joined.splitlines() if f"-m {module}" in ln and not ln.lstrip().startswith("#")]
    return [ln.split(" | ")[0].split("2>&1")[0] for ln in lines]


@pytest.mark.parametrize("script", sorted(MODULES))
def test_the_script_parses_and_passes_only_known_options(script):
    path = SCRIPTS / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    calls = _script_calls(path.read_text(), MODULES[script])
    assert calls if script in EVALUATION_ONLY else len(calls) == 1, calls  # ONE training per session
    for call in calls:
        used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", call))
        assert used and used <= _module_options(MODULES[script]), used - _module_options(MODULES[script])


@pytest.mark.parametrize("script,tar", [("gpu_causal_dmd.sh", "causal-dmd.tar"), ("gpu_dmd.sh", "fast-dmd.tar")])
def test_the_script_packs_one_tar_and_says_how_to_ship_it(script, tar):
    text = (SCRIPTS / script).read_text()
    assert re.findall(r'\$OUT/[\w.-]+', text.replace('"$OUT"', "")) == [f"$OUT/{tar}"] * text.count(f"$OUT/{tar}")
    assert "--ship" in text and "To ship it" in text


def test_the_scripts_start_from_files_the_package_has():
    for script, var in (("gpu_causal_dmd.sh", "FROM"), ("gpu_dmd.sh", "LORA_FROM"), ("gpu_fast_scales.sh", "LORA")):
        (default,) = re.findall(rf"^{var}=\${{2:-([^}}]+)}}", (SCRIPTS / script).read_text(), re.M)
        assert (REPO / default).exists(), (script, default)


def test_the_decoder_script_evaluates_with_its_decoder_and_packs_one_tar():
    text = (SCRIPTS / "gpu_decoder_specks.sh").read_text()
    joined = text.replace("\\\n", " ")
    evals = [ln for ln in joined.splitlines() if "-m omniloop_wan_demo_training.dmd_fast" in ln and not ln.lstrip().startswith("#")]
    assert len(evals) == 2  # wan-demo-fast, then (DECODER=...) wan-demo v2
    for ev in evals:
        used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", ev.split(" | ")[0].split("2>&1")[0]))
        assert "--vae-from" in used and used <= _module_options("omniloop_wan_demo_training.dmd_fast")
    (probe,) = [ln for ln in joined.splitlines() if "speck_probe.py latents" in ln and not ln.lstrip().startswith("#")]
    probe_opts = set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', (SCRIPTS / "speck_probe.py").read_text()))
    assert set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", probe.split("2>&1")[0])) <= probe_opts
    assert re.findall(r'\$OUT/[\w.-]+', text.replace('"$OUT"', "")) == ["$OUT/decoder-specks.tar"] * text.count("$OUT/decoder-specks.tar")
    assert "To ship it" in text
