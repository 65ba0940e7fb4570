"""omniloop.rl's DiffusionNFT objective (nft_optimality, nft_noisy, nft_loss): the formulas, the
direction of its gradient, and a toy policy that it improves from SDE rollouts."""

from __future__ import annotations

import pytest
import torch

from omniloop_policies.rollout import step_stats
from omniloop_rl.trainer import nft_loss, nft_noisy, nft_optimality


def test_optimality():
    a = torch.tensor([-9.0, -2.0, -1.0, 0.0, 1.0, 2.0, 9.0])
    assert torch.allclose(nft_optimality(a, 2.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip"):
            nft_optimality(a, bad)


def test_noisy_is_the_forward_process():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    assert torch.equal(nft_noisy(x0, eps, 0.25), 0.75 * x0 + 0.25 * eps)
    s = torch.tensor([0.0, 0.5, 1.0])
    out = nft_noisy(x0, eps, s)
    assert torch.equal(out[0], x0[0]) and torch.equal(out[2], eps[2])
    assert torch.allclose(out[1], 0.5 * x0[1] + 0.5 * eps[1])


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    sigma = torch.tensor([0.2, 0.4, 0.6, 0.8])
    return x0, eps, sigma, nft_noisy(x0, eps, sigma), torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)


def test_loss_formula():
    x0, _eps, sigma, xs, v, v_old = _batch()
    s = sigma.reshape(-1, 1, 1)
    ones, zeros = torch.ones(4), torch.zeros(4)
    # beta = 1, r = 1, no adaptive weights: the plain x0-prediction flow-matching loss of v
    assert torch.allclose(nft_loss(v, v_old, xs, x0, sigma, ones, adaptive=False),
                          ((xs - s * v - x0) ** 2).mean(dim=(1, 2)))
    # r = 0: the implicit negative policy 2·v_old - v is fitted instead
    assert torch.allclose(nft_loss(v, v_old, xs, x0, sigma, zeros, adaptive=False),
                          ((xs - s * (2 * v_old - v) - x0) ** 2).mean(dim=(1, 2)))
    # general beta and r, adaptive weights (detached mean |error|), divided by beta
    beta, r = 0.3, torch.tensor([0.0, 0.25, 0.5, 1.0])
    pos = xs - s * ((1 - beta) * v_old + beta * v) - x0
    neg = xs - s * ((1 + beta) * v_old - beta * v) - x0
    want = (r * (pos**2).mean(dim=(1, 2)) / pos.abs().mean(dim=(1, 2))
            + (1 - r) * (neg**2).mean(dim=(1, 2)) / neg.abs().mean(dim=(1, 2))) / beta
    assert torch.allclose(nft_loss(v, v_old, xs, x0, sigma, r, beta=beta), want)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v, v_old, xs, x0, sigma, r, beta=0.0)


@pytest.mark.parametrize("r,direction", [(1.0, 1), (0.0, -1), (0.5, 0)])
def test_gradient_moves_towards_or_away_from_the_target(r, direction):
    """At v = v_old a gradient step moves v towards the target ε - x0 when r = 1, away when r = 0,
    nowhere when r = 1/2 (the two implicit policies balance)."""
    x0, eps, sigma, xs, _, v_old = _batch(2)
    target = eps - x0
    v = v_old.clone().requires_grad_(True)
    nft_loss(v, v_old, xs, x0, sigma, torch.full((4,), r), adaptive=False).sum().backward()
    towards = (-v.grad * (target - v_old)).sum()  # > 0: descent reduces the distance to the target
    if direction == 0:
        assert v.grad.abs().max() < 1e-6
    else:
        assert direction * towards > 0


def test_nft_improves_a_toy_policy_from_sde_rollouts():
    """A 1-D flow policy v_θ(x, σ) = (x - θ)/σ (its ODE lands on θ) sampled with the runtime's SDE
    step; reward -|x0 - 2|; DiffusionNFT with group-normalised advantages moves θ from 0 towards 2
    using clean samples only."""
    torch.manual_seed(0)
    theta = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.Adam([theta], lr=0.05)
    sigmas = torch.linspace(1.0, 0.0, 6)
    for _ in range(40):
        with torch.no_grad():  # rollouts: 64 samples, an SDE step everywhere (the ODE lands on θ exactly)
            x = torch.randn(64)
            for i in range(len(sigmas) - 1):
                v = (x - theta) / sigmas[i]
                mean, scale = step_stats(v, x, sigmas[i], sigmas[i + 1], kind="sde", noise_level=0.7, sigma_max=sigmas[1])
                x = mean + scale * torch.randn(64)
        reward = -(x - 2.0).abs()
        adv = (reward - reward.mean()) / (reward.std() + 1e-4)
        r = nft_optimality(adv, 2.0)
        theta_old = theta.detach().clone()
        for _ in range(2):
            sigma = torch.rand(64) * 0.8 + 0.1
            xs = nft_noisy(x, torch.randn(64), sigma)
            loss = nft_loss((xs - theta) / sigma, (xs - theta_old) / sigma, xs, x, sigma, r).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert 1.5 < float(theta.detach()) < 2.5
