"""Does a GPU round to e4m3 as the CPU does? (issue 40: flux-demo's FP8 loss appears on the GPU only.)

Two comparisons, CPU against ``--device`` (default ``cuda``):

* **the cast** — ~6.3 M float32 values (normal at six scales, the subnormal range in 4,097 steps of each sign,
  and 400–448 near e4m3's largest finite value) through ``.to(torch.float8_e4m3fn)`` on both; the codes are
  compared bit for bit;
* **omniloop-quant's per-row quantisation** (``omniloop_quant.fp8.quantize_rows``, what every FP8 linear runs
  on its input) of a 4096 × 512 bf16 activation whose channels have uneven scales: how many rows' float32
  scales and how many e4m3 codes differ.

Measured on an H100 (2026-12-07, ``results/flux-demo-fp8-grid-vs-kernel-h100-s26-2026-12-07.json``; by this check's
first version, the same construction with other random draws, run before this script was written up): the cast
agrees on every value; 2,393 of 4,096 row scales differ by one ulp (``amax / 448``: CUDA divides by a Python
scalar through its reciprocal, the CPU divides) and so 1,896 of 2.1 M codes (0.09 %) by one e4m3 step.

    python bench/fp8_cast_devices.py --out $OUT            # on the GPU machine
    python bench/fp8_cast_devices.py --device cpu --out /tmp/x   # the CPU check of the script (CPU against CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _repo_paths import add_repo_packages

add_repo_packages()

import torch  # noqa: E402

E4M3 = torch.float8_e4m3fn


def cast_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(1 << 20, generator=g) * s for s in (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)]
    sub = torch.linspace(0, 2 ** -5, 4097)
    return torch.cat([*parts, sub, -sub, torch.linspace(400, 448, 1001)])


def activation() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4096, 512, generator=g) * torch.rand(1, 512, generator=g) ** 4 * 3).bfloat16()


def compare(device: str) -> dict:
    from omniloop_quant.fp8 import quantize_rows

    x = cast_values()
    here = x.to(E4M3).view(torch.uint8)
    there = x.to(device).to(E4M3).view(torch.uint8).cpu()
    bad = (here != there).nonzero().flatten()
    examples = [{"x": x[i].item(), "cpu": here[i].view(E4M3).float().item(), device: there[i].view(E4M3).float().item()}
                for i in bad[:8].tolist()]
    a = activation()
    qc, sc = quantize_rows(a)
    qd, sd = quantize_rows(a.to(device))
    scale_diff = (sc != sd.cpu()).flatten()
    ulps = (sc.view(torch.int32) - sd.cpu().view(torch.int32)).abs().max().item()
    return {
        "cast": {"values": x.numel(), "mismatches": int(bad.numel()), "examples": examples},
        "quantize_rows": {"rows": a.shape[0], "row_scale_mismatches": int(scale_diff.sum()), "max_scale_ulps": int(ulps),
                          "codes": qc.numel(),
                          "code_mismatches": int((qc.view(torch.uint8) != qd.view(torch.uint8).cpu()).sum())},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="compared with the CPU (default cuda; cpu checks the script)")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the JSON")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("fp8_cast_devices.py: --device cuda needs a CUDA GPU (use --device cpu to check the script)", file=sys.stderr)
        return 2
    rec = {"bench": "fp8_cast_devices", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, **compare(args.device)}
    print(json.dumps({k: rec[k] for k in ("cast", "quantize_rows")}))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fp8_cast_devices-{args.device.replace(':', '')}.json"
    path.write_text(json.dumps(rec, indent=1))
    print(json.dumps({"wrote": str(path)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
