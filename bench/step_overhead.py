"""Per-step overhead of the runtime against the same step body in a bare Python loop.

For two step bodies —

* ``trivial``: a loop stage whose step is one tiny tensor update (16 floats), so the time is almost
  all overhead and the ratio is an upper bound;
* ``toy``: the core's toy family denoise step (a real 4-block transformer, classic CFG, 2 branches);

— and three bindings — no hooks bound, one observer (``step_start`` + ``step_end``), one step
interceptor (a pass-through around every model call) — it measures seconds per step when the
runtime drives the loop (``Execution.advance`` through the deploy's scheduler, events included)
and when the same ``LoopStage.step`` is called in a bare ``for`` loop. Everything runs side by side
in one process, interleaved, median of ``--repeats``; results are reported as ratios
(runtime / bare) and as absolute overhead in microseconds per step.

    python bench/step_overhead.py                # prints the table, writes bench/results/step_overhead-<date>.json
    python bench/step_overhead.py --no-write     # print only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omniloop.artifacts import Latents
from omniloop.capabilities import FamilyCapabilities
from omniloop.context import StageContext
from omniloop.family import LoadedModel, PluginComponentSpec
from omniloop.graph import Node, PipelineSpec
from omniloop.hookspecs import hookimpl
from omniloop.interceptors import call_model
from omniloop.loop import LoopState, RequestState, StepContext, StepResult
from omniloop.request import OmniRequest, TaskType
from omniloop.runtime import Runtime
from omniloop.testing import build_toy_checkpoint, make_manager

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (also when loaded by file path)
import _common as common

HERE = Path(__file__).resolve().parent
BINDINGS = ("none", "observer", "interceptor")


# --------------------------------------------------------------------------------------------
# The trivial family: one loop node whose step is one tiny tensor update
# --------------------------------------------------------------------------------------------


class TrivialLoop:
    def init(self, ctx: StageContext, state: RequestState) -> LoopState:
        loop = LoopState(total=state.request.diffusion.steps or 10, branches=("cond",))
        loop.tensors["x"] = torch.ones(16)
        return loop

    def step(self, ctx: StageContext, state: RequestState, loop: LoopState) -> StepResult:
        i = loop.step
        x = loop.tensors["x"]
        sc = StepContext(state.request.request_id, ctx.node.name, i, loop.total, float(i), branch="cond")
        v = call_model(ctx.step_interceptors, sc, loop, {"x": x}, lambda: x * 0.5)
        loop.tensors["x"] = x - 0.001 * v
        return StepResult(done=i + 1 >= loop.total)

    def finalize(self, ctx: StageContext, state: RequestState, loop: LoopState) -> None:
        state.write("latents", Latents(tensor=loop.tensors["x"]), ctx.node.name)


class TrivialFamily:
    name = "bench-trivial"
    tasks = frozenset({TaskType.T2V})
    capabilities = FamilyCapabilities()  # nothing optional

    def detect(self, path: Path) -> bool:
        return (Path(path) / "bench-trivial").is_file()

    def load(self, path: Path, *, device: torch.device, dtype: torch.dtype, options: dict[str, Any]) -> LoadedModel:
        return LoadedModel(family=self.name, path=path, components={}, device=device, dtype=dtype)

    def build_pipeline(self, model: LoadedModel, task: TaskType, options: dict[str, Any]) -> PipelineSpec:
        return PipelineSpec(family=self.name, task=task, nodes=(Node("loop", TrivialLoop(), writes={"latents": Latents}),),
                            outputs={"latents": "latents"})

    def validate_request(self, model: LoadedModel, request: OmniRequest, limits: Any) -> list[str]:
        return []


# --------------------------------------------------------------------------------------------
# One observer, one interceptor
# --------------------------------------------------------------------------------------------


class CountingObserver:
    def __init__(self, config: Any = None) -> None:
        self.started = 0
        self.ended = 0

    @hookimpl
    def omniloop_step_start(self, step: int) -> None:
        self.started += 1

    @hookimpl
    def omniloop_step_end(self, step: int, seconds: float) -> None:
        self.ended += 1


class PassThrough:
    name = "pass-through"
    graph_safe = True
    distribution_altering = False
    needs_eager = False

    def open(self, step: StepContext, loop: LoopState) -> None:
        return None

    def forward(self, step: StepContext, state: Any, inputs: Any, compute: Any) -> torch.Tensor:
        return compute()

    def close(self, state: Any) -> None:
        pass

    def metrics(self, state: Any) -> dict[str, Any]:
        return {}


class BenchPlugin:
    OMNILOOP_HOOK_API = ">=1.0,<2"

    @hookimpl
    def omniloop_register_families(self, register: Any) -> None:
        register(TrivialFamily())

    @hookimpl
    def omniloop_register_observers(self, register: Any) -> None:
        register(PluginComponentSpec(name="counting-observer", kind="observer", factory=CountingObserver))

    @hookimpl
    def omniloop_register_interceptors(self, register: Any) -> None:
        register(PluginComponentSpec(name="pass-through", kind="step_interceptor", factory=lambda c: PassThrough()))


DEPLOY_PLUGINS = {"none": {}, "observer": {"counting-observer": {}}, "interceptor": {"pass-through": {}}}


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def make_runtime(model_dir: Path, binding: str, steps: int) -> Runtime:
    manager = make_manager(("bench", BenchPlugin()))  # + the toy family and a serial scheduler
    return Runtime.from_model(
        model_dir, manager=manager, plugins=DEPLOY_PLUGINS[binding], limits={"max_steps": steps + 1},
    )


def request(steps: int) -> dict[str, Any]:
    return {"task": "t2v", "prompt": "a blue square moving right", "diffusion": {"steps": steps, "seed": 0}}


def time_runtime(rt: Runtime, steps: int) -> float:
    """Seconds per loop step when the runtime drives it: first step event → last step event."""
    execution = rt.prepare(request(steps))
    t_first = t_last = 0.0
    n = 0
    for ev in rt.scheduler.stream(execution):
        if ev.step is not None:
            n += 1
            now = time.perf_counter()
            if n == 1:
                t_first = now
            t_last = now
    assert execution.output.ok and n == steps, (execution.output.error, n)
    return (t_last - t_first) / (steps - 1)


def time_bare(rt: Runtime, steps: int) -> float:
    """Seconds per step of the same ``LoopStage.step`` called in a bare Python loop."""
    execution = rt.prepare(request(steps))
    # run up to and including the loop's first step (init runs with it), then take its state
    while execution.loop is None or execution.loop.step < 1:
        execution.advance()
    node = execution.current_node
    assert node is not None and node.is_loop
    ctx, state, loop = execution._ctx, execution.state, execution.loop
    step = node.stage.step
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        step(ctx, state, loop)
        loop.step += 1
    dt_ = time.perf_counter() - t0
    execution.cancel()
    execution.advance()
    return dt_ / (steps - 1)


def measure(model_dir: Path, steps: int, repeats: int) -> dict[str, Any]:
    runtimes = {b: make_runtime(model_dir, b, steps) for b in BINDINGS}
    with torch.no_grad():
        for b in BINDINGS:  # warm-up: first-call allocations, lazy imports
            time_runtime(runtimes[b], min(steps, 20))
        time_bare(runtimes["none"], min(steps, 20))
        samples: dict[str, list[float]] = {"bare": [], **{b: [] for b in BINDINGS}}
        for _ in range(repeats):  # interleaved, so drift hits every variant alike
            samples["bare"].append(time_bare(runtimes["none"], steps))
            for b in BINDINGS:
                samples[b].append(time_runtime(runtimes[b], steps))
    bare = statistics.median(samples["bare"])
    out: dict[str, Any] = {"steps": steps, "repeats": repeats, "bare_us_per_step": round(bare * 1e6, 3), "runtime": {}}
    for b in BINDINGS:
        med = statistics.median(samples[b])
        out["runtime"][b] = {
            "us_per_step": round(med * 1e6, 3),
            "ratio": round(med / bare, 4),
            "overhead_us_per_step": round((med - bare) * 1e6, 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trivial-steps", type=int, default=2000)
    p.add_argument("--toy-steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        trivial_dir = Path(tmp) / "trivial"
        trivial_dir.mkdir()
        (trivial_dir / "bench-trivial").write_text("")
        toy_dir = build_toy_checkpoint(Path(tmp) / "toy")
        results = {
            "trivial": measure(trivial_dir, args.trivial_steps, args.repeats),
            "toy": measure(toy_dir, args.toy_steps, args.repeats),
        }

    print(f"{'body':<8} {'binding':<12} {'us/step':>10} {'bare us/step':>13} {'ratio':>7} {'overhead us':>12}")
    for body, r in results.items():
        for b in BINDINGS:
            x = r["runtime"][b]
            print(f"{body:<8} {b:<12} {x['us_per_step']:>10.1f} {r['bare_us_per_step']:>13.1f} "
                  f"{x['ratio']:>7.3f} {x['overhead_us_per_step']:>12.1f}")

    if not args.no_write:
        # other processes on the machine add noise; the ratios are measured interleaved
        load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        path = common.write_dated_record(
            args.out_dir, "step_overhead", "step_overhead",
            "seconds per loop step: runtime-driven (Execution.advance via the scheduler) vs the same "
            "LoopStage.step in a bare Python loop; ratio = runtime / bare; median of repeats",
            common.cpu_machine(args.threads, load_average_1m_at_end=load), results,
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
