"""The compiler on hand-written graphs: chains (LoRA, img2img, Wan i2v, Wan 2.2's two experts),
fan-out, several chains, editor-format features, bad input as node errors, the sampler table
checked against the families' samplers, and the files written as ComfyUI writes them."""

from __future__ import annotations

import base64
import io
import json
import math

import attrs
import numpy as np
import pytest
import torch

from omniloop.runtime import Runtime
from omniloop_comfyui import Target, WorkflowError, check_workflow, compile_workflow, to_api_format
from omniloop_comfyui.compiler import FAMILIES, SAMPLER_TABLE


def flux_graph(**ks):
    sampler = {"seed": 5, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
               "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], **ks}
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux1-schnell.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": sampler},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "fox"}},
    }


def errors_of(graph, target=None):
    with pytest.raises(WorkflowError) as exc:
        compile_workflow(graph, target)
    return exc.value


def test_fan_out_and_two_chains():
    g = flux_graph()
    g["8"] = {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}}
    g["9"] = {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["6", 0], "filename_prefix": "sub/fox", "fps": 8.0,
                                                            "lossless": True, "quality": 90, "method": "default"}}
    g["15"] = {"class_type": "KSampler", "inputs": {**g["5"]["inputs"], "seed": 6}}
    g["16"] = {"class_type": "VAEDecode", "inputs": {"samples": ["15", 0], "vae": ["1", 2]}}
    g["17"] = {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": "other"}}
    g["20"] = {"class_type": "KSampler", "inputs": {**g["5"]["inputs"], "seed": 99}}  # feeds no output: not run
    out = compile_workflow(g)
    assert [j.key for j in out.jobs] == ["5", "15"]
    assert [(s.node_id, s.kind, s.temp) for s in out.jobs[0].saves] == [("7", "image", False), ("8", "image", True),
                                                                       ("9", "webp", False)]
    assert [j.request["diffusion"]["seed"] for j in out.jobs] == [5, 6]
    report = {r.node_id: r.status for r in out.report}
    assert report["20"] == "ignored" and report["5"] == "mapped"


def test_lora_chain_and_aliases():
    g = flux_graph()
    g["10"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": "style.safetensors",
                                                      "strength_model": 0.8, "strength_clip": 0.8}}
    g["11"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["10", 0], "lora_name": "detail",
                                                               "strength_model": 0.5}}
    g["5"]["inputs"]["model"] = ["11", 0]
    g["2"]["inputs"]["clip"] = ["10", 1]
    t = Target(model="fluxy", family="flux", tasks=frozenset({"t2i", "i2i"}), models={"flux1-schnell.safetensors": "fluxy"},
               loras={"style.safetensors": "style"}, adapters=frozenset({"style", "detail"}), guidance_embeds=False)
    (job,) = compile_workflow(g, t).jobs
    assert job.request["adapters"] == [{"name": "style", "scale": 0.8}, {"name": "detail", "scale": 0.5}]
    g["10"]["inputs"]["strength_clip"] = 0.3  # served adapters have no text-encoder weights (the core refuses them)
    assert compile_workflow(g, t).jobs[0].request["adapters"][0] == {"name": "style", "scale": 0.8}
    g["11"]["inputs"]["lora_name"] = "nope.safetensors"
    e = errors_of(g, t).node_errors["11"]["errors"][0]
    assert e["type"] == "value_not_in_list" and e["extra_info"]["input_name"] == "lora_name"
    g["11"]["inputs"]["lora_name"] = "detail"
    g["1"]["inputs"]["ckpt_name"] = "another.safetensors"
    e = errors_of(g, t).node_errors["1"]["errors"][0]
    assert e["extra_info"]["input_name"] == "ckpt_name" and "another.safetensors" in e["message"]


@pytest.mark.parametrize("change, node, kind", [
    ({"steps": 0}, "5", "value_smaller_than_min"),
    ({"cfg": "high"}, "5", "invalid_input_type"),
    ({"cfg": float("nan")}, "5", "invalid_input_type"),
    ({"seed": 2**63}, "5", "value_bigger_than_max"),  # ComfyUI's range, but omniloop seeds are 63-bit
    ({"sampler_name": "dpmpp_2m"}, "5", "unsupported"),  # a ComfyUI sampler without a same-math omniloop one
    ({"scheduler": "warp"}, "5", "value_not_in_list"),
    ({"steps": 3}, "5", "unsupported"),  # 'simple' on FLUX.1 rounds to the 10000-entry table unless steps | 10000
    ({"model": ["2", 0]}, "5", "return_type_mismatch"),
    ({"model": ["77", 0]}, "5", "dangling_link"),
    ({"model": ["1", 5]}, "5", "dangling_link"),
    ({"positive": "text"}, "5", "invalid_input_type"),
])
def test_bad_inputs_are_node_errors(change, node, kind):
    g = flux_graph()
    g[node]["inputs"].update(change)
    err = errors_of(g)
    assert err.type == "prompt_outputs_failed_validation"
    assert kind in {e["type"] for e in err.node_errors[node]["errors"]}, err.body()
    assert err.node_errors[node]["dependent_outputs"] == ["7"]


@pytest.mark.parametrize("prefix", ["../x", "/abs", "a/../../b", ".hidden", "a\\b", "x\x00y", "a/b/c/d/e/f/g"])
def test_paths_in_file_names(prefix):
    g = flux_graph()
    g["7"]["inputs"]["filename_prefix"] = prefix
    assert "7" in errors_of(g).node_errors
    g = flux_graph()
    g["1"]["inputs"]["ckpt_name"] = prefix
    assert "1" in errors_of(g).node_errors or prefix == "a/b/c/d/e/f/g"


def test_whole_prompt_errors():
    assert errors_of({}).type == "invalid_prompt"
    assert errors_of([1]).type == "invalid_prompt"
    err = errors_of({**flux_graph(), "42": {"class_type": "FancyCustomNode", "inputs": {}}})
    assert err.type == "missing_node_type" and err.extra_info["node_id"] == "42" and not err.node_errors
    g = flux_graph()
    del g["7"]
    assert errors_of(g).type == "prompt_no_outputs"
    g = flux_graph()
    g["4"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["6", 0], "vae": ["1", 2]}}
    err = errors_of(g)
    assert {e["type"] for n in err.node_errors.values() for e in n["errors"]} == {"dependency_cycle"}


def test_editor_format_features():
    wf = {"nodes": [
        {"id": 1, "type": "CheckpointLoaderSimple", "mode": 0, "widgets_values": ["flux1-schnell.safetensors"],
         "inputs": [], "outputs": [{"type": "MODEL", "links": [1]}, {"type": "CLIP", "links": [2, 3]}, {"type": "VAE", "links": [4]}]},
        {"id": 2, "type": "CLIPTextEncode", "mode": 0, "widgets_values": ["a red fox"], "inputs": [{"name": "clip", "link": 2}]},
        {"id": 3, "type": "CLIPTextEncode", "mode": 0, "widgets_values": [""], "inputs": [{"name": "clip", "link": 3}]},
        {"id": 4, "type": "EmptySD3LatentImage", "mode": 0, "widgets_values": [64, 64, 1], "inputs": []},
        {"id": 20, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 1}], "outputs": [{"type": "MODEL"}]},
        {"id": 21, "type": "ModelSamplingSD3", "mode": 4, "widgets_values": [9.0],
         "inputs": [{"name": "model", "type": "MODEL", "link": 10}], "outputs": [{"type": "MODEL"}]},
        {"id": 22, "type": "PrimitiveNode", "mode": 0, "widgets_values": [1234, "fixed"], "outputs": [{"type": "INT"}]},
        {"id": 5, "type": "KSampler", "mode": 0, "widgets_values": [1, "randomize", 4, 1.0, "euler", "simple", 1.0],
         "inputs": [{"name": "model", "link": 11}, {"name": "positive", "link": 5}, {"name": "negative", "link": 6},
                    {"name": "latent_image", "link": 7}, {"name": "seed", "widget": {"name": "seed"}, "link": 12}]},
        {"id": 6, "type": "VAEDecode", "mode": 0, "inputs": [{"name": "samples", "link": 8}, {"name": "vae", "link": 4}]},
        {"id": 7, "type": "SaveImage", "mode": 0, "widgets_values": ["fox"], "inputs": [{"name": "images", "link": 9}]},
        {"id": 8, "type": "SaveImage", "mode": 2, "widgets_values": ["muted"], "inputs": [{"name": "images", "link": 13}]},
        {"id": 9, "type": "Note", "mode": 0, "widgets_values": ["hello"]},
    ], "links": [[1, 1, 0, 20, 0, "MODEL"], [2, 1, 1, 2, 0, "CLIP"], [3, 1, 1, 3, 0, "CLIP"], [4, 1, 2, 6, 1, "VAE"],
                 [10, 20, 0, 21, 0, "MODEL"], [11, 21, 0, 5, 0, "MODEL"], [5, 2, 0, 5, 1, "CONDITIONING"],
                 [6, 3, 0, 5, 2, "CONDITIONING"], [7, 4, 0, 5, 3, "LATENT"], [12, 22, 0, 5, 4, "INT"],
                 [8, 5, 0, 6, 0, "LATENT"], [9, 6, 0, 7, 0, "IMAGE"], [13, 6, 0, 8, 0, "IMAGE"]]}
    api = to_api_format(wf)
    assert set(api) == {"1", "2", "3", "4", "5", "6", "7"}  # reroute, bypassed, primitive, muted, note gone
    assert api["5"]["inputs"]["model"] == ["1", 0] and api["5"]["inputs"]["seed"] == 1234
    assert api["5"]["inputs"]["steps"] == 4 and api["5"]["inputs"]["scheduler"] == "simple"
    (job,) = compile_workflow(wf).jobs
    assert job.request["diffusion"]["seed"] == 1234 and job.request["diffusion"]["shift"] == math.e  # no shift 9


def test_sampler_table_matches_the_families(tiny, family_manager):
    """FAMILIES[...]["schedule"] is what each family's flow-euler sampler does."""
    import omniloop_flux.policies as fp
    import omniloop_sd3.policies as sp
    import omniloop_wan.policies as wp

    for fam, ckpt, menu in (("flux", tiny("flux", "schnell"), lambda m: fp.menu_for(m)),
                            ("sd3", tiny("sd3", "sd35-medium"), lambda m: sp.menu_for(m, "t2i")),
                            ("wan", tiny("wan", "t2v"), lambda m: wp.menu_for(m))):
        rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager(fam))
        sampler = menu(rt.model).samplers["flow-euler"]
        want = {"linear": "linear", "default": None}[FAMILIES[fam]["schedule"]]
        assert sampler.sigma_schedule == want, fam
    assert set(SAMPLER_TABLE.values()) == {("flow-euler", "default"), ("flow-euler", "linear"),
                                           ("flow-euler", "sgm_uniform")}


def test_comfy_normal_equals_diffusers_spacing():
    """ComfyUI's ``normal`` scheduler on a discrete-flow model (its formula, written out here) is
    FlowMatchEulerDiscreteScheduler's default spacing; ``simple`` is the linear one."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shift, n = 8.0, 7
    snr = lambda t: shift * t / (1 + (shift - 1) * t)  # noqa: E731  ComfyUI's time_snr_shift
    table = torch.tensor([snr(k / 1000) for k in range(1, 1001)], dtype=torch.float64)
    start, end = table[-1].item() * 1000, table[0].item() * 1000
    normal = [snr(t / 1000) for t in torch.linspace(start, end, n, dtype=torch.float64).tolist()] + [0.0]
    s = FlowMatchEulerDiscreteScheduler(shift=shift)
    s.set_timesteps(n)
    assert np.allclose(s.sigmas.numpy(), normal, atol=2e-6)
    n = 4
    simple = [table[-(1 + int(x * 1000 / n))].item() for x in range(n)] + [0.0]
    s = FlowMatchEulerDiscreteScheduler(shift=shift)
    s.set_timesteps(n, sigmas=np.linspace(1.0, 1 / n, n))
    assert np.allclose(s.sigmas.numpy(), simple, atol=2e-6)


def test_comfy_sgm_uniform_equals_the_sgm_uniform_sampler():
    """ComfyUI's ``sgm_uniform`` on a discrete-flow model (its formula, written out) is the
    ``flow-euler`` sampler's ``sigma_schedule="sgm_uniform"``."""
    from omniloop_policies.samplers import FlowEulerSampler

    for shift, n in ((3.0, 5), (8.0, 20)):
        snr = lambda t, s=shift: s * t / (1 + (s - 1) * t)  # noqa: E731  ComfyUI's time_snr_shift
        start, end = 1000 * snr(1.0), 1000 * snr(1 / 1000)
        sgm = [snr(t / 1000) for t in np.linspace(start, end, n + 1)[:-1]] + [0.0]
        sampler = FlowEulerSampler.from_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0},
                                               sigma_schedule="sgm_uniform")
        st = sampler.init(n, shift=shift)
        assert np.allclose(st.sigma_values, sgm, atol=2e-6)
    from omniloop_policies import PolicyError
    from omniloop_policies.samplers import UniPCSampler

    with pytest.raises(PolicyError, match="sgm_uniform"):  # only FlowMatchEuler has the training-grid sigma_min
        UniPCSampler.from_config({"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
                                  "use_flow_sigmas": True, "flow_shift": 3.0}, sigma_schedule="sgm_uniform")


def _png_b64(w, h, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_img2img_runs_as_the_native_request(tiny, family_manager, tmp_path):
    ckpt = tiny("flux", "schnell")
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("flux"))
    (tmp_path / "in").mkdir()
    data = _png_b64(64, 64)
    (tmp_path / "in" / "cat.png").write_bytes(data)
    g = flux_graph(denoise=0.5, steps=2)
    g["1"]["inputs"]["ckpt_name"] = ckpt.name
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": "cat.png"}}
    g["4"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["1", 2]}}
    t = Target.from_runtime(rt, model=ckpt.name, input_dir=tmp_path / "in")
    (job,) = compile_workflow(g, t).jobs
    d, dn = job.request["diffusion"], job.request["node_params"]["denoise"]
    assert job.request["task"] == "i2i" and d["steps"] == 4 and dn["strength"] == 0.5  # ComfyUI: 2 of a 4-step schedule
    native = {"task": "i2i", "inputs": [{"type": "text", "text": "a red fox"},
                                        {"type": "image", "data_b64": base64.b64encode(data).decode()}],
              "diffusion": {"seed": 5, "steps": 4, "width": 64, "height": 64, "shift": math.e},
              "node_params": {"denoise": {"sampler": "flow-euler", "strength": 0.5}}}
    a, b = rt.generate(job.request), rt.generate(native)
    assert a.ok and torch.equal(a.artifacts["image"].pixels, b.artifacts["image"].pixels)
    g["5"]["inputs"]["denoise"] = 0.0  # no step would run
    assert errors_of(g, t).node_errors["5"]["errors"][0]["extra_info"]["input_name"] == "denoise"
    g["5"]["inputs"]["denoise"] = 0.5
    g["20"]["inputs"]["image"] = "../in/cat.png"
    assert "20" in errors_of(g, t).node_errors


def test_wan22_two_experts(tiny, family_manager):
    ckpt = tiny("wan", "wan22")
    aliases = {"high.safetensors": ckpt.name, "low.safetensors": ckpt.name, "te.safetensors": ckpt.name,
               "vae.safetensors": ckpt.name}
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("wan"),
                            comfyui={"models": aliases})
    t = Target.from_runtime(rt, model=ckpt.name)
    assert t.boundary_ratio is not None
    from omniloop_comfyui.compiler import _switch_step

    steps = 6
    k = _switch_step(t.scheduler, 8.0, steps, t.boundary_ratio)
    assert 0 < k < steps

    def adv(model, latent, start, end, noise, leftover, cfg):
        return {"class_type": "KSamplerAdvanced", "inputs": {
            "model": model, "add_noise": noise, "noise_seed": 3, "steps": steps, "cfg": cfg, "sampler_name": "euler",
            "scheduler": "normal", "positive": ["6", 0], "negative": ["7", 0], "latent_image": latent,
            "start_at_step": start, "end_at_step": end, "return_with_leftover_noise": leftover}}

    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "high.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": "low.safetensors", "weight_dtype": "default"}},
        "3": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 8.0}},
        "4": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 8.0}},
        "5": {"class_type": "CLIPLoader", "inputs": {"clip_name": "te.safetensors", "type": "wan"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox", "clip": ["5", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["5", 0]}},
        "8": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 5, "batch_size": 1}},
        "9": adv(["3", 0], ["8", 0], 0, k, "enable", "enable", 4.0),
        "10": adv(["4", 0], ["9", 0], k, 10000, "disable", "disable", 3.0),
        "11": {"class_type": "VAELoader", "inputs": {"vae_name": "vae.safetensors"}},
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["11", 0]}},
        "13": {"class_type": "SaveWEBM", "inputs": {"images": ["12", 0], "filename_prefix": "fox", "codec": "vp9",
                                                    "fps": 16.0, "crf": 32.0}},
    }
    (job,) = compile_workflow(g, t).jobs
    native = {"task": "t2v", "inputs": [{"type": "text", "text": "a fox", "role": "prompt"},
                                        {"type": "text", "text": "blurry", "role": "negative_prompt"}],
              "diffusion": {"seed": 3, "steps": steps, "width": 32, "height": 32, "frames": 5, "shift": 8.0,
                            "guidance_scale": 4.0, "fps": 16.0},
              "node_params": {"denoise": {"sampler": "flow-euler", "guidance_scale_2": 3.0}}}
    assert job.request == native and job.nodes[:2] == ["9", "10"]
    a, b = rt.generate(job.request), rt.generate(native)
    assert a.ok and torch.equal(a.artifacts["video"].frames, b.artifacts["video"].frames)
    g["9"]["inputs"]["end_at_step"] = g["10"]["inputs"]["start_at_step"] = k + 1
    err = errors_of(g, t).node_errors["9"]["errors"][0]
    assert f"end_at_step {k}" in err["message"]


def test_check_report():
    g = flux_graph()
    g["5"]["inputs"]["sampler_name"] = "dpmpp_2m"
    rows, err = check_workflow(g)
    assert err is not None
    status = {r.node_id: r.status for r in rows}
    assert status["5"] == "unsupported" and status["1"] == "mapped"


def test_saved_files_like_comfyui(tmp_path):
    from PIL import Image

    from omniloop_comfyui.compiler import SaveSpec
    from omniloop_comfyui.save import comfy_image, to_bytes, write_save

    u8 = torch.arange(256, dtype=torch.uint8).repeat(3, 1).T.reshape(16, 16, 3)
    assert np.array_equal(to_bytes(comfy_image(u8))[0], u8.numpy())  # ComfyUI's conversion is exact on our bytes
    frames = torch.stack([u8, u8.flip(0)])
    (png,) = write_save(SaveSpec("7", "SaveImage", "image", "a/b", {}), frames[:1], 0.0, tmp_path,
                        prompt={"7": {}}, extra_pnginfo={"workflow": {"x": 1}})
    assert png == {"filename": "b_00001_.png", "subfolder": "a", "type": "output"}
    with Image.open(tmp_path / "a" / "b_00001_.png") as im:
        assert json.loads(im.info["prompt"]) == {"7": {}} and json.loads(im.info["workflow"]) == {"x": 1}
    (again,) = write_save(SaveSpec("7", "SaveImage", "image", "a/b", {}), frames[:1], 0.0, tmp_path)
    assert again["filename"] == "b_00002_.png"
    opts = {"fps": 8.0, "lossless": True, "quality": 80, "method": "default"}
    (webp,) = write_save(SaveSpec("9", "SaveAnimatedWEBP", "webp", "w", opts), frames, 8.0, tmp_path)
    with Image.open(tmp_path / webp["filename"]) as im:
        got = []
        for i in range(im.n_frames):
            im.seek(i)
            got.append(np.asarray(im.convert("RGB")))
    assert np.array_equal(np.stack(got), frames.numpy())  # lossless honoured


def test_wan_image_to_video(tiny, family_manager, tmp_path):
    ckpt = tiny("wan", "i2v")
    aliases = {"wan_i2v.safetensors": ckpt.name, "te.safetensors": ckpt.name, "vae.safetensors": ckpt.name,
               "clip_vision_h.safetensors": ckpt.name}
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("wan"),
                            comfyui={"models": aliases})
    (tmp_path / "in").mkdir()
    data = _png_b64(32, 32, seed=1)
    (tmp_path / "in" / "start.png").write_bytes(data)
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan_i2v.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "te.safetensors", "type": "wan"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox turns", "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "static", "clip": ["2", 0]}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": "vae.safetensors"}},
        "6": {"class_type": "LoadImage", "inputs": {"image": "start.png"}},
        "7": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": "clip_vision_h.safetensors"}},
        "8": {"class_type": "CLIPVisionEncode", "inputs": {"clip_vision": ["7", 0], "image": ["6", 0], "crop": "none"}},
        "9": {"class_type": "WanImageToVideo", "inputs": {"positive": ["3", 0], "negative": ["4", 0], "vae": ["5", 0],
                                                          "width": 32, "height": 32, "length": 5, "batch_size": 1,
                                                          "clip_vision_output": ["8", 0], "start_image": ["6", 0]}},
        "10": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 4, "steps": 2, "cfg": 5.0,
                                                    "sampler_name": "euler", "scheduler": "normal", "positive": ["9", 0],
                                                    "negative": ["9", 1], "latent_image": ["9", 2], "denoise": 1.0}},
        "11": {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["5", 0]}},
        "12": {"class_type": "CreateVideo", "inputs": {"images": ["11", 0], "fps": 16.0}},
        "13": {"class_type": "SaveVideo", "inputs": {"video": ["12", 0], "filename_prefix": "video/fox", "format": "auto",
                                                     "codec": "auto"}},
        "14": {"class_type": "SaveWEBM", "inputs": {"images": ["11", 0], "filename_prefix": "fox", "codec": "vp9",
                                                    "fps": 16.0, "crf": 32.0}},
    }
    t = Target.from_runtime(rt, model=ckpt.name, input_dir=tmp_path / "in")
    (job,) = compile_workflow(g, t).jobs
    native = {"task": "i2v", "inputs": [{"type": "text", "text": "a fox turns", "role": "prompt"},
                                        {"type": "image", "data_b64": base64.b64encode(data).decode(), "role": "first_frame"},
                                        {"type": "text", "text": "static", "role": "negative_prompt"}],
              "diffusion": {"seed": 4, "steps": 2, "width": 32, "height": 32, "frames": 5, "shift": 8.0,
                            "guidance_scale": 5.0, "fps": 16.0},
              "node_params": {"denoise": {"sampler": "flow-euler"}}}
    assert job.request == native
    a, b = rt.generate(job.request), rt.generate(native)
    assert a.ok and torch.equal(a.artifacts["video"].frames, b.artifacts["video"].frames)
    from omniloop_comfyui.save import write_job_outputs

    files = write_job_outputs(job, a, tmp_path / "out")
    assert files["13"]["images"][0]["filename"] == "fox_00001_.mp4" and files["13"]["images"][0]["subfolder"] == "video"
    webm = tmp_path / "out" / files["14"]["images"][0]["filename"]
    import av

    with av.open(str(webm)) as c:
        assert c.streams.video[0].codec_context.name in ("vp9", "libvpx-vp9") and len(list(c.decode(video=0))) == 5


def test_second_pass_on_the_first_jobs_image(tiny, family_manager):
    """t2i, then img2img on its decoded image: two requests, the second fed the first's output."""
    ckpt = tiny("flux", "schnell")
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("flux"))
    g = flux_graph(steps=2)
    g["1"]["inputs"]["ckpt_name"] = ckpt.name
    del g["7"]  # the first image is not saved: only the second pass needs it
    g["20"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["6", 0], "vae": ["1", 2]}}
    g["21"] = {"class_type": "KSampler", "inputs": {**g["5"]["inputs"], "latent_image": ["20", 0], "denoise": 0.5,
                                                    "seed": 8}}
    g["22"] = {"class_type": "VAEDecode", "inputs": {"samples": ["21", 0], "vae": ["1", 2]}}
    g["23"] = {"class_type": "SaveImage", "inputs": {"images": ["22", 0], "filename_prefix": "second"}}
    first, second = compile_workflow(g, Target.from_runtime(rt, model=ckpt.name)).jobs
    assert (first.key, second.key, first.saves, second.inputs_from) == ("5", "21", [], {1: "5"})
    a = rt.generate(first.ready({}))
    b = rt.generate(second.ready({"5": a}))
    buf = io.BytesIO()
    from PIL import Image

    Image.fromarray(a.artifacts["image"].pixels.numpy()).save(buf, format="PNG")
    native = {"task": "i2i", "inputs": [{"type": "text", "text": "a red fox"},
                                        {"type": "image", "data_b64": base64.b64encode(buf.getvalue()).decode()}],
              "diffusion": {"seed": 8, "steps": 4, "width": 64, "height": 64, "shift": math.e},
              "node_params": {"denoise": {"sampler": "flow-euler", "strength": 0.5}}}
    assert b.ok and torch.equal(b.artifacts["image"].pixels, rt.generate(native).artifacts["image"].pixels)


def test_math_expression_is_arithmetic_only():
    from omniloop_comfyui.compiler import safe_math

    assert safe_math("floor(a * b) + 1", {"a": 5.0, "b": 16.0}) == 81
    assert safe_math("max(a, 2) ** 2 // 3", {"a": 1}) == 1
    for bad in ("__import__('os')", "a.__class__", "[1][0]", "9 ** 9999", "1 / 0", "lambda: 1", "x", "'s'", "a if a else b",
                "1e308 * 10"):
        with pytest.raises(ValueError):
            safe_math(bad, {"a": 1.0, "b": 2.0})


def test_switch_compiles_only_the_selected_branch():
    g = flux_graph()
    g["30"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "missing.safetensors",
                                                               "strength_model": 1.0}}
    g["31"] = {"class_type": "PrimitiveBoolean", "inputs": {"value": False}}
    g["32"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": ["31", 0], "on_false": ["1", 0], "on_true": ["30", 0]}}
    g["33"] = {"class_type": "PrimitiveInt", "inputs": {"value": 2}}
    g["34"] = {"class_type": "ComfyMathExpression", "inputs": {"expression": "a * 2", "values.a": ["33", 0]}}
    g["5"]["inputs"].update(model=["32", 0], steps=["34", 1])
    t = Target(model="m", family="flux", tasks=frozenset({"t2i"}), models={"flux1-schnell.safetensors": "m"},
               guidance_embeds=False)
    out = compile_workflow(g, t)
    assert out.jobs[0].request["diffusion"]["steps"] == 4 and "adapters" not in out.jobs[0].request
    assert {r.node_id: r.status for r in out.report}["30"] == "ignored"
    g["31"]["inputs"]["value"] = True
    assert "30" in errors_of(g, t).node_errors  # now selected: its unknown LoRA is an error
    g["34"]["inputs"]["expression"] = "a * 'x'"
    g["31"]["inputs"]["value"] = False
    assert errors_of(g, t).node_errors["34"]["errors"][0]["extra_info"]["input_name"] == "expression"


def test_served_flow_euler_options():
    """The checkpoint's omniloop.json / the deploy's sampler options decide what `euler` maps to:
    a linear spacing serves `simple`; stochastic sampling (wan-demo's default) serves no ComfyUI euler."""
    from omniloop_comfyui.compiler import _flow_euler_options

    assert _flow_euler_options("wan", {}, None) == {"flow_schedule": None, "flow_differs": None}
    assert _flow_euler_options("wan", {}, {"sampler_options": {"flow-euler": {"sigma_schedule": "linear"}}})["flow_schedule"] == "linear"
    demo = _flow_euler_options("wan", {"sampler_options": {"flow-euler": {"stochastic_sampling": True}}}, None)
    assert "stochastic_sampling" in demo["flow_differs"]
    off = {"sampler_options": {"flow-euler": {"stochastic_sampling": False}}}
    assert _flow_euler_options("wan", {"sampler_options": {"flow-euler": {"stochastic_sampling": True}}}, off)["flow_differs"] is None
    g = flux_graph()
    t = Target(model="m", family="flux", tasks=frozenset({"t2i"}), models={"flux1-schnell.safetensors": "m"},
               guidance_embeds=False, flow_differs="the served flow-euler sets stochastic_sampling=True")
    assert "stochastic_sampling" in errors_of(g, t).summary()


def test_model_sampling_flux(tiny, family_manager):
    """FLUX.1 [dev]: ModelSamplingFlux maps to the checkpoint's own resolution shift only where the
    token counts and shift parameters agree; without it ComfyUI's constant mu is refused."""
    ckpt = tiny("flux", "dev")
    rt = Runtime.from_model(ckpt, device="cpu", dtype="float32", manager=family_manager("flux"))
    t = Target.from_runtime(rt, model=ckpt.name)
    assert t.guidance_embeds is True and t.vae_scale is not None
    g = flux_graph(steps=4)
    g["1"]["inputs"]["ckpt_name"] = ckpt.name
    assert "ModelSamplingFlux" in errors_of(g, t).summary()
    g["8"] = {"class_type": "ModelSamplingFlux", "inputs": {"model": ["1", 0], "max_shift": 1.15, "base_shift": 0.5,
                                                            "width": 64, "height": 64}}
    g["5"]["inputs"]["model"] = ["8", 0]
    t8 = attrs.evolve(t, vae_scale=8, scheduler={**t.scheduler, "max_shift": 1.15, "base_shift": 0.5,
                                                 "base_image_seq_len": 256, "max_image_seq_len": 4096})
    (job,) = compile_workflow(g, t8).jobs
    assert "shift" not in job.request["diffusion"] and job.request["diffusion"]["guidance_scale"] == 3.5
    g["8"]["inputs"]["width"] = 128
    assert "differ from the latent" in errors_of(g, t8).summary()
    g["8"]["inputs"]["width"] = 64
    g["8"]["inputs"]["max_shift"] = 2.0
    assert "max_shift" in errors_of(g, t8).summary()
    if t.vae_scale != 8:  # the tiny VAE: ComfyUI's token count is not the checkpoint's
        g["8"]["inputs"]["max_shift"] = 1.15
        assert "tokens" in errors_of(g, attrs.evolve(t8, vae_scale=t.vae_scale)).summary()


def test_clip_text_encode_flux():
    g = flux_graph()
    g["2"] = {"class_type": "CLIPTextEncodeFlux", "inputs": {"clip": ["1", 1], "clip_l": "a fox", "t5xxl": "a fox",
                                                             "guidance": 4.0}}
    t = Target(model="m", family="flux", tasks=frozenset({"t2i"}), models={"flux1-schnell.safetensors": "m"},
               guidance_embeds=True, scheduler={"use_dynamic_shifting": False})
    (job,) = compile_workflow(g, t).jobs
    assert job.request["inputs"][0]["text"] == "a fox" and job.request["diffusion"]["guidance_scale"] == 4.0
    g["2"]["inputs"]["t5xxl"] = "a red fox in the snow"
    assert errors_of(g, t).node_errors["2"]["errors"][0]["extra_info"]["input_name"] == "t5xxl"


def test_partial_execution_targets():
    g = flux_graph()
    g["15"] = {"class_type": "KSampler", "inputs": {**g["5"]["inputs"], "seed": 6}}
    g["16"] = {"class_type": "VAEDecode", "inputs": {"samples": ["15", 0], "vae": ["1", 2]}}
    g["17"] = {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": "other"}}
    assert [j.key for j in compile_workflow(g, outputs=["17"]).jobs] == ["15"]
    g["5"]["inputs"]["steps"] = 0  # an error on a chain not asked for is not one
    assert [j.key for j in compile_workflow(g, outputs=["17"]).jobs] == ["15"]
    with pytest.raises(WorkflowError, match="not an output node"):
        compile_workflow(g, outputs=["5"])


def test_text_encoder_loader_type():
    g = flux_graph()
    g["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "flux1-schnell.safetensors", "weight_dtype": "default"}}
    g["20"] = {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors", "clip_name2": "t5.safetensors",
                                                          "type": "flux"}}
    g["21"] = {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}}
    g["2"]["inputs"]["clip"] = g["3"]["inputs"]["clip"] = ["20", 0]
    g["6"]["inputs"]["vae"] = ["21", 0]
    compile_workflow(g)
    g["20"]["inputs"]["type"] = "sdxl"
    e = errors_of(g).node_errors["20"]["errors"][0]
    assert e["type"] == "value_not_in_list" and e["extra_info"]["input_name"] == "type"
