"""Hostile graphs: whatever a client sends, the compiler answers a compiled prompt or a
WorkflowError whose body is ComfyUI's JSON shape — never another exception (a 500 on the server).
Generated with hypothesis from the node table (right and wrong classes, inputs, links, values),
in both formats; ``OMNILOOP_HOSTILE_COMFY_EXAMPLES`` raises the count."""

from __future__ import annotations

import json
import os

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniloop_comfyui import Target, WorkflowError, compile_workflow
from omniloop_comfyui.nodes import SPECS
from omniloop_comfyui.ui import to_api_format

N = int(os.environ.get("OMNILOOP_HOSTILE_COMFY_EXAMPLES", "200"))
CLASSES = [*sorted(SPECS), "Note", "Reroute", "PrimitiveNode", "Unknown", ""]
INPUT_NAMES = [*sorted({i.name for s in SPECS.values() for i in s.inputs}), "x", "__class__"]
scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.none(), st.text(max_size=20), st.sampled_from(["euler", "normal", "simple", "../x", "/etc/passwd", "a\x00b",
                                                      "flux1-schnell.safetensors", "enable", "disable", "default"]),
)
ids = st.sampled_from([str(i) for i in range(1, 8)] + ["x", "-10"])
links = st.tuples(ids, st.integers(min_value=-2, max_value=4)).map(list)
values = st.one_of(scalars, links, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))


@st.composite
def api_prompts(draw):
    n = draw(st.integers(min_value=0, max_value=8))
    prompt = {}
    for k in range(1, n + 1):
        ct = draw(st.sampled_from(CLASSES))
        spec = SPECS.get(ct)
        names = [i.name for i in spec.inputs] if spec else []
        inputs = {}
        for name in names:
            if draw(st.booleans()) or draw(st.booleans()):
                inputs[name] = draw(values)
        inputs.update(draw(st.dictionaries(st.sampled_from(INPUT_NAMES), values, max_size=2)))
        prompt[str(k)] = {"class_type": ct, "inputs": inputs} if draw(st.integers(0, 20)) else draw(values)
    return prompt


def _never_crashes(workflow, target=None):
    try:
        out = compile_workflow(workflow, target)
        json.dumps([j.request for j in out.jobs])
    except WorkflowError as exc:
        body = exc.body()
        json.dumps(body)
        assert set(body) == {"error", "node_errors"} and {"type", "message", "details", "extra_info"} <= set(body["error"])


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))
@given(api_prompts())
def test_api_format_never_crashes(prompt):
    _never_crashes(prompt)
    _never_crashes(prompt, Target(model="m", family="flux", tasks=frozenset({"t2i"}), guidance_embeds=False))


@st.composite
def ui_workflows(draw):
    nodes = []
    n = draw(st.integers(min_value=0, max_value=6))
    for k in range(1, n + 1):
        ct = draw(st.sampled_from(CLASSES))
        nodes.append({
            "id": k, "type": ct, "mode": draw(st.sampled_from([0, 0, 2, 4])),
            "widgets_values": draw(st.one_of(st.lists(scalars, max_size=8), st.none(),
                                             st.dictionaries(st.sampled_from(INPUT_NAMES), scalars, max_size=2))),
            "inputs": [{"name": draw(st.sampled_from(INPUT_NAMES)), "type": "*",
                        "link": draw(st.one_of(st.none(), st.integers(0, 12)))} for _ in range(draw(st.integers(0, 3)))],
            "outputs": [{"type": "*", "links": []}],
        })
    link_list = [[i, draw(st.integers(-20, 7)), draw(st.integers(-1, 3)), draw(st.integers(-20, 7)),
                  draw(st.integers(0, 3)), "*"] for i in range(draw(st.integers(0, 12)))]
    wf = {"nodes": nodes, "links": link_list}
    if draw(st.booleans()):
        wf["definitions"] = {"subgraphs": [{"id": "sg", "nodes": [dict(x, id=x["id"] + 100) for x in nodes[:2]],
                                            "links": [], "inputs": [{"name": "text"}], "outputs": []}]}
        nodes.append({"id": 99, "type": "sg", "inputs": [{"name": "text", "link": 1}], "outputs": [{"type": "*"}]})
    return wf


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))
@given(ui_workflows())
def test_editor_format_never_crashes(wf):
    try:
        to_api_format(wf)
    except WorkflowError:
        pass
    _never_crashes(wf)


def test_self_containing_subgraph_is_refused():
    wf = {"nodes": [{"id": 1, "type": "loop", "inputs": [], "outputs": []}], "links": [],
          "definitions": {"subgraphs": [{"id": "loop", "nodes": [{"id": 1, "type": "loop"}], "links": [],
                                         "inputs": [], "outputs": []}]}}
    try:
        compile_workflow(wf)
        raise AssertionError("compiled")
    except WorkflowError as exc:
        assert "nested deeper" in exc.message


def test_raw_bodies_on_the_server(tmp_path):
    """Mangled bodies at POST /prompt on a toy server: 4xx, never 5xx."""
    from omniloop.testing import build_toy_checkpoint, toy_runtime
    from omniloop_comfyui.routes import comfyui_routes
    from omniloop_server.app import create_app
    from omniloop_server.testing import serving

    rt = toy_runtime(build_toy_checkpoint(tmp_path / "toy"))
    app = create_app(rt, output_dir=tmp_path / "out", route_extensions={"comfyui": comfyui_routes})
    bodies = [b"", b"\xff\xfe", b"NaN", b"{\"prompt\": NaN}", b"[" * 100000, b"{\"prompt\": {\"1\": {\"class_type\": 5}}}",
              json.dumps({"prompt": {"1": {"class_type": "KSampler", "inputs": {"steps": 1e999}}}}).encode(),
              json.dumps({"prompt": {}, "client_id": "../x"}).encode(), json.dumps({"prompt": {}, "extra_data": 3}).encode()]
    with serving(app) as url:
        for body in bodies:
            r = httpx.post(f"{url}/prompt", content=body, timeout=30)
            assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text[:200])
        r = httpx.post(f"{url}/prompt", json={"prompt": {"1": {"class_type": "SaveImage", "inputs": {}}}})
        assert r.status_code == 400 and r.json()["node_errors"]["1"]["errors"][0]["type"] == "required_input_missing"
        assert httpx.get(f"{url}/object_info").json()["KSampler"]["output"] == ["LATENT"]


def _bases():
    k = {"seed": 5, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
         "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0]}
    t2i = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux1-schnell.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": k},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "fox"}},
    }
    i2i = json.loads(json.dumps(t2i))
    i2i["8"] = {"class_type": "LoadImage", "inputs": {"image": "in.png"}}
    i2i["4"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["8", 0], "vae": ["1", 2]}}
    i2i["5"]["inputs"]["denoise"] = 0.5
    two = json.loads(json.dumps(t2i))
    two["9"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["6", 0], "vae": ["1", 2]}}
    two["10"] = {"class_type": "KSampler", "inputs": {**k, "latent_image": ["9", 0], "denoise": 0.5}}
    two["11"] = {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["1", 2]}}
    two["12"] = {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["11", 0], "filename_prefix": "w", "fps": 6.0,
                                                              "lossless": True, "quality": 80, "method": "default"}}
    adv = {"add_noise": "enable", "noise_seed": 1, "steps": 6, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal",
           "positive": ["2", 0], "negative": ["3", 0], "start_at_step": 0, "end_at_step": 3,
           "return_with_leftover_noise": "enable"}
    wan = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_t2v_high.safetensors", "weight_dtype": "default"}},
        "13": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_t2v_low.safetensors", "weight_dtype": "default"}},
        "14": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5.safetensors", "type": "wan"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox", "clip": ["14", 0]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blur", "clip": ["14", 0]}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 5, "batch_size": 1}},
        "15": {"class_type": "PrimitiveBoolean", "inputs": {"value": False}},
        "16": {"class_type": "ComfySwitchNode", "inputs": {"switch": ["15", 0], "on_false": ["1", 0], "on_true": ["13", 0]}},
        "17": {"class_type": "ComfyMathExpression", "inputs": {"expression": "a + 1", "values.a": 2}},
        "5": {"class_type": "KSamplerAdvanced", "inputs": {**adv, "model": ["16", 0], "latent_image": ["4", 0],
                                                           "end_at_step": ["17", 1]}},
        "10": {"class_type": "KSamplerAdvanced", "inputs": {**adv, "model": ["13", 0], "latent_image": ["5", 0],
                                                            "add_noise": "disable", "start_at_step": 3, "end_at_step": 10000,
                                                            "return_with_leftover_noise": "disable"}},
        "18": {"class_type": "VAELoader", "inputs": {"vae_name": "vae.safetensors"}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["18", 0]}},
        "19": {"class_type": "CreateVideo", "inputs": {"images": ["6", 0], "fps": 16.0}},
        "7": {"class_type": "SaveVideo", "inputs": {"video": ["19", 0], "filename_prefix": "video/x", "format": "auto",
                                                    "codec": "auto"}},
    }
    return [t2i, i2i, two, wan]


BASES = _bases()


@st.composite
def mutated(draw):
    g = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        nid = draw(st.sampled_from(sorted(g)))
        inputs = g[nid]["inputs"]
        if inputs and draw(st.integers(0, 9)):
            inputs[draw(st.sampled_from(sorted(inputs)))] = draw(values)
        else:
            inputs[draw(st.sampled_from(INPUT_NAMES))] = draw(values)
    return g


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_mutated_valid_graphs_never_crash(tmp_path_factory, g):
    from PIL import Image

    folder = tmp_path_factory.getbasetemp() / "hostile-in"
    if not (folder / "in.png").is_file():
        folder.mkdir(exist_ok=True)
        Image.new("RGB", (64, 64)).save(folder / "in.png")
    _never_crashes(g)
    _never_crashes(g, Target(model="m", family="flux", tasks=frozenset({"t2i", "i2i"}), guidance_embeds=False,
                             models={"flux1-schnell.safetensors": "m"}, input_dir=folder))


def test_the_bases_compile(tmp_path):
    """The mutation bases are valid (so the mutations start from graphs that reach every stage)."""
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "in.png")
    for g in BASES:
        compile_workflow(g, Target(input_dir=tmp_path))
