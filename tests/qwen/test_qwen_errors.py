"""Bad checkpoints fail at load with one CheckpointError naming the file (before weights load);
bad requests fail at prepare with one RequestError naming the field (before any compute)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from omniloop.errors import CheckpointError, DeployError, RequestError


def _edit_json(name: str, **changes) -> Callable[[Path], None]:
    def edit(p: Path) -> None:
        data = json.loads((p / name).read_text())
        data.update(changes)
        (p / name).write_text(json.dumps(data))
    return edit


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda p: (p / name).write_text(text)


def _remove(*names: str) -> Callable[[Path], None]:
    def rm(p: Path) -> None:
        for n in names:
            (p / n).unlink()
    return rm


CASES = {
    "config missing": (_remove("config.json"), "config.json: missing"),
    "config malformed": (_write("config.json", "{nope"), "config.json: malformed JSON"),
    "model type": (_edit_json("config.json", model_type="llama"), "config.json: model_type 'llama' is not supported"),
    "bad int": (_edit_json("config.json", hidden_size="64"), "config.json: hidden_size must be a positive integer"),
    "gqa": (_edit_json("config.json", num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
    "sliding": (_edit_json("config.json", use_sliding_window=True), "use_sliding_window=true is not supported"),
    "weights missing": (_remove("model.safetensors"), "model.safetensors: missing weights"),
    "weights corrupt": (_write("model.safetensors", "garbage"), "model.safetensors: cannot read safetensors header"),
    "shape mismatch": (_edit_json("config.json", intermediate_size=96), "has shape [128, 64], config.json implies [96, 64]"),
    "tensor missing": (_edit_json("config.json", num_hidden_layers=3), "tensor 'model.layers.2.self_attn.q_proj.weight' is missing"),
    "tokenizer missing": (_remove("tokenizer.json"), "tokenizer.json: missing tokenizer"),
    "tokenizer malformed": (_write("tokenizer.json", "[1,"), "tokenizer.json: malformed JSON"),
    "generation config": (_write("generation_config.json", "{"), "generation_config.json: malformed JSON"),
    "eos out of range": (_edit_json("generation_config.json", eos_token_id=[10**6]), "generation_config.json: eos_token_id"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_names_the_file(case, tiny_qwen, runtime_at, tmp_path, monkeypatch) -> None:
    edit, message = CASES[case]
    ckpt = Path(shutil.copytree(tiny_qwen("qwen3"), tmp_path / "ckpt"))
    edit(ckpt)
    import omniloop_qwen.family as fam

    def no_weights(*a, **k):  # validation must fail before anything loads
        raise AssertionError("weights were loaded before validation finished")

    monkeypatch.setattr(fam, "load_checkpoint", no_weights)
    with pytest.raises(CheckpointError) as err:
        runtime_at(ckpt, family="qwen")
    assert message in str(err.value)
    assert str(ckpt) in str(err.value)


def test_unrecognized_folder_is_a_deploy_error(tmp_path, runtime_at) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DeployError, match="no installed family recognizes"):
        runtime_at(tmp_path)


def test_bad_deploy_options(tiny_qwen, runtime_at) -> None:
    with pytest.raises(DeployError, match=r"options\.kv_block_size: must be a positive integer"):
        runtime_at(tiny_qwen("qwen2"), options={"kv_block_size": 0})
    with pytest.raises(DeployError, match="not both"):
        runtime_at(tiny_qwen("qwen2"), options={"kv_cache_tokens": 64, "kv_cache_gib": 0.1})


BAD_REQUESTS = {
    "empty prompt": ({"inputs": [{"type": "text", "text": "  "}]}, "inputs: a text part with a non-empty prompt"),
    "no input": ({"inputs": []}, "inputs: a text part"),
    "image": ({"inputs": [{"type": "text", "text": "x"}, {"type": "image", "path": "a.png"}]}, "inputs: a reason request takes text parts only"),
    "negative": ({"inputs": [{"type": "text", "text": "x"}, {"type": "text", "text": "y", "role": "negative_prompt"}]},
                 "no negative prompt"),
    "too long": ({"sampling": {"max_tokens": 5000}}, "sampling.max_tokens: 5000 new tokens"),
    "negative temperature": ({"sampling": {"temperature": -1.0}}, "sampling.temperature"),
    "nan temperature": ({"sampling": {"temperature": float("nan")}}, "sampling.temperature"),
    "top_p zero": ({"sampling": {"top_p": 0.0}}, "sampling.top_p"),
    "empty stop": ({"node_params": {"decode": {"stop": [""]}}}, "node_params.decode.stop.0"),
    "stop not str": ({"node_params": {"decode": {"stop": [3]}}}, "node_params.decode.stop"),
    "bad seed": ({"node_params": {"decode": {"seed": -1}}}, "node_params.decode.seed"),
    "unknown param": ({"node_params": {"decode": {"beams": 2}}}, "node_params.decode.beams"),
    "wrong task": ({"task": "t2v"}, "task: 't2v' is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_refused_before_compute(case, qwen_runtime) -> None:
    rt = qwen_runtime("qwen2")
    change, message = BAD_REQUESTS[case]
    r = {"task": "reason", "inputs": [{"type": "text", "text": "hello"}], **change}
    with pytest.raises(RequestError) as err:
        rt.prepare(r)
    assert message in str(err.value)


def test_request_larger_than_the_kv_pool_is_refused(tiny_qwen, runtime_at) -> None:
    rt = runtime_at(tiny_qwen("qwen2"), options={"kv_cache_tokens": 32, "kv_block_size": 8})
    with pytest.raises(RequestError, match="a 3-token prompt plus 38 new tokens needs 6 KV blocks; the pool holds 4"):
        rt.prepare({"task": "reason", "inputs": [{"type": "text", "text": "hello"}], "sampling": {"max_tokens": 38}})


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tiny_qwen, runtime_at, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_qwen("qwen2")
    ckpt = Path(shutil.copytree(src, tmp_path / "sharded"))
    (ckpt / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(ckpt, max_shard_size="100KB")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").is_file()
    r = {"task": "reason", "inputs": [{"type": "text", "text": "hello"}], "sampling": {"max_tokens": 6, "temperature": 0.0}}
    want = runtime_at(src).generate(r).artifacts["text"].token_ids
    assert runtime_at(ckpt).generate(r).artifacts["text"].token_ids == want
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[-1].name}: missing weight shard"):
        runtime_at(ckpt, family="qwen")


def test_weight_free_checks_through_deployment(tiny_qwen, monkeypatch) -> None:
    """``Deployment.check`` (front ends refuse bad requests before a model loads) runs the family's
    checks on ``inspect``: config, tensor headers and tokenizer only, never the weights."""
    import omniloop_qwen.family as fam
    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    from omniloop.runtime import Deployment
    from omniloop.testing import make_manager

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(fam, "load_checkpoint", no_weights)
    manager = make_manager(("qwen", qwen_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    dep = Deployment({"model": {"path": str(tiny_qwen("qwen2"))}, "options": {"kv_cache_tokens": 64}}, manager=manager)
    ok = dep.check({"task": "reason", "inputs": [{"type": "text", "text": "hello"}], "sampling": {"max_tokens": 8}})
    assert ok.sampling.max_tokens == 8
    with pytest.raises(RequestError, match="the pool holds 4"):
        dep.check({"task": "reason", "inputs": [{"type": "text", "text": "hello"}], "sampling": {"max_tokens": 100}})
    with pytest.raises(RequestError, match=r"node_params\.decode\.stop\.0"):
        dep.check({"task": "reason", "inputs": [{"type": "text", "text": "hi"}], "node_params": {"decode": {"stop": [""]}}})
