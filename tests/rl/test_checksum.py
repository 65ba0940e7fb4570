"""omniloop_rl.weights.checksum: the on-device ``mix128`` fingerprint against a pure-Python reference,
its sensitivity, and the ``sha256`` option (Runtime and the admin route's algorithm choice)."""

from __future__ import annotations

import pytest
import torch

from omniloop_rl import weights as W

MASK = (1 << 64) - 1


def reference_digest(t: torch.Tensor) -> tuple[int, int]:
    """tensor_digest written with Python ints from the docstring's formula (no torch arithmetic)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
    raw += [0] * ((-len(raw)) % 8)
    words = [int.from_bytes(bytes(raw[i:i + 8]), "little") for i in range(0, len(raw), 8)]
    out = []
    for seed in W._LANE_SEEDS:
        total = 0
        for i, w in enumerate(words):
            slab, j = divmod(i, W._SLAB)
            total += W.mix64_int(w + W.mix64_int(j + seed) + W.mix64_int(slab + seed))
        out.append(total & MASK)
    return out[0], out[1]


def test_mix64_matches_the_integer_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**63), 2**63 - 1, (257,), generator=g, dtype=torch.int64)
    got = [v & MASK for v in W.mix64(x).tolist()]
    assert got == [W.mix64_int(v) for v in x.tolist()]
    # the extremes, where wrapping and the logical shift matter
    edge = torch.tensor([0, -1, -(2**63), 2**63 - 1, 1], dtype=torch.int64)
    assert [v & MASK for v in W.mix64(edge).tolist()] == [W.mix64_int(v) for v in edge.tolist()]


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (5, 3)), (torch.bfloat16, (7,)), (torch.float16, (3, 3, 3)),
                                         (torch.float64, (4,)), (torch.int8, (13,)), (torch.bool, (9,))])
def test_tensor_digest_matches_the_reference(dtype, shape):
    """Both implementations: numpy on the host, torch int64 ops (what a GPU runs) — the same value."""
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    want = reference_digest(t)
    assert W.tensor_digest(t) == want
    assert W._digest_torch(W.tensor_words(t)) == want


def test_tensor_digest_across_slabs(monkeypatch):
    """Words beyond one slab take the slab's offset (a small slab keeps the reference fast)."""
    monkeypatch.setattr(W, "_SLAB", 16)
    monkeypatch.setattr(W, "_INDEX_TABLES", {})
    t = torch.randn(100, generator=torch.Generator().manual_seed(2))  # 50 words: 4 slabs
    assert W.tensor_digest(t) == reference_digest(t) == W._digest_torch(W.tensor_words(t))


def test_digest_sees_every_change():
    base = torch.randn(64, 33, generator=torch.Generator().manual_seed(3))
    d0 = W.tensor_digest(base)
    assert W.tensor_digest(base.clone()) == d0
    assert W.tensor_digest(base.t().contiguous().t()) == d0  # same values, other memory layout
    seen = {d0}
    for flat in (0, 1, 1000, base.numel() - 1):  # one ulp at a time
        t = base.clone().reshape(-1)
        t[flat] = torch.nextafter(t[flat], torch.tensor(float("inf")))
        seen.add(W.tensor_digest(t))
    swapped = base.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, swapped places
    seen.add(W.tensor_digest(swapped))
    seen.add(W.tensor_digest(base.reshape(33, 64)))  # same bytes: equal digest; the checksum adds the shape
    assert len(seen) == 6


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def test_checksum_of_components():
    a, b = _module(0), _module(0)
    for algorithm in W.CHECKSUM_ALGORITHMS:
        ca = W.checksum({"transformer": a, "vae": _module(5)}, algorithm=algorithm)
        assert ca.startswith(f"{algorithm}:")
        assert ca == W.checksum({"transformer": b}, algorithm=algorithm)  # only denoisers count
        with torch.no_grad():
            b[0].weight[0, 0] += 1e-3
        assert W.checksum({"transformer": b}, algorithm=algorithm) != ca
        with torch.no_grad():
            b[0].weight[0, 0] -= 1e-3
        b.load_state_dict(a.state_dict())
        # a shape change with the same bytes changes it too
        c = _module(0)
        c[2].weight = torch.nn.Parameter(a[2].weight.detach().reshape(4, 4))
        assert W.checksum({"transformer": c}, algorithm=algorithm) != ca
    assert W.checksum({"transformer": a}) != W.checksum({"transformer": a}, algorithm="sha256")
    with pytest.raises(ValueError, match="algorithm"):
        W.checksum({"transformer": a}, algorithm="md5")


def test_runtime_checksum_algorithms(fresh_runtime, rl_ckpt):
    rt = fresh_runtime(rl_ckpt("flux"))
    fast, slow = rt.weights_checksum(), rt.weights_checksum("sha256")
    assert fast.startswith("mix128:") and slow.startswith("sha256:")
    # a trainer gets the runtime's value from its own copy of the denoiser
    import copy

    assert W.checksum({"transformer": copy.deepcopy(rt.model.components["transformer"])}) == fast
    with pytest.raises(W.WeightUpdateError) as info:
        rt.weights_checksum("crc32")
    assert info.value.path == "algorithm"


def test_update_without_checksum(fresh_runtime, rl_ckpt):
    """update_weights(checksum=False) hashes nothing and returns None; the weights and version are
    updated as with the checksum, which weights_checksum() then gives."""
    a, b = fresh_runtime(rl_ckpt("flux")), fresh_runtime(rl_ckpt("flux"))
    new = {k: v + 0.01 for k, v in a.model.components["transformer"].state_dict().items()}
    assert a.update_weights(new, version="v1", checksum=False) is None
    assert a.weight_version == "v1"
    assert b.update_weights(new, version="v1") == a.weights_checksum()
