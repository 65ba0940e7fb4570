"""Video jobs: status, progress, SSE events, the output file written atomically, a durable record.

A job follows its engine handle in an asyncio task. When the request completes, the mp4 is
written with :func:`omniloop.media.write_mp4` (temporary file + ``os.replace``) in a thread, and
only then does the job become ``completed``: its content is never served half-written.

Output files are named by a server-made random id (``<32 hex>.mp4``), never by anything a client
sent; every path is resolved and refused unless it lies directly in the output folder. Each job's
final state is appended to ``<output folder>/jobs.jsonl`` when it ends (also when the server shuts
down and cancels it), so no job vanishes without a record.

Statuses: internally ``queued``, ``in_progress``, ``completed``, ``failed``, ``cancelled``. The
API object follows OpenAI's ``Video`` (status ``queued | in_progress | completed | failed``): a
cancelled job is ``failed`` with ``error.code == "cancelled"``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from omniloop.request import EventKind, Status

log = logging.getLogger("omniloop.server")

TERMINAL = ("completed", "failed", "cancelled")
MAX_JOB_EVENTS = 5000
RECORD_NAME = "jobs.jsonl"


class Job:
    def __init__(self, handle: Any, *, model: str, info: dict[str, Any]) -> None:
        self.handle = handle
        self.id: str = handle.request_id
        self.model = model
        self.info = info
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.final_status: str | None = None
        self.error: dict[str, Any] | None = None
        self.path: Path | None = None
        self.frames: int | None = None
        self.fps: float | None = None
        self.metrics: dict[str, Any] = {}
        self.cancel_requested = False
        self.deleted = False
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.final_progress = 0

    @property
    def status(self) -> str:
        """The internal status (``cancelled`` included)."""
        if self.final_status is not None:
            return self.final_status
        return "in_progress" if self.handle is not None and self.handle.status != "queued" else "queued"

    @property
    def api_status(self) -> str:
        """OpenAI's ``Video.status``: a cancelled job is ``failed`` (its ``error.code`` says cancelled)."""
        s = self.status
        return "failed" if s == "cancelled" else s

    @property
    def terminal(self) -> bool:
        return self.final_status is not None

    @property
    def progress(self) -> int:
        if self.final_status == "completed":
            return 100
        if self.handle is None:
            return self.final_progress
        return int(self.handle.progress * 100)

    def to_dict(self) -> dict[str, Any]:
        """The job as OpenAI's ``Video`` object (plus omniloop's ``frames``, ``fps``, ``metrics``)."""
        d: dict[str, Any] = {
            "id": self.id, "object": "video", "model": self.model, "status": self.api_status,
            "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
            "expires_at": None, "error": self.error, "remixed_from_video_id": None, **self.info,
        }
        if self.frames is not None:
            d["frames"], d["fps"] = self.frames, self.fps
            if "seconds" not in self.info and self.fps:
                d["seconds"] = f"{self.frames / self.fps:g}"
        if self.cancel_requested and not self.terminal:
            d["cancel_requested"] = True
        if self.metrics:
            d["metrics"] = self.metrics
        return d

    def record(self) -> dict[str, Any]:
        """The durable final-state record (one line of ``jobs.jsonl``)."""
        return {
            "id": self.id, "status": self.status, "error": self.error, "model": self.model,
            "created_at": self.created_at, "completed_at": self.completed_at, "progress": self.progress,
            "file": self.path.name if self.path is not None else None, "frames": self.frames, "fps": self.fps,
            "deleted": self.deleted,
        }

    def publish(self, event: str, data: dict[str, Any]) -> None:
        if len(self.events) < MAX_JOB_EVENTS or event == "done":
            self.events.append((event, data))
        self.changed.set()
        self.changed = asyncio.Event()


#: the derived images written next to each mp4 (``GET .../content?variant=...``)
VARIANT_SUFFIXES = (".thumbnail.png", ".spritesheet.png")
SPRITESHEET_FRAMES = 16


def write_outputs(frames: Any, fps: float, path: Path) -> None:
    """The mp4 (atomically), then its thumbnail (first frame) and spritesheet (frames side by side)."""
    from omniloop.media import to_pil, write_mp4

    write_mp4(frames, fps, path)
    to_pil(frames[0]).save(path.with_suffix(VARIANT_SUFFIXES[0]), format="PNG")
    t = int(frames.shape[0])
    picks = sorted({round(i * (t - 1) / max(1, SPRITESHEET_FRAMES - 1)) for i in range(min(t, SPRITESHEET_FRAMES))})
    import torch

    to_pil(torch.cat([frames[i] for i in picks], dim=1)).save(path.with_suffix(VARIANT_SUFFIXES[1]), format="PNG")


def unlink_outputs(path: Path) -> None:
    path.unlink(missing_ok=True)
    for suffix in VARIANT_SUFFIXES:
        path.with_suffix(suffix).unlink(missing_ok=True)


class OutputPathError(Exception):
    """An output path resolved outside the output folder (never expected: names are server-made)."""


class JobStore:
    """Jobs by id; keeps at most ``max_finished`` finished jobs (oldest evicted with their files)."""

    def __init__(self, output_dir: Path, max_finished: int = 1000) -> None:
        self.output_dir = Path(output_dir).resolve()
        self.max_finished = max_finished
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.write_failures = 0
        self.written = 0
        self.record_failures = 0
        self.shutdown_reason: str | None = None

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def add(self, job: Job, engine: Any) -> None:
        self.jobs[job.id] = job
        job.publish("status", job.to_dict())
        job.task = asyncio.create_task(self._follow(job, engine), name=f"job-{job.id}")

    def remove(self, job_id: str) -> Job | None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            job.deleted = True
            if job.path is not None:
                unlink_outputs(job.path)
        return job

    def output_path(self) -> Path:
        """A new output file path: a server-made name, checked to lie directly in the output folder."""
        path = (self.output_dir / f"{uuid.uuid4().hex}.mp4").resolve()
        if path.parent != self.output_dir:
            raise OutputPathError(f"{path} is not in {self.output_dir}")
        return path

    def counts(self) -> dict[str, int]:
        out = {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0}
        for j in self.jobs.values():
            out[j.status] = out.get(j.status, 0) + 1
        return out

    def in_flight(self) -> list[Job]:
        return [j for j in self.jobs.values() if not j.terminal]

    async def _follow(self, job: Job, engine: Any) -> None:
        h = job.handle
        try:
            async for ev in h.events():
                if ev.kind is EventKind.PROGRESS and ev.total and ev.step is not None:
                    job.publish("progress", {
                        "id": job.id, "status": job.api_status, "progress": job.progress,
                        "node": ev.node, "step": ev.step, "total": ev.total,
                    })
            out = await h.result()
            await self._finish(job, out)
        except Exception as exc:  # never leave a job non-terminal
            log.exception("job %s follower failed", job.id)
            job.final_status = "failed"
            job.error = {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}
        except asyncio.CancelledError:  # the server gave up on it at shutdown (it set the final state)
            pass
        finally:
            if job.final_status is None:
                job.final_status = "failed"
                job.error = job.error or {"code": "server_error", "message": "job follower stopped"}
            job.completed_at = job.completed_at or int(time.time())
            job.final_progress = int(h.progress * 100)
            job.handle = None  # the output (tensors) is on disk now; drop it and the handle's events
            engine.forget(job.id)
            self._record(job)
            job.publish("done", job.to_dict())
            self._evict()

    async def _finish(self, job: Job, out: Any) -> None:
        from omniloop.schema import jsonable

        job.metrics = {k: jsonable(out.metrics[k]) for k in ("steps", "total_seconds", "seed") if k in out.metrics}
        if out.status is Status.COMPLETED:
            video = out.artifacts.get("video")
            if video is None or getattr(video, "frames", None) is None:
                job.final_status, job.error = "failed", {"code": "no_video", "message": "the pipeline produced no video"}
                return
            if job.deleted:  # deleted while it ran: nothing to keep
                job.final_status = "completed"
                return
            try:
                path = self.output_path()
                await asyncio.to_thread(write_outputs, video.frames, float(video.fps), path)
            except Exception as exc:
                self.write_failures += 1
                log.exception("writing the output of job %s failed", job.id)
                job.final_status = "failed"
                job.error = {"code": "output_write_failed", "message": f"{type(exc).__name__}: {exc}"}
                return
            self.written += 1
            if job.deleted:
                unlink_outputs(path)
            else:
                job.path = path
            job.frames, job.fps = int(video.frames.shape[0]), float(video.fps)
            job.final_status = "completed"
            return
        job.final_status = out.status.value
        if out.status is Status.CANCELLED:
            if job.cancel_requested:
                why = "cancelled by the client"
            elif self.shutdown_reason is not None:
                why = f"cancelled: {self.shutdown_reason}"
            else:
                why = "cancelled"
            job.error = {"code": "cancelled", "message": why}
        elif out.error is not None:
            job.error = {"code": out.error.type, "message": out.error.message, "node": out.error.node, "step": out.error.step}

    def _record(self, job: Job) -> None:
        try:
            with open(self.output_dir / RECORD_NAME, "a", encoding="utf-8") as f:
                f.write(json.dumps(job.record(), ensure_ascii=True, default=str) + "\n")
        except OSError:
            self.record_failures += 1
            log.exception("recording the final state of job %s failed", job.id)

    def _evict(self) -> None:
        finished = [j for j in self.jobs.values() if j.terminal]
        for j in finished[: max(0, len(finished) - self.max_finished)]:
            self.remove(j.id)
