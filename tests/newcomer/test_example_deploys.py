"""examples/deploys/ (issue 42, finding 7): every shipped deploy file loads, and resolves against
its family without weights; the real-weight ones with their folder swapped for a tiny checkpoint
of the same layout (and cpu/float32), so the keys, plugins and limits they use are the ones the
runtime accepts. The demo ones run in tests/newcomer/test_readme_walkthrough.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omniloop.deploy import load_deploy
from omniloop.schema import converter

REPO = Path(__file__).resolve().parents[2]
DEPLOYS = REPO / "examples" / "deploys"
TINY = {"wan": "omniloop_wan.tiny", "flux": "omniloop_flux.tiny", "sd3": "omniloop_sd3.tiny", "qwen": "omniloop_qwen.tiny",
        "stable-audio": "omniloop_stable_audio.tiny", "ltx2": "omniloop_ltx2.tiny", "cosmos3": "omniloop_cosmos3.tiny"}
REQUESTS = {
    "wan": {"task": "t2v", "prompt": "a red fox", "diffusion": {"steps": 2, "height": 32, "width": 32, "frames": 5}},
    "flux": {"task": "t2i", "prompt": "a red fox", "diffusion": {"steps": 2, "height": 32, "width": 32}},
    "sd3": {"task": "t2i", "prompt": "a red fox", "diffusion": {"steps": 2, "height": 32, "width": 32}},
    "qwen": {"task": "reason", "prompt": "hello", "sampling": {"max_tokens": 4}},
    "stable-audio": {"task": "t2a", "prompt": "a drum loop", "diffusion": {"steps": 2}},
    "ltx2": {"task": "t2v", "prompt": "a robot dancing", "diffusion": {"steps": 2, "height": 32, "width": 32, "frames": 9}},
    "cosmos3": {"task": "t2v", "prompt": "a robot arm", "diffusion": {"steps": 2, "height": 32, "width": 48, "frames": 5}},
}


@pytest.fixture(scope="module")
def manager() -> Any:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import omniloop_cache_dit.plugin as cache_dit_plugin
    import omniloop_cosmos3.plugin as cosmos3_plugin
    import omniloop_flux.plugin as flux_plugin
    import omniloop_flux_demo.plugin as flux_demo_plugin
    import omniloop_ltx2.plugin as ltx2_plugin
    import omniloop_policies.plugin as policies_plugin
    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    import omniloop_sd3.plugin as sd3_plugin
    import omniloop_stable_audio.plugin as stable_audio_plugin
    import omniloop_wan.plugin as wan_plugin
    import omniloop_wan_demo.plugin as wan_demo_plugin
    from omniloop.testing import make_manager

    return make_manager(("wan", wan_plugin), ("wan-demo", wan_demo_plugin), ("flux", flux_plugin),
                        ("flux-demo", flux_demo_plugin), ("sd3", sd3_plugin), ("qwen", qwen_plugin),
                        ("stable-audio", stable_audio_plugin), ("ltx2", ltx2_plugin), ("cosmos3", cosmos3_plugin),
                        ("policies", policies_plugin), ("scheduler", scheduler_plugin),
                        ("cache-dit", cache_dit_plugin), toy=False, scheduler=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import importlib

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            build = importlib.import_module(TINY[family]).build_tiny_checkpoint
            made[family] = build(tmp_path_factory.mktemp(f"tiny-{family}"))
        return made[family]

    return get


def test_every_family_has_an_example() -> None:
    """Every installed family (the families the installed plugins register) has a deploy file to
    start from: a new family ships one (and a row in docs/using-real-weights.md)."""
    from omniloop.plugins import default_manager

    families = set()
    for f in DEPLOYS.glob("*.yaml"):
        d = load_deploy(f)
        families.add(d.model.family or ("wan" if "wan" in (d.model.preset or "") else "flux" if d.model.preset else None))
    installed = set(default_manager().registry().families)
    assert {"wan", "flux", "sd3", "qwen"} <= installed
    missing = sorted(installed - families)
    assert missing == [], f"no deploy file in examples/deploys/ for the installed families {missing}"
    weights_doc = (REPO / "docs" / "using-real-weights.md").read_text(encoding="utf-8")
    assert [f for f in sorted(installed) if f"| `{f}` |" not in weights_doc] == []


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOYS.glob("*.yaml")))
def test_example_deploy_resolves(name: str, manager: Any, tiny: Any) -> None:
    from omniloop.runtime import Deployment
    from omniloop_compose import ComposedDeployment, is_composed

    cfg = load_deploy(DEPLOYS / name)
    data = converter.unstructure(cfg)
    data.update(device="cpu", dtype="float32")
    if is_composed(cfg):
        for role in data["models"].values():
            if role.get("path"):
                role["path"] = str(tiny("qwen"))
        ComposedDeployment(load_deploy(data), manager=manager).check(
            {"task": "t2v", "prompt": "a fox", "diffusion": {"steps": 2}})
        return
    family = cfg.model.family
    if cfg.model.path:  # a real-weights deploy: the same layout, tiny
        data["model"]["path"] = str(tiny(family))
        request = REQUESTS[family]
    else:
        request = {"task": "t2i" if "flux" in cfg.model.preset else "t2v", "prompt": "a red circle moving up",
                   "diffusion": {"steps": 2}}
    dep = Deployment(load_deploy(data), manager=manager)
    dep.check(request)
