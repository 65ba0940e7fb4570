"""Coverage of ComfyUI's published templates: how many of those that use only models an omniloop
family runs (Wan 2.1/2.2 T2V, I2V, TI2V-5B; FLUX.1 dev/schnell/krea-dev; SD3/SD3.5 large/medium)
compile, and the most common reasons the rest do not.

    python plugins/frontends/comfyui/scripts/coverage.py [--json-out bench/results/comfyui-coverage-DATE.json]

It also compiles each against deploys whose ``flow-euler`` spaces sigmas linearly or the
``sgm_uniform`` way (Wan / SD3 ``policies.sampler_options: {flow-euler: {sigma_schedule: ...}}``),
which serve ComfyUI's ``euler``/``simple`` and ``euler``/``sgm_uniform``.

Reads the templates of the installed ``comfyui-workflow-templates-json`` package (a test
dependency: ``make setup`` installs it). Compiles each in scope against an *unbound* target (no
served model: loader names are not checked, the family is read from the graph), as
``omniloop comfy check`` without ``--deploy`` does.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import importlib.resources
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

#: diffusion-model files (UNet / checkpoint loaders) of models an omniloop family runs
IN_SCOPE = re.compile(
    r"^(wan2\.1_(t2v|i2v)_|wan2\.2_(t2v|i2v)_(high|low)_noise_|wan2\.2_ti2v_5B|flux1-(dev|schnell|krea-dev)[-_.]|"
    r"flux1-(dev|schnell)\.|sd3(\.5)?_(large|medium)[-_.])", re.IGNORECASE)
MODEL_LOADERS = {"CheckpointLoaderSimple": 0, "UNETLoader": 0, "UnetLoaderGGUF": 0, "ImageOnlyCheckpointLoader": 0}


def templates() -> list[tuple[str, Any]]:
    import comfyui_workflow_templates_json as pkg

    root = importlib.resources.files(pkg) / "templates"
    out = []
    for p in sorted(root.iterdir(), key=lambda p: p.name):
        if p.name.endswith(".json"):
            out.append((p.name[:-5], json.loads(p.read_text(encoding="utf-8"))))
    return out


def model_files(wf: Any) -> set[str]:
    files: set[str] = set()
    if not isinstance(wf, dict):
        return files
    nodes = list(wf.get("nodes") or [])
    for sg in ((wf.get("definitions") or {}).get("subgraphs") or []):
        nodes += sg.get("nodes") or []
    for n in nodes:
        if isinstance(n, dict) and n.get("type") in MODEL_LOADERS:
            w = n.get("widgets_values") or []
            if isinstance(w, list) and w and isinstance(w[0], str):
                files.add(w[0])
    return files


def reason_of(exc: Any) -> str:
    """A short, value-free reason: the error type and the node class (and input)."""
    if not exc.node_errors:
        if exc.type == "missing_node_type":
            return f"unknown node class {exc.extra_info.get('class_type')}"
        return f"{exc.type}: {exc.message[:60]}"
    e = next(iter(exc.node_errors.values()))
    first = e["errors"][0]
    msg = re.sub(r"'[^']*'|\"[^\"]*\"|(?<![\w.])[-+]?\d[\d.e+-]*(?![\w.])", "…", first["message"])[:90]
    return f"{e['class_type']}: {msg}"


def main(argv: list[str] | None = None) -> int:
    from omniloop_comfyui import Target, WorkflowError, compile_workflow

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for name, wf in templates():
        files = model_files(wf)
        if not files or not all(IN_SCOPE.match(f) for f in files):
            continue
        # the same template against deploys whose flow-euler spaces sigmas ComfyUI's simple /
        # sgm_uniform way (policies.sampler_options: {flow-euler: {sigma_schedule: ...}})
        linear: Any = None
        for schedule in ("linear", "sgm_uniform"):
            try:
                compile_workflow(wf, Target(flow_schedule=schedule))
                linear = schedule
                break
            except WorkflowError as exc:
                linear = linear or reason_of(exc)
            except Exception as exc:
                linear = linear or f"compiler error {type(exc).__name__}"
        try:
            compiled = compile_workflow(wf)
            rows.append({"template": name, "models": sorted(files), "compiles": True, "jobs": len(compiled.jobs),
                         "reason": None, "with_linear_flow_euler": linear})
        except WorkflowError as exc:
            rows.append({"template": name, "models": sorted(files), "compiles": False, "reason": reason_of(exc),
                         "detail": exc.summary()[:300], "with_linear_flow_euler": linear})
        except Exception as exc:  # a compiler bug: counted and shown, never hidden
            rows.append({"template": name, "models": sorted(files), "compiles": False,
                         "reason": f"compiler error {type(exc).__name__}", "detail": str(exc)[:300],
                         "with_linear_flow_euler": linear})
    ok = [r for r in rows if r["compiles"]]
    reasons = collections.Counter(r["reason"] for r in rows if not r["compiles"])
    print(f"{len(ok)} of {len(rows)} in-scope templates compile "
          f"(package comfyui-workflow-templates-json {importlib.metadata.version('comfyui-workflow-templates-json')})")
    print("compiling: " + ", ".join(r["template"] for r in ok))
    lin = [r for r in rows if r["compiles"] or r["with_linear_flow_euler"] in ("linear", "sgm_uniform")]
    print(f"{len(lin)} of {len(rows)} with a deploy whose flow-euler spaces sigmas the template's way "
          "(policies.sampler_options: {flow-euler: {sigma_schedule: linear | sgm_uniform}}): "
          + ", ".join(f"{r['template']} ({r['with_linear_flow_euler'] if not r['compiles'] else 'default'})" for r in lin))
    print("\n| templates | reason |\n|---:|---|")
    for reason, n in reasons.most_common():
        print(f"| {n} | {reason} |")
    if args.json_out is not None:
        record = {
            "command": "python plugins/frontends/comfyui/scripts/coverage.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.date.today().isoformat(), "machine": {"python": platform.python_version()},
            "package": {"comfyui-workflow-templates-json": importlib.metadata.version("comfyui-workflow-templates-json")},
            "in_scope": len(rows), "compile": len(ok), "compile_with_matching_flow_euler": len(lin), "reasons": reasons.most_common(), "templates": rows,
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
