"""ComfyUI's own templates (from its PyPI package), compiled onto tiny checkpoints and run: the
compiled request's output equals the native request with the same seed and settings, and the file
the compiled SaveImage / SaveVideo writes holds exactly those pixels.

Widget values the tests change (the graphs stay the templates'): sizes, lengths and step counts
(tiny models), and where the template's sampler has no same-math omniloop sampler (the Wan
template's ``uni_pc``/``simple``, SD3.5's ``euler``/``sgm_uniform``) the test sets ``euler``/
``normal`` — and first asserts the template as published is refused with a node error naming it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from omniloop.runtime import Runtime
from omniloop_comfyui import Target, WorkflowError, compile_workflow
from omniloop_comfyui.save import write_job_outputs


def _runtime(path, manager, aliases):
    return Runtime.from_model(path, device="cpu", dtype="float32", manager=manager, comfyui={"models": aliases})


def _run(rt, request):
    out = rt.generate(request)
    assert out.ok, out.error
    return out


def _png(path):
    from PIL import Image

    with Image.open(path) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB")).copy()), dict(im.info)


def _wan22_native(wf: dict, steps: int) -> dict:
    """The native request the Wan 2.2 14B t2v template compiles to once shrunk to 32x32x5 frames
    (its prompts read from the template's CLIPTextEncode nodes 89 and 72)."""
    text = {n["id"]: n["widgets_values"][0] for n in wf["definitions"]["subgraphs"][0]["nodes"]
            if n["type"] == "CLIPTextEncode"}
    return {"task": "t2v", "inputs": [{"type": "text", "text": text[89], "role": "prompt"},
                                      {"type": "text", "text": text[72], "role": "negative_prompt"}],
            "diffusion": {"seed": 923510416338945, "steps": steps, "width": 32, "height": 32, "frames": 5,
                          "shift": 5.000000000000001, "guidance_scale": 3.5, "fps": 16.0},
            "node_params": {"denoise": {"sampler": "flow-euler", "guidance_scale_2": 3.5}}}


def test_flux_schnell_template(tiny, templates, widgets, family_manager, tmp_path):
    ckpt = tiny("flux", "schnell")
    rt = _runtime(ckpt, family_manager("flux"), {"flux1-schnell-fp8.safetensors": ckpt.name})
    wf = widgets(templates("flux_schnell"), 27, width=64, height=64)  # EmptySD3LatentImage; 4 steps, euler/simple kept
    compiled = compile_workflow(wf, Target.from_runtime(rt, model=ckpt.name))
    (job,) = compiled.jobs
    prompt = next(n for n in wf["nodes"] if n["id"] == 6)["widgets_values"][0]
    native = {"task": "t2i", "inputs": [{"type": "text", "text": prompt, "role": "prompt"}],
              "diffusion": {"seed": 173805153958730, "steps": 4, "width": 64, "height": 64, "shift": math.e},
              "node_params": {"denoise": {"sampler": "flow-euler", "cfg": "embedded"}}}
    got, want = _run(rt, job.request), _run(rt, native)
    assert torch.equal(got.artifacts["image"].pixels, want.artifacts["image"].pixels)
    files = write_job_outputs(job, got, tmp_path, prompt=compiled.prompt, extra_pnginfo={"workflow": wf})
    (entry,) = files["9"]["images"]
    assert entry == {"filename": "ComfyUI_00001_.png", "subfolder": "", "type": "output"}
    pixels, info = _png(tmp_path / entry["filename"])
    assert torch.equal(pixels, want.artifacts["image"].pixels)
    assert "prompt" in info and "workflow" in info


def test_sd3_template(tiny, templates, widgets, family_manager, tmp_path):
    """SD3.5's template samples with euler / sgm_uniform: refused on a default deploy, served as
    published (sizes and steps shrunk) by a deploy whose flow-euler spaces sigmas the sgm_uniform way."""
    wf = templates("sd3.5_simple_example")
    with pytest.raises(WorkflowError) as exc:  # a default deploy: flow-euler's spacing is ComfyUI's normal
        compile_workflow(wf)
    assert "sgm_uniform" in exc.value.node_errors["3"]["errors"][0]["message"]
    ckpt = tiny("sd3", "sd35-medium")
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("sd3"),
                            comfyui={"models": {"sd3.5_large_fp8_scaled.safetensors": ckpt.name}},
                            policies={"sampler_options": {"flow-euler": {"sigma_schedule": "sgm_uniform"}}})
    wf = widgets(wf, 53, width=64, height=64)
    wf = widgets(wf, 3, steps=3)
    compiled = compile_workflow(wf, Target.from_runtime(rt, model=ckpt.name))
    (job,) = compiled.jobs
    prompt = next(n for n in wf["nodes"] if n["id"] == 16)["widgets_values"][0]
    native = {"task": "t2i", "inputs": [{"type": "text", "text": prompt, "role": "prompt"}],
              "diffusion": {"seed": 585483408983215, "steps": 3, "width": 64, "height": 64, "shift": 3.0,
                            "guidance_scale": 4.01},
              "node_params": {"denoise": {"sampler": "flow-euler"}}}
    assert job.request == native
    got, want = _run(rt, job.request), _run(rt, native)
    assert torch.equal(got.artifacts["image"].pixels, want.artifacts["image"].pixels)
    files = write_job_outputs(job, got, tmp_path, prompt=compiled.prompt)
    pixels, _ = _png(tmp_path / files["9"]["images"][0]["filename"])
    assert torch.equal(pixels, want.artifacts["image"].pixels)


def test_wan_t2v_template(tiny, templates, widgets, family_manager, tmp_path):
    wf = templates("text_to_video_wan")
    with pytest.raises(WorkflowError) as exc:  # as published: uni_pc / simple has no same-math sampler
        compile_workflow(wf)
    assert "uni_pc" in exc.value.node_errors["3"]["errors"][0]["message"]
    ckpt = tiny("wan", "t2v")
    aliases = {"wan2.1_t2v_1.3B_fp16.safetensors": ckpt.name, "umt5_xxl_fp8_e4m3fn_scaled.safetensors": ckpt.name,
               "wan_2.1_vae.safetensors": ckpt.name}
    rt = _runtime(ckpt, family_manager("wan"), aliases)
    wf = widgets(wf, 40, width=32, height=32, length=5)  # EmptyHunyuanLatentVideo
    wf = widgets(wf, 3, steps=2, sampler_name="euler", scheduler="normal")
    compiled = compile_workflow(wf, Target.from_runtime(rt, model=ckpt.name))
    (job,) = compiled.jobs
    text = {n["id"]: n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "CLIPTextEncode"}
    native = {"task": "t2v", "inputs": [{"type": "text", "text": text[6], "role": "prompt"},
                                        {"type": "text", "text": text[7], "role": "negative_prompt"}],
              "diffusion": {"seed": 82628696717253, "steps": 2, "width": 32, "height": 32, "frames": 5, "shift": 8.0,
                            "guidance_scale": 6.0, "fps": 16.0},
              "node_params": {"denoise": {"sampler": "flow-euler"}}}
    assert job.request == native
    got, want = _run(rt, job.request), _run(rt, native)
    assert torch.equal(got.artifacts["video"].frames, want.artifacts["video"].frames)
    files = write_job_outputs(job, got, tmp_path)
    (entry,) = files["50"]["images"]
    assert entry["subfolder"] == "video" and entry["filename"] == "ComfyUI_00001_.mp4"
    assert files["50"]["animated"] == [True]
    assert (tmp_path / "video" / entry["filename"]).stat().st_size > 0


def test_wan22_14b_t2v_template(tiny, templates, widgets, family_manager):
    """ComfyUI's Wan 2.2 14B text-to-video template — a subgraph with primitive, switch and math
    nodes and a high/low KSamplerAdvanced pair — as one two-expert request on a tiny Wan 2.2."""
    from omniloop_comfyui.compiler import _switch_step

    wf = templates("video_wan2_2_14B_t2v")
    with pytest.raises(WorkflowError) as exc:  # as published: euler / simple on Wan's flow-euler spacing
        compile_workflow(wf)
    assert "euler/simple" in exc.value.summary()
    ckpt = tiny("wan", "wan22")
    names = ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
             "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors"]
    rt = _runtime(ckpt, family_manager("wan"), {n: ckpt.name for n in names})
    target = Target.from_runtime(rt, model=ckpt.name)
    steps = 6
    k = _switch_step(target.scheduler, 5.0, steps, target.boundary_ratio)
    wf = widgets(wf, 114, subgraph=0, value=steps)  # the steps primitive (20)
    wf = widgets(wf, 115, subgraph=0, value=k)  # where the high-noise expert ends (10 of 20)
    wf = widgets(wf, 126, subgraph=0, value=0.25)  # seconds: length = floor(0.25 * 16) + 1 = 5 frames
    wf = widgets(wf, 74, subgraph=0, width=32, height=32)
    for sampler in (81, 78):
        wf = widgets(wf, sampler, subgraph=0, sampler_name="euler", scheduler="normal")
    (job,) = compile_workflow(wf, target).jobs
    native = _wan22_native(wf, steps)
    assert job.request == native
    got, want = _run(rt, job.request), _run(rt, native)
    assert torch.equal(got.artifacts["video"].frames, want.artifacts["video"].frames)


def test_wan22_template_euler_simple_with_a_linear_deploy(tiny, templates, widgets, family_manager):
    """A deploy that makes Wan's flow-euler linear (policies.sampler_options) serves ComfyUI's
    euler/simple as published: the Wan 2.2 template's samplers unchanged."""
    from omniloop_comfyui.compiler import _switch_step

    ckpt = tiny("wan", "wan22")
    names = ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
             "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors"]
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("wan"),
                            comfyui={"models": {n: ckpt.name for n in names}},
                            policies={"sampler_options": {"flow-euler": {"sigma_schedule": "linear"}}})
    target = Target.from_runtime(rt, model=ckpt.name)
    assert target.flow_schedule == "linear"
    import omniloop_wan.policies as wp

    assert wp.menu_for(rt.model).samplers["flow-euler"].sigma_schedule == "linear"
    steps = 8  # divides ComfyUI's 1000-entry table
    k = _switch_step(target.scheduler, 5.0, steps, target.boundary_ratio, "linear")
    wf = templates("video_wan2_2_14B_t2v")
    wf = widgets(wf, 114, subgraph=0, value=steps)
    wf = widgets(wf, 115, subgraph=0, value=k)
    wf = widgets(wf, 126, subgraph=0, value=0.25)
    wf = widgets(wf, 74, subgraph=0, width=32, height=32)
    (job,) = compile_workflow(wf, target).jobs
    assert job.request["node_params"]["denoise"]["sampler"] == "flow-euler"
    native = _wan22_native(wf, steps)
    assert job.request == native
    got = _run(rt, job.request)
    want = _run(rt, native)
    assert torch.equal(got.artifacts["video"].frames, want.artifacts["video"].frames)
    wf = widgets(wf, 114, subgraph=0, value=7)  # 7 does not divide 1000: 'simple' rounds to the table there
    with pytest.raises(WorkflowError) as exc:
        compile_workflow(wf, target)
    assert "divides" in exc.value.summary()
