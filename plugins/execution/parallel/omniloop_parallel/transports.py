"""Transports: how a request's artifacts cross from the workers to the front end (deploy ``transport``).

Registered through the core's transport plugin kind (``omniloop_register_transports``):

``inproc``             the default. In one process artifacts are never copied; across the worker
                       pool rank 0 pickles the output to bytes and the front end unpickles a copy.
``shm``                rank 0 moves every tensor of the output into shared memory and sends its
                       handle (torch's multiprocessing reductions); the front end maps the same
                       pages — no copy of the payload through the pipe. Needs the pool (world > 1).
``torch.distributed``  the ranks exchange tensors through the process group (the parallel axes'
                       collectives: CFG predictions all-gathered, Ulysses all-to-all); the output
                       reaches the front end as with ``shm``. Needs the pool (world > 1).

A transport object has ``encode(obj)`` (rank 0) and ``decode(msg)`` (front end).
"""

from __future__ import annotations

import pickle
from typing import Any

import attrs
import torch

from omniloop.family import TransportSpec


def map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside dicts, lists, tuples and attrs instances."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if attrs.has(type(obj)):
        changes = {}
        for f in attrs.fields(type(obj)):
            if not f.init:
                continue
            v = getattr(obj, f.name)
            new = map_tensors(v, fn)
            if new is not v:
                changes[f.name.lstrip("_") if f.alias is None else f.alias] = new
        return attrs.evolve(obj, **changes) if changes else obj
    return obj


class InprocTransport:
    name = "inproc"

    def encode(self, obj: Any) -> Any:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def decode(self, msg: Any) -> Any:
        return pickle.loads(msg)


class ShmTransport:
    name = "shm"

    def encode(self, obj: Any) -> Any:
        return map_tensors(obj, lambda t: t.detach().cpu().share_memory_())

    def decode(self, msg: Any) -> Any:
        return msg


class DistributedTransport(ShmTransport):
    name = "torch.distributed"


TRANSPORTS = {t.name: t for t in (InprocTransport, ShmTransport, DistributedTransport)}


def transport_for(name: str) -> Any:
    return TRANSPORTS[name]()


SPECS = (
    TransportSpec(name="inproc", factory=InprocTransport,
                  description="no copy in one process; pickled bytes from the workers to the front end"),
    TransportSpec(name="shm", factory=ShmTransport,
                  description="output tensors in shared memory, handles through the pipe (worker pool)"),
    TransportSpec(name="torch.distributed", factory=DistributedTransport,
                  description="ranks exchange through the process group (NCCL/gloo); output as shm (worker pool)"),
)
