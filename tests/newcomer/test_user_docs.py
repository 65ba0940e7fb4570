"""A new user's first hour (issue 42, finding 7): the READMEs a user reads say what is true.

* every repository path the root README names (``examples/...``, ``docs/...``, ``families/...``)
  exists (its commands run in ``test_readme_walkthrough.py``);
* the root README shows LoRA with a way to try it (a script that makes a demo adapter);
* ``families/flux/README.md`` does not say "no ... LoRA" (it did, right under its LoRA section);
* package READMEs are user docs: no internal GPU-session tooling (device folders, carried wheels,
  ``$OUT``); measurement logs live in ``docs/`` and ``bench/results/``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")

#: what an internal GPU session's notes look like (the device tooling), never a user's concern
SESSION_TOOLING = re.compile(r"\.gpu-[a-z0-9]|\$OUT\b|files_fetch|budget_left|\bcarry\b[^.\n]*\.whl|--carry\b")


def package_readmes() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*README.md"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    skip = ("docs/", "bench/", "demos/", "examples/")  # demos/: how checkpoints were made, GPU scripts included
    return [REPO / p for p in out.split() if "/" in p and not p.startswith(skip)]


def test_every_repository_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"(?<![\w/.-])((?:examples|docs|families|plugins|observers|interceptors|bench|demos)/[\w./-]*\w)",
                           README))
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert named and missing == [], missing


def test_the_readme_shows_lora_with_a_way_to_try_it() -> None:
    section = README[README.index("LoRA"):]
    assert "--adapter" in section and "adapters:" in section
    script = re.search(r"python (examples/\S+lora\S*\.py)", section)
    assert script and (REPO / script.group(1)).is_file()


def test_the_flux_readme_does_not_deny_its_lora_support() -> None:
    text = (REPO / "families" / "flux" / "README.md").read_text(encoding="utf-8")
    assert "## LoRA" in text
    sentences = re.split(r"(?<=[.;:])\s", " ".join(text.split()))
    denials = [s for s in sentences if re.search(r"\bno\b", s, re.I) and "LoRA" in s and "supported" not in s]
    assert denials == []


@pytest.mark.parametrize("readme", package_readmes(), ids=lambda p: str(p.relative_to(REPO)))
def test_package_readmes_hold_no_gpu_session_tooling(readme: Path) -> None:
    hits = [ln.strip() for ln in readme.read_text(encoding="utf-8").splitlines() if SESSION_TOOLING.search(ln)]
    assert hits == [], hits
