"""Runtime.update_weights / weights_checksum / sleep / wake on the tiny FLUX.1 checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.request import EventKind
from omniloop.runtime import Runtime
from omniloop.weights import RuntimeAsleep, WeightUpdateError


@pytest.fixture(scope="module")
def new_weights(rl_ckpt, tmp_path_factory):
    """(tensors, a checkpoint folder holding them): every transformer weight perturbed."""
    src = rl_ckpt("flux")
    sd = load_file(str(src / "transformer" / "diffusion_pytorch_model.safetensors"))
    g = torch.Generator().manual_seed(0)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in sd.items()}
    dst = tmp_path_factory.mktemp("flux-updated") / "ckpt"
    shutil.copytree(src, dst)
    save_file(new, str(dst / "transformer" / "diffusion_pytorch_model.safetensors"))
    return new, dst


def outputs(rt: Runtime, req) -> tuple[torch.Tensor, torch.Tensor]:
    out = rt.generate(req)
    assert out.ok, out.error
    return out.artifacts["latents"].tensor, out.artifacts["image"].pixels


@pytest.mark.parametrize("how", ["tensors", "file", "folder"])
def test_update_equals_a_fresh_load(fresh_runtime, rl_ckpt, new_weights, make_request, how):
    tensors, updated = new_weights
    ref_rt = fresh_runtime(updated)
    ref = outputs(ref_rt, make_request("flux"))
    rt = fresh_runtime(rl_ckpt("flux"))
    before = outputs(rt, make_request("flux"))
    assert not torch.equal(before[0], ref[0])
    source = {"tensors": tensors, "file": updated / "transformer" / "diffusion_pytorch_model.safetensors",
              "folder": updated / "transformer"}[how]
    checksum = rt.update_weights(source, version="v1")
    assert checksum == rt.weights_checksum() == ref_rt.weights_checksum()
    after = rt.generate(make_request("flux"))
    assert after.metrics["weight_version"] == "v1"
    assert torch.equal(after.artifacts["latents"].tensor, ref[0]) and torch.equal(after.artifacts["image"].pixels, ref[1])
    # rollouts run on the new weights too, and say so
    tr = rt.generate(make_request("flux", rollout={"kind": "sde"})).artifacts["trajectory"]
    assert tr.weight_version == "v1"


@pytest.mark.parametrize("bad,path", [
    (lambda t: {**t, "no.such.weight": torch.zeros(3)}, "source.no.such.weight"),
    (lambda t: {**t, next(iter(sorted(t))): torch.zeros(7, 7)}, "source."),
    (lambda t: {**t, sorted(t)[-1]: torch.full_like(t[sorted(t)[-1]], float("nan"))}, "source."),
    (lambda t: {**t, sorted(t)[0]: "not a tensor"}, "source."),
    (lambda t: {}, "source"),
    (lambda t: "/no/such/file.safetensors", "source"),
    (lambda t: 42, "source"),
])
def test_failing_update_changes_nothing(fresh_runtime, rl_ckpt, new_weights, make_request, bad, path):
    """Atomic: every tensor is checked before any is copied (good tensors sort before the bad one)."""
    tensors, _ = new_weights
    rt = fresh_runtime(rl_ckpt("flux"))
    before, checksum, version = outputs(rt, make_request("flux")), rt.weights_checksum(), rt.weight_version
    with pytest.raises(WeightUpdateError) as info:
        rt.update_weights(bad(dict(tensors)), version="v-bad")
    assert info.value.path.startswith(path), info.value
    assert rt.weights_checksum() == checksum and rt.weight_version == version
    after = outputs(rt, make_request("flux"))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def test_bad_version_refused(fresh_runtime, rl_ckpt, new_weights):
    rt = fresh_runtime(rl_ckpt("flux"))
    with pytest.raises(WeightUpdateError) as info:
        rt.update_weights(new_weights[0], version="../etc")
    assert info.value.path == "version"


def test_in_flight_requests_finish_on_their_version(fresh_runtime, rl_ckpt, new_weights, make_request):
    """The call waits: a request that has started finishes on the weights it started with (the
    update drives it to the end first); a request submitted after the update runs on the new ones."""
    tensors, updated = new_weights
    old_ref = outputs(fresh_runtime(rl_ckpt("flux")), make_request("flux", steps=6))
    new_ref = outputs(fresh_runtime(updated), make_request("flux", steps=6))
    rt = fresh_runtime(rl_ckpt("flux"), step=True)
    first_version = rt.weight_version
    events = rt.stream(make_request("flux", steps=6))
    while next(events).kind is not EventKind.PROGRESS:  # the request is in its denoise loop
        pass
    assert rt.in_flight == 1
    rt.update_weights(tensors, version="v2")
    assert rt.in_flight == 0
    final = next(ev for ev in events if ev.kind is EventKind.FINAL).output
    assert final.metrics["weight_version"] == first_version
    assert torch.equal(final.artifacts["latents"].tensor, old_ref[0])
    later = rt.generate(make_request("flux", steps=6))
    assert later.metrics["weight_version"] == "v2"
    assert torch.equal(later.artifacts["latents"].tensor, new_ref[0])


def test_sleep_wake_round_trip(fresh_runtime, rl_ckpt, make_request):
    rt = fresh_runtime(rl_ckpt("flux"))
    before, checksum = outputs(rt, make_request("flux", rollout={"kind": "sde"})), rt.weights_checksum()
    queued = rt.prepare(make_request("flux"))  # prepared before the sleep, started after it
    moved = rt.sleep()
    assert moved > 0 and rt.asleep
    failed = queued.run()
    assert not failed.ok and "sleep" in failed.error.message and rt.in_flight == 0
    assert all(p.numel() == 0 for p in rt.model.components["transformer"].parameters())
    with pytest.raises(RuntimeAsleep):
        rt.generate(make_request("flux"))
    rt.wake()
    assert not rt.asleep and rt.weights_checksum() == checksum
    after = outputs(rt, make_request("flux", rollout={"kind": "sde"}))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def _lora_file(rt: Runtime, path: Path, rank: int = 4, seed: int = 0) -> Path:
    tf = rt.model.components["transformer"]
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, mod in tf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.endswith(("attn.to_q", "attn.to_v")):
            sd[f"transformer.{name}.lora_A.weight"] = 0.3 * torch.randn(rank, mod.in_features, generator=g)
            sd[f"transformer.{name}.lora_B.weight"] = 0.3 * torch.randn(mod.out_features, rank, generator=g)
    save_file(sd, str(path))
    return path


def test_lora_adapter_update(fresh_runtime, rl_ckpt, make_request, tmp_path):
    """update_weights(file, adapter=NAME): requests name it like a deploy's adapter (same outputs as
    one declared at load); replacing it changes the checksum; a bad file changes nothing."""
    rt = fresh_runtime(rl_ckpt("flux"))
    base = outputs(rt, make_request("flux"))
    lora = _lora_file(rt, tmp_path / "a.safetensors")
    c0 = rt.weights_checksum()
    c1 = rt.update_weights(lora, version="lora-1", adapter="policy")
    assert c1 != c0
    req = {**make_request("flux"), "adapters": [{"name": "policy"}]}
    got = outputs(rt, req)
    assert not torch.equal(got[0], base[0])
    declared = fresh_runtime(rl_ckpt("flux"), adapters={"policy": str(lora)})
    assert torch.equal(outputs(declared, req)[0], got[0])
    assert torch.equal(outputs(rt, make_request("flux"))[0], base[0])  # without the adapter: the base model
    lora2 = _lora_file(rt, tmp_path / "b.safetensors", seed=1)
    c2 = rt.update_weights(lora2, version="lora-2", adapter="policy")
    assert c2 not in (c0, c1)
    bad = tmp_path / "bad.safetensors"
    save_file({"transformer.nope.lora_A.weight": torch.zeros(2, 3), "transformer.nope.lora_B.weight": torch.zeros(3, 2)}, str(bad))
    with pytest.raises(WeightUpdateError) as info:
        rt.update_weights(bad, version="lora-3", adapter="policy")
    assert info.value.path == "source" and rt.weights_checksum() == c2 and rt.weight_version == "lora-2"


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_fused_qkv_deployments_refuse_updates(fresh_runtime, rl_ckpt, new_weights, family):
    """``options.qkv: fused`` keeps a concatenated copy of to_q/to_k/to_v: an update would leave it stale,
    so the family's ``weight_update_refusal`` refuses it (weights and run-time adapters alike), naming the
    option; nothing changes. The same runtime with ``qkv: separate`` takes updates."""
    rt = fresh_runtime(rl_ckpt(family), family=family, options={"qkv": "fused"})
    checksum = rt.weights_checksum()
    tensors = new_weights[0] if family == "flux" else {"blocks.0.attn1.to_q.weight": torch.zeros(1)}
    with pytest.raises(WeightUpdateError, match=r"options\.qkv 'fused' computes Q/K/V from a concatenated copy") as info:
        rt.update_weights(tensors, version="v2")
    assert info.value.path == "source" and rt.weights_checksum() == checksum and rt.weight_version != "v2"
    with pytest.raises(WeightUpdateError, match=r"options\.qkv 'fused'"):
        rt.update_weights("/no/such/adapter.safetensors", version="v3", adapter="late")
    if family == "flux":
        plain = fresh_runtime(rl_ckpt(family), family=family)
        assert plain.update_weights(tensors, version="v2", checksum=False) is None and plain.weight_version == "v2"
