"""Post-training on the serving runtime, on one GPU (issue 36): rollout throughput with log-probs,
and the time of ``Runtime.update_weights``.

Wan2.1 T2V 1.3B transformer with random weights (``_common.CFG_13B``, text_dim shrunk to the tiny
text encoder's 32: the text projection is 0.1 % of the FLOPs), the tiny checkpoint's VAE and text
encoder, flow-Euler, bf16, CFG 5.0, through ``omniloop.Runtime`` with the step scheduler:

* **rollouts**: a group of ``--group`` samples (one request, ``diffusion.num_outputs``; the step
  scheduler batches the group) with ``rollout: {kind: sde}`` capturing latents, log-probs and
  timesteps, against the same group without ``rollout`` — interleaved, ``--repeats`` rounds each,
  samples/s from the median wall time of a round (request to the group's last output).
* **update_weights**: the full denoiser from a ``{name: tensor}`` mapping on the CPU and from a
  safetensors file on local disk (the call validates every tensor, then copies it in), and a
  rank-32 LoRA on every attention and FFN linear of the blocks (``adapter=``); medians of
  ``--repeats``. Each call returns the new ``weights_checksum`` (``mix128``, hashed on the GPU);
  ``weights_checksum`` times it alone against ``sha256`` (every byte hashed on the host, the
  default before 2026-12-03) and checks that the same weights copied to the host give the same
  ``mix128``; ``*_without_checksum`` repeats the CPU-tensor and LoRA updates with it stubbed out on
  the runtime instance, which shows the update's own cost. ``--skip-rollouts``: weights only.

``python bench/rl_gpu.py --out bench/results/rl-wan13b-gpu-<date>.json`` (``--smoke`` on a CPU:
the tiny transformer, 2 samples, 2 steps).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo_paths

_repo_paths.add_repo_packages()

import torch  # noqa: E402
from _common import CFG_13B, SMOKE_TF, command_line, library_versions, machine, sync, video_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = video_parser(__doc__, steps=10, repeats=3, frames=17, height=256, width=256)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-rollouts", action="store_true", help="time update_weights and the checksums only")
    args = ap.parse_args(argv)
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    import omniloop_scheduler.plugin as sched_plugin
    import omniloop_wan.plugin as wan_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_wan.tiny import build_tiny_checkpoint

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    if args.smoke:
        args.group, args.steps, args.frames, args.height, args.width, args.repeats = 2, 2, 5, 32, 32, 1
    work = Path(tempfile.mkdtemp(prefix="rl-bench-"))
    t = time.perf_counter()
    ckpt = build_tiny_checkpoint(work / "ckpt", variant="t2v", scheduler="flow_euler")
    torch.manual_seed(0)
    tf_cfg = dict(SMOKE_TF if args.smoke else CFG_13B, text_dim=32)
    WanTransformer3DModel(**tf_cfg).to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(ckpt / "transformer")
    built_s = time.perf_counter() - t
    mgr = make_manager(("wan", wan_plugin), ("scheduler", sched_plugin), toy=False, scheduler=False)
    rt = Runtime.from_model(str(ckpt), device=device, dtype=dtype, manager=mgr, scheduler="step",
                            scheduler_options={"max_batch": args.group},
                            limits={"max_frames": 257, "max_height": 1024, "max_width": 1024})
    n_params = sum(p.numel() for p in rt.model.components["transformer"].parameters())

    def body(rollout: bool, seed: int) -> dict:
        b = {"task": "t2v", "prompt": "a red ball bouncing", "negative_prompt": "blurry",
             "diffusion": {"steps": args.steps, "seed": seed, "frames": args.frames, "height": args.height,
                           "width": args.width, "guidance_scale": 5.0, "num_outputs": args.group},
             "node_params": {"denoise": {"sampler": "flow-euler", "cfg": "batched"}}}
        if rollout:
            b["rollout"] = {"kind": "sde", "noise_level": 0.7}
        return b

    def run(rollout: bool, seed: int) -> tuple[float, dict]:
        sync()
        t0 = time.perf_counter()
        out = rt.generate(body(rollout, seed))
        sync()
        dt = time.perf_counter() - t0
        if not out.ok:
            raise RuntimeError(f"request failed: {out.error}")
        info = {"samples": len(out.samples)}
        if rollout:
            tr = out.samples[0].artifacts["trajectory"]
            info.update(log_probs_finite=bool(torch.isfinite(tr.log_probs).all()), latents_shape=list(tr.latents.shape))
        batches = [len(d.request_ids) for d in rt.scheduler.trace if d.action == "batched_step"]
        info["largest_batch"] = max(batches, default=1)
        return dt, info

    times: dict[str, list[float]] = {"rollout_sde_capture": [], "plain": []}
    infos: dict[str, dict] = {}
    if not args.skip_rollouts:
        with torch.no_grad():
            run(True, 0)  # warm-up both paths
            run(False, 0)
    for rep in range(0 if args.skip_rollouts else args.repeats):
        order = [("rollout_sde_capture", True), ("plain", False)]
        for name, ro in (order if rep % 2 == 0 else order[::-1]):
            dt, info = run(ro, 100 + rep)
            times[name].append(dt)
            infos[name] = info
            print(json.dumps({"side": name, "rep": rep, "seconds": round(dt, 3), **info}), flush=True)
    rollouts = {name: {"seconds": [round(x, 4) for x in ts], "median_s": round(statistics.median(ts), 4),
                       "samples_per_s": round(args.group / statistics.median(ts), 3), **infos[name]}
                for name, ts in times.items() if ts}
    ratio = (rollouts["rollout_sde_capture"]["samples_per_s"] / rollouts["plain"]["samples_per_s"]
             if rollouts else None)

    # -- update_weights ------------------------------------------------------------------------
    tf = rt.model.components["transformer"]
    full_cpu = {k: (v.detach().float().cpu() * 1.0001).to(v.dtype) for k, v in tf.state_dict().items()}
    full_file = work / "full.safetensors"
    save_file(full_cpu, str(full_file))
    g = torch.Generator().manual_seed(0)
    lora = {}
    for name, mod in tf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("blocks.") and (".attn" in name or ".ffn" in name):
            lora[f"transformer.{name}.lora_A.weight"] = torch.randn(32, mod.in_features, generator=g) * 0.01
            lora[f"transformer.{name}.lora_B.weight"] = torch.randn(mod.out_features, 32, generator=g) * 0.01
    lora_file = work / "lora.safetensors"
    save_file(lora, str(lora_file))
    upd: dict[str, list[float]] = {"full_from_cpu_tensors": [], "full_from_file": [], "lora_rank32_from_file": []}
    for rep in range(args.repeats):
        for name, call in (("full_from_cpu_tensors", lambda v: rt.update_weights(full_cpu, version=v)),
                           ("full_from_file", lambda v: rt.update_weights(full_file, version=v)),
                           ("lora_rank32_from_file", lambda v: rt.update_weights(lora_file, version=v, adapter="policy"))):
            sync()
            t0 = time.perf_counter()
            call(f"{name}-{rep}")
            sync()
            upd[name].append(time.perf_counter() - t0)
    # The checksum each call returns: mix128 (the default, on the device) against sha256 (every byte
    # on the host), and the same mix128 from a host copy of the weights (device-independent).
    from omniloop_rl import weights as W

    checksums: dict[str, list[float]] = {"mix128": [], "sha256": []}
    values: dict[str, str] = {}
    for _rep in range(args.repeats):
        for algorithm in checksums:
            sync()
            t0 = time.perf_counter()
            values[algorithm] = rt.weights_checksum(algorithm)
            sync()
            checksums[algorithm].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    host_copy = {"transformer": __import__("copy").deepcopy(tf).to("cpu")}
    on_device = W.checksum({"transformer": tf})
    t1 = time.perf_counter()
    on_host = W.checksum(host_copy)
    host_mix_s = time.perf_counter() - t1
    del host_copy
    # To show the update itself, the same calls again with the returned checksum stubbed out on this
    # runtime instance (bench only: the API always returns it).
    rt.weights_checksum = lambda *a, **k: ""  # type: ignore[method-assign]
    for rep in range(args.repeats):
        for name, call in (("full_from_cpu_tensors_without_checksum", lambda v: rt.update_weights(full_cpu, version=v)),
                           ("lora_rank32_from_file_without_checksum",
                            lambda v: rt.update_weights(lora_file, version=v, adapter="policy"))):
            sync()
            t0 = time.perf_counter()
            call(f"{name}-{rep}")
            sync()
            upd.setdefault(name, []).append(time.perf_counter() - t0)
    del rt.weights_checksum
    record = {
        "benchmark": "rl_gpu", "command": command_line("bench/rl_gpu.py", sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"), "machine": machine(dtype=dtype), "libraries": library_versions(),
        "setup": {"transformer_params": n_params, "group": args.group, "steps": args.steps,
                  "size": [args.frames, args.height, args.width], "cfg": "batched, scale 5.0", "build_s": round(built_s, 1),
                  "sampler": "flow-euler (the rollout replaces its update)", "repeats": args.repeats},
        "rollouts": rollouts, "capture_over_plain_throughput": None if ratio is None else round(ratio, 4),
        "update_weights": {k: {"seconds": [round(x, 4) for x in v], "median_s": round(statistics.median(v), 4)}
                           for k, v in upd.items()},
        "lora": {"rank": 32, "linears": len(lora) // 2,
                 "params": sum(v.numel() for v in lora.values())},
        "weights_checksum": {
            "note": "update_weights returns the mix128 checksum: each update_weights row includes it",
            **{k: {"seconds": [round(x, 4) for x in v], "median_s": round(statistics.median(v), 4)} for k, v in checksums.items()},
            "mix128_on_host_copy_s": round(host_mix_s, 3),
            "mix128_device_equals_host": on_device == on_host, "values": values},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps({"rollouts": {k: v["samples_per_s"] for k, v in rollouts.items()}, "ratio": None if ratio is None else round(ratio, 4),
                      "update_s": {k: round(statistics.median(v), 3) for k, v in upd.items()},
                      "checksum_s": {k: round(statistics.median(v), 3) for k, v in checksums.items()},
                      "device_equals_host": on_device == on_host}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
