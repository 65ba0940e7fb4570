"""The DMD2 recipe (``omniloop_wan_demo_training.dmd``): one iteration on a tiny Wan transformer
(losses finite; the student and the critic change, the teacher does not), the same with LoRA roles
on one base, and the student's rollout against the runtime's ``few-step`` sampler on the shipped
wan-demo-fast checkpoint."""

import copy

import pytest
import torch

from omniloop_wan_demo_training import dmd

torch.set_num_threads(2)


def tiny_transformer(seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)


def batches(seed: int = 1, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    uncond = torch.randn((1, 6, 16), generator=g)
    while True:
        yield dmd.Batch(torch.randn((b, 4, 2, 8, 8), generator=g), dmd.Text(torch.randn((b, 6, 16), generator=g), uncond))


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def changed(before: list[torch.Tensor], params) -> bool:
    return any(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))


def rollout():
    from omniloop_policies.samplers import FewStepSampler

    return dmd.FewStepRollout(sampler=FewStepSampler(timesteps_list=(1000, 750, 500, 250)))


def test_one_dmd_iteration_moves_the_student_and_the_critic_not_the_teacher():
    teacher = tiny_transformer().eval()
    student, critic = copy.deepcopy(teacher).train(), copy.deepcopy(teacher).train()
    t0, s0, c0 = snapshot(teacher.parameters()), snapshot(student.parameters()), snapshot(critic.parameters())
    logs: list[dict] = []
    cfg = dmd.DMDConfig(critic_steps=2, student_lr=1e-3, critic_lr=1e-3)
    out = dmd.train_dmd(student, teacher, critic, rollout(), batches(), cfg, steps=2, log=logs.append, log_every=1)
    assert out["student_steps"] == 1 and out["critic_steps"] == 2
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor([r["critic_loss"]])) for r in logs)
    assert torch.isfinite(torch.tensor(logs[0]["dm_loss"])) and logs[0]["dm_loss"] > 0
    assert not changed(t0, teacher.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert changed(s0, student.parameters()) and changed(c0, critic.parameters())


def test_the_dm_loss_gradient_is_the_normalised_fake_minus_real_direction():
    teacher = tiny_transformer().eval()
    critic = tiny_transformer(seed=3).eval()
    b = next(batches())
    x0 = torch.randn_like(b.noise).requires_grad_(True)
    cfg = dmd.DMDConfig()
    loss = dmd.distribution_matching_loss(x0, b.text, teacher, critic, cfg, torch.Generator().manual_seed(5))
    loss.backward()
    # the same draws by hand
    g = torch.Generator().manual_seed(5)
    s = dmd._draw_sigma(cfg, x0.shape[0], x0.device, g)
    sb = s.view(-1, 1, 1, 1, 1)
    xt = (1 - sb) * x0.detach() + sb * torch.randn(x0.shape, generator=g)
    with torch.no_grad():
        def v(m, emb):
            return m(hidden_states=xt, timestep=s * 1000, encoder_hidden_states=emb, return_dict=False)[0]
        vc, vu = v(teacher, b.text.cond), v(teacher, b.text.uncond.expand(2, -1, -1))
        real = xt - sb * (vu + cfg.teacher_guidance * (vc - vu))
        fake = xt - sb * v(critic, b.text.cond)
        norm = (x0.detach() - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    torch.testing.assert_close(x0.grad, (fake - real) / norm / x0.numel(), rtol=1e-4, atol=1e-8)
    assert torch.isfinite(loss)


def test_lora_roles_train_two_adapters_on_one_frozen_base():
    pytest.importorskip("peft")
    base = tiny_transformer()
    student, teacher, critic = dmd.lora_roles(base, rank=4, target_modules=["to_q", "to_k", "to_v"])
    b = next(batches())
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if "lora_" not in n}
    with torch.no_grad():
        plain = tiny_transformer()(hidden_states=b.noise, timestep=torch.full((2,), 500.0), encoder_hidden_states=b.text.cond,
                                   return_dict=False)[0]
        for role in (student, teacher, critic):  # B = 0: every role starts as the base
            out = role(hidden_states=b.noise, timestep=torch.full((2,), 500.0), encoder_hidden_states=b.text.cond,
                       return_dict=False)[0]
            torch.testing.assert_close(out, plain)
    s0, c0 = snapshot(student.parameters()), snapshot(critic.parameters())
    assert len(s0) == len(c0) == 12  # A and B of q, k, v in self- and cross-attention, one block
    cfg = dmd.DMDConfig(critic_steps=1, student_lr=1e-2, critic_lr=1e-2)
    dmd.train_dmd(student, teacher, critic, rollout(), batches(), cfg, steps=2)
    assert changed(s0, student.parameters()) and changed(c0, critic.parameters())
    assert all(torch.equal(p, frozen[n]) for n, p in base.named_parameters() if "lora_" not in n)
    with torch.no_grad():  # the teacher is still the base: adapters off
        out = teacher(hidden_states=b.noise, timestep=torch.full((2,), 500.0), encoder_hidden_states=b.text.cond,
                      return_dict=False)[0]
    torch.testing.assert_close(out, plain)


def test_rollout_exits_at_a_random_step_with_the_graph_of_that_step_only():
    student = tiny_transformer()
    b = next(batches())
    r = dmd.FewStepRollout(sampler=rollout().sampler, exit="random", exit_generator=torch.Generator().manual_seed(2))
    exits = set()
    for _ in range(12):
        x0 = r(student, b.noise, b.text, torch.Generator().manual_seed(0))
        assert x0.requires_grad
        exits.add(r.last_exit)
    assert exits == {0, 1, 2, 3}
    last = dmd.FewStepRollout(sampler=rollout().sampler, exit="last")
    with torch.no_grad():
        full = last(student, b.noise, b.text, torch.Generator().manual_seed(0))
        r3 = dmd.FewStepRollout(sampler=rollout().sampler, exit="last", grad="all")
        assert torch.equal(full, r3(student, b.noise, b.text, torch.Generator().manual_seed(0)))


def test_the_rollout_is_the_runtimes_few_step_sampler_on_wan_demo_fast():
    """The recipe's rollout (no grad, all steps) on the shipped wan-demo-fast student vs
    ``omniloop generate --model wan-demo-fast`` (few-step sampler, guidance 1): same prompt
    embedding, same initial noise and per-step noise from the request's seed → equal latents."""
    from omniloop.runtime import Runtime
    from omniloop_policies.samplers import FewStepSampler
    from omniloop_wan.stages import encode_text
    from omniloop_wan_demo.checkpoint_path import checkpoint_dir
    from omniloop_wan_demo_training.distill import FAST_TIMESTEPS, GRID_SHIFT

    fast = checkpoint_dir().parent / "checkpoint_fast"
    if not (fast / "transformer").is_dir():
        pytest.skip("no wan-demo-fast checkpoint in the package")
    prompt, seed = "a red star moving left", 3
    rt = Runtime.from_model("wan-demo-fast")
    out = rt.generate({"task": "t2v", "prompt": prompt, "diffusion": {"seed": seed}, "outputs": {"return_latents": True}})
    assert out.ok, out.error
    theirs = out.artifacts["latents"].tensor.float()

    # the runtime's own modules: its transformer (with the attention backend it chose) and its prompt encoding
    c = rt.model.components
    emb, _ = encode_text(c["tokenizer"], c["text_encoder"], prompt, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((1, 16, 5, 16, 16), generator=gen)
    r = dmd.FewStepRollout(sampler=FewStepSampler(timesteps_list=FAST_TIMESTEPS, grid_shift=GRID_SHIFT), exit="last")
    with torch.no_grad():
        ours = r(c["transformer"], noise, dmd.Text(emb), gen)
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


# -- dmd_fast: the LoRA files it ships ---------------------------------------------------------------


def test_a_trained_adapter_saved_and_merged_is_the_adapter_applied_by_peft():
    pytest.importorskip("peft")
    from omniloop_wan_demo_training import dmd_fast

    base = tiny_transformer()
    student, _, _ = dmd.lora_roles(base, rank=4, target_modules=["to_q", "to_v", "ffn.net.2"])
    with torch.no_grad():
        for p in student.parameters():
            p.normal_(0, 0.1)  # a trained adapter: B != 0
    b = next(batches())
    kw = dict(hidden_states=b.noise, timestep=torch.full((2,), 500.0), encoder_hidden_states=b.text.cond, return_dict=False)
    with torch.no_grad():
        want = student(**kw)[0]
    state = dmd_fast.adapter_state(base, "student")
    assert all(k.startswith("transformer.blocks.0.") and ".student." not in k for k in state)
    assert len(state) == 2 * 5  # q and v of two attentions, the FFN's output
    merged = dmd_fast.merge_lora(tiny_transformer(), state)
    with torch.no_grad():
        got = merged(**kw)[0]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)  # the file holds fp16 weights


def test_extracting_a_lora_recovers_a_low_rank_update_and_reports_what_it_drops():
    from omniloop_wan_demo_training import dmd_fast

    base, student = tiny_transformer(), tiny_transformer()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = student.blocks[0].attn1.to_q.weight
        w += torch.randn((w.shape[0], 2), generator=g) @ torch.randn((2, w.shape[1]), generator=g) * 0.1
    state, info = dmd_fast.extract_lora(student, base, rank=2)
    assert info["linear_delta_rel_error"] < 1e-3 and info["other_params_rel_change"] == 0.0
    merged = dmd_fast.merge_lora(tiny_transformer(), state)
    torch.testing.assert_close(merged.blocks[0].attn1.to_q.weight, w, atol=1e-3, rtol=0)
    with torch.no_grad():
        student.blocks[0].norm2.weight += 0.5  # not a Linear of the blocks: the LoRA cannot hold it
    assert dmd_fast.extract_lora(student, base, rank=2)[1]["other_params_rel_change"] > 0


def test_a_lora_file_loads_back_into_the_student_adapter(tmp_path):
    """``dmd_fast --lora-from``: a saved adapter (``adapter_state`` + ``save_lora``) loaded into a
    fresh student adapter (``load_adapter_state``) gives the same outputs; its rank is read from
    the file; a key the model has no adapter weight for is refused, naming it."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from omniloop_wan_demo_training import dmd_fast

    targets = ["to_q", "to_v", "ffn.net.2"]
    base = tiny_transformer()
    student, _, _ = dmd.lora_roles(base, rank=4, target_modules=targets)
    with torch.no_grad():
        for p in student.parameters():
            p.normal_(0, 0.1)
    path = tmp_path / "fast_lora.safetensors"
    dmd_fast.save_lora(dmd_fast.adapter_state(base, "student"), path, {"rank": 4})
    assert dmd_fast.lora_file_rank(path) == 4
    other = tiny_transformer()
    student2, teacher2, _ = dmd.lora_roles(other, rank=4, target_modules=targets)
    assert dmd_fast.load_adapter_state(other, "student", load_file(str(path))) == 2 * 5  # A and B of 5 linears
    b = next(batches())
    kw = dict(hidden_states=b.noise, timestep=torch.full((2,), 500.0), encoder_hidden_states=b.text.cond, return_dict=False)
    with torch.no_grad():
        torch.testing.assert_close(student2(**kw)[0], student(**kw)[0], atol=1e-3, rtol=0)  # fp16 in the file
        assert not torch.allclose(teacher2(**kw)[0], student2(**kw)[0])  # the teacher is still the base
    with pytest.raises(ValueError, match=r"to_k\.lora_A\.weight"):
        dmd_fast.load_adapter_state(other, "student", {"transformer.blocks.0.attn1.to_k.lora_A.weight": torch.zeros(4, 16)})


def test_dmd_fast_refuses_bad_lora_from_before_any_work(tmp_path, capsys):
    from omniloop_wan_demo_training.dmd_fast import parse_args

    (tmp_path / "x.safetensors").write_bytes(b"not a safetensors file")
    for argv, msg in ((["--form", "full", "--lora-from", str(tmp_path / "x.safetensors")], "only with --form lora"),
                      (["--lora-from", str(tmp_path / "none.safetensors")], "no file"),
                      (["--lora-from", str(tmp_path / "x.safetensors")], "--lora-from: "),
                      (["--critic-warmup", "-1"], "--critic-warmup >= 0"),
                      (["--form", "full", "--snapshot-every", "5"], "--snapshot-every: a count >= 0, with --form lora"),
                      (["--snapshot-every", "5", "--pick-seeds", "3-4", "--eval-seeds", "0-3"], "must not overlap"),
                      (["--eval-only", "lora", "--lora-scales", "1,nan"], "--lora-scales: each must be a finite number > 0"),
                      (["--eval-only", "lora", "--lora-scales", "x"], "--lora-scales: expected comma-separated numbers")):
        with pytest.raises(SystemExit) as e:
            parse_args(["--out", str(tmp_path / "o"), *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_the_shipped_fast_lora_is_a_lora_from_file():
    """What ``gpu_dmd.sh`` starts the student from: the shipped adapter, rank 32."""
    from omniloop_wan_demo.checkpoint_path import PACKAGE_DIR
    from omniloop_wan_demo_training.dmd_fast import lora_file_rank

    assert lora_file_rank(PACKAGE_DIR / "adapters" / "fast.safetensors") == 32


def test_reuse_samples_trains_the_critic_on_the_last_student_samples_without_new_rollouts():
    """``DMDConfig.reuse_samples``: the critic-only iterations take the last student update's
    samples and prompts (no rollout); without it every iteration rolls the student out."""
    calls: list[torch.Tensor] = []
    inner = rollout()

    def counting(student, noise, text, gen):
        calls.append(noise)
        return inner(student, noise, text, gen)

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_critic_loss = dmd.critic_loss

    def spy(critic, x0, text, generator=None, *, cfg=None):
        seen.append((x0, text.cond))
        return real_critic_loss(critic, x0, text, generator, cfg=cfg)

    for reuse, rollouts in ((True, 2), (False, 6)):
        calls.clear()
        seen.clear()
        teacher = tiny_transformer()
        student, critic = copy.deepcopy(teacher).train(), copy.deepcopy(teacher).train()
        cfg = dmd.DMDConfig(critic_steps=3, reuse_samples=reuse)
        mp = pytest.MonkeyPatch()
        mp.setattr(dmd, "critic_loss", spy)
        try:
            out = dmd.train_dmd(student, teacher, critic, counting, batches(), cfg, steps=6,
                                generator=torch.Generator().manual_seed(0))
        finally:
            mp.undo()
        assert out == {**out, "student_steps": 2, "critic_steps": 6} and len(calls) == rollouts
        if reuse:  # iterations 1, 2 reuse iteration 0's samples and prompts; 4, 5 iteration 3's
            for a, b in ((0, 1), (0, 2), (3, 4), (3, 5)):
                assert seen[a][0] is seen[b][0] and seen[a][1] is seen[b][1]
            assert not torch.equal(seen[0][0], seen[3][0])


def test_dmd_fast_ships_the_best_snapshot_by_the_pick_score(tmp_path):
    """``--snapshot-every``: the starting adapter and every N-th student update are scored on the
    held-out pick seeds, and the best (shape + no ghost - 5 x duplicate share) is what ships."""
    from omniloop_wan_demo_training import dmd_fast

    rows = [{"accuracy": {"shape": 0.9, "clean": 0.9}, "duplicate_clips": 0, "n": 100},
            {"accuracy": {"shape": 1.0, "clean": 0.95}, "duplicate_clips": 4, "n": 100},
            {"accuracy": {"shape": 0.95, "clean": 0.96}, "duplicate_clips": 0, "n": 100}]
    assert [round(dmd_fast.pick_score(r), 3) for r in rows] == [1.8, 1.75, 1.91]
    assert dmd_fast.main(["--out", str(tmp_path), "--smoke", "--snapshot-every", "1", "--device", "cpu"]) == 0
    import json

    res = json.loads((tmp_path / "result.json").read_text())
    snaps = res["snapshots"]
    assert snaps["rows"][0]["student_step"] == 0 and len(snaps["rows"]) >= 2
    best = max(snaps["rows"], key=lambda r: r["score"])
    assert snaps["picked_student_step"] == best["student_step"]
