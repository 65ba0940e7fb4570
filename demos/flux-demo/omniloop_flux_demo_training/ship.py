"""Install a trained session's pipeline into the package's ``checkpoint/`` folder.

    python -m omniloop_flux_demo_training.ship DIR              # DIR: a gpu_run --out (pipeline.tar) or a pipeline folder
    python -m omniloop_flux_demo_training.ship DIR --dest PATH  # elsewhere (tests)

The folder is checked with the flux family's own checkpoint check before anything is copied, and
its ``omniloop.json`` must carry the defaults, ``"adherence": {"kind": "image"}`` and the
``"vocabulary"`` list; the previous ``checkpoint/`` is replaced only once the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from omniloop_flux_demo.checkpoint_path import checkpoint_dir, checkpoint_missing


class ShipError(ValueError):
    pass


def _extract(tar_path: Path, into: Path) -> Path:
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            p = Path(m.name)
            if p.is_absolute() or ".." in p.parts or not (m.isfile() or m.isdir()) or p.parts[0] != "pipeline":
                raise ShipError(f"{tar_path}: unexpected member {m.name!r} (only pipeline/... files are installed)")
        tar.extractall(into, filter="data") if sys.version_info >= (3, 12) else tar.extractall(into)
    return into / "pipeline"


def check_folder(folder: Path) -> dict:
    why = checkpoint_missing(folder)
    if why is not None:
        raise ShipError(f"{folder}: not a complete flux-demo pipeline ({why.split('(')[1].split(')')[0]})")
    from omniloop.errors import CheckpointError
    from omniloop_flux.checkpoint import check_checkpoint

    try:
        check_checkpoint(folder)
    except CheckpointError as err:
        raise ShipError(str(err)) from None
    meta = json.loads((folder / "omniloop.json").read_text())
    for key in ("defaults", "adherence", "vocabulary"):
        if key not in meta:
            raise ShipError(f"{folder / 'omniloop.json'}: no {key!r} key")
    if meta["adherence"] != {"kind": "image"}:
        raise ShipError(f"{folder / 'omniloop.json'}: adherence must be {{'kind': 'image'}}, got {meta['adherence']!r}")
    return meta


def ship(source: Path, dest: Path | None = None) -> Path:
    dest = dest or checkpoint_dir()
    source = Path(source)
    with tempfile.TemporaryDirectory() as tmp:
        if source.is_dir() and (source / "pipeline.tar").is_file():
            folder = _extract(source / "pipeline.tar", Path(tmp))
        elif source.is_file() and source.name.endswith(".tar"):
            folder = _extract(source, Path(tmp))
        elif source.is_dir() and (source / "model_index.json").is_file():
            folder = source
        else:
            raise ShipError(f"{source}: neither a gpu_run output folder (pipeline.tar) nor a pipeline folder (model_index.json)")
        check_folder(folder)
        staging = dest.parent / (dest.name + ".new")
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        # every config / tokenizer / weight file of the folder and its component folders (what the
        # package data globs include), nothing else
        for f in [*folder.glob("*.json"), *folder.glob("*/*.json"), *folder.glob("*/*.safetensors")]:
            if f.is_file() and not f.is_symlink():
                rel = f.relative_to(folder)
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, staging / rel)
        if checkpoint_missing(staging) is not None:
            raise ShipError(f"{folder}: copying it left an incomplete folder ({checkpoint_missing(staging)})")
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniloop_flux_demo_training.ship", description=__doc__.split("\n")[0])
    p.add_argument("source", type=Path, help="a gpu_run --out folder (with pipeline.tar), a pipeline.tar or a pipeline folder")
    p.add_argument("--dest", type=Path, default=None, help=f"default: {checkpoint_dir()}")
    args = p.parse_args(argv)
    try:
        dest = ship(args.source, args.dest)
    except ShipError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"installed the flux-demo checkpoint ({size / 1e6:.1f} MB) in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
