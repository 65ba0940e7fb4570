"""Video jobs: status, progress, SSE events, and the output file written atomically.

A job follows its engine handle in an asyncio task. When the request completes, the mp4 is
written with :func:`omniloop.media.write_mp4` (temporary file + ``os.replace``) in a thread, and
only then does the job become ``completed``: its content is never served half-written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from omniloop.request import EventKind, Status

log = logging.getLogger("omniloop.server")

TERMINAL = ("completed", "failed", "cancelled")
MAX_JOB_EVENTS = 5000


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
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.final_progress = 0

    @property
    def status(self) -> str:
        if self.final_status is not None:
            return self.final_status
        return "in_progress" if self.handle is not None and self.handle.status != "queued" else "queued"

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
        d: dict[str, Any] = {
            "id": self.id, "object": "video", "model": self.model, "status": self.status,
            "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
            "error": self.error, **self.info,
        }
        if self.frames is not None:
            d["frames"], d["fps"] = self.frames, self.fps
        if self.cancel_requested and not self.terminal:
            d["cancel_requested"] = True
        if self.metrics:
            d["metrics"] = self.metrics
        return d

    def publish(self, event: str, data: dict[str, Any]) -> None:
        if len(self.events) < MAX_JOB_EVENTS or event == "done":
            self.events.append((event, data))
        self.changed.set()
        self.changed = asyncio.Event()


class JobStore:
    """Jobs by id; keeps at most ``max_finished`` finished jobs (oldest evicted with their files)."""

    def __init__(self, output_dir: Path, max_finished: int = 1000) -> None:
        self.output_dir = output_dir
        self.max_finished = max_finished
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.write_failures = 0
        self.written = 0

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def add(self, job: Job, engine: Any) -> None:
        self.jobs[job.id] = job
        job.publish("status", job.to_dict())
        job.task = asyncio.create_task(self._follow(job, engine), name=f"job-{job.id}")

    def remove(self, job_id: str) -> Job | None:
        job = self.jobs.pop(job_id, None)
        if job is not None and job.path is not None:
            job.path.unlink(missing_ok=True)
        return job

    def counts(self) -> dict[str, int]:
        out = {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0}
        for j in self.jobs.values():
            out[j.status] = out.get(j.status, 0) + 1
        return out

    async def _follow(self, job: Job, engine: Any) -> None:
        h = job.handle
        try:
            async for ev in h.events():
                if ev.kind is EventKind.PROGRESS and ev.total:
                    job.publish("progress", {
                        "id": job.id, "status": job.status, "progress": job.progress,
                        "node": ev.node, "step": ev.step, "total": ev.total,
                    })
            out = await h.result()
            await self._finish(job, out)
        except Exception as exc:  # never leave a job non-terminal
            log.exception("job %s follower failed", job.id)
            job.final_status = "failed"
            job.error = {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}
        finally:
            if job.final_status is None:
                job.final_status = "failed"
                job.error = job.error or {"code": "server_error", "message": "job follower stopped"}
            job.completed_at = int(time.time())
            job.final_progress = int(h.progress * 100)
            job.handle = None  # the output (tensors) is on disk now; drop it and the handle's events
            engine.forget(job.id)
            job.publish("done", job.to_dict())
            self._evict()

    async def _finish(self, job: Job, out: Any) -> None:
        from omniloop.schema import _jsonable

        job.metrics = {k: _jsonable(out.metrics[k]) for k in ("steps", "total_seconds", "seed") if k in out.metrics}
        if out.status is Status.COMPLETED:
            video = out.artifacts.get("video")
            if video is None or getattr(video, "frames", None) is None:
                job.final_status, job.error = "failed", {"code": "no_video", "message": "the pipeline produced no video"}
                return
            path = self.output_dir / f"{job.id}.mp4"
            try:
                from omniloop.media import write_mp4

                await asyncio.to_thread(write_mp4, video.frames, float(video.fps), path)
            except Exception as exc:
                self.write_failures += 1
                log.exception("writing %s failed", path)
                job.final_status = "failed"
                job.error = {"code": "output_write_failed", "message": f"{type(exc).__name__}: {exc}"}
                return
            self.written += 1
            job.path, job.frames, job.fps = path, int(video.frames.shape[0]), float(video.fps)
            job.final_status = "completed"
            return
        job.final_status = out.status.value
        if out.error is not None:
            job.error = {"code": out.error.type, "message": out.error.message, "node": out.error.node, "step": out.error.step}

    def _evict(self) -> None:
        finished = [j for j in self.jobs.values() if j.terminal]
        for j in finished[: max(0, len(finished) - self.max_finished)]:
            self.remove(j.id)
