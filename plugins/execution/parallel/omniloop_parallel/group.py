"""Process-group set-up: a free local TCP port, ``init_process_group`` with a timeout on every
collective (a peer that dies or stalls surfaces as an error, never a hang)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_group(rank: int, world: int, port: int, backend: str, timeout_s: float) -> None:
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
