"""Video jobs: status, progress, SSE events, the output file written atomically, a durable record.
(:class:`BaseJob` and :class:`FinishedJobs` are what audio jobs share with them.)

A job follows its engine handle in an asyncio task. When the request completes, the mp4 is
written with :func:`omniloop_io.media.write_mp4` (temporary file + ``os.replace``) in a thread, and
only then does the job become ``completed``: its content is never served half-written.

Output files are named by a server-made random id (``<32 hex>.mp4``), never by anything a client
sent; every path is resolved and refused unless it lies directly in the output folder. Each job's
final state is appended to ``<output folder>/jobs.jsonl`` when it ends (also when the server shuts
down and cancels it), so no job vanishes without a record.

Statuses: internally ``queued``, ``in_progress``, ``completed``, ``failed``, ``cancelled``. The
API object follows OpenAI's ``Video`` (status ``queued | in_progress | completed | failed``): a
cancelled job is ``failed`` with ``error.code == "cancelled"``.

Restart (:meth:`JobStore.restore`, when the server starts on an output folder that has a
``jobs.jsonl``): a job is recorded when it is accepted (``"status": "queued"``) and again when it
ends, so the record knows every job. On start, the newest ``max_finished`` finished jobs are listed
again, and a completed one's mp4 is served while its file is there; a job accepted but never
ended (the server was killed) is listed as ``failed`` (``error.code: "server_restarted"``). Ids
of every recorded job — deleted ones too — are never given to a new job. Retention: the output
files of jobs that are not kept (evicted, deleted, unknown to the record) are deleted at start
(only files named as this server names them), and the record is rewritten to the kept jobs plus
the ids already used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Generic, TypeVar

from omniloop.request import EventKind, Status

log = logging.getLogger("omniloop.server")

TERMINAL = ("completed", "failed", "cancelled")
MAX_JOB_EVENTS = 5000
RECORD_NAME = "jobs.jsonl"
#: the output files this server writes (and may delete at restart): ``<32 hex>.mp4`` and variants
OUTPUT_FILE = re.compile(r"^[0-9a-f]{32}\.(mp4|thumbnail\.png|spritesheet\.png)$")
#: the longest ``jobs.jsonl`` read at restart (a bigger one is renamed aside, not parsed)
MAX_RECORD_BYTES = 64 * 1024 * 1024


class BaseJob:
    """What a video job and an audio job share: the engine handle it follows, its status and
    progress, cancelling it, and settling its final state from the engine's output."""

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
        self.metrics: dict[str, Any] = {}
        self.cancel_requested = False
        self.deleted = False
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
        """OpenAI's status: a cancelled job is ``failed`` (its ``error.code`` says cancelled)."""
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

    def request_cancel(self, engine: Any) -> None:
        """The client's cancel (or delete): asks the engine to stop the job unless it already ended."""
        if not self.terminal:
            self.cancel_requested = True
            engine.cancel(self.id)

    def keep_metrics(self, out: Any) -> None:
        from omniloop.schema import jsonable

        self.metrics = {k: jsonable(out.metrics[k]) for k in ("steps", "total_seconds", "seed") if k in out.metrics}

    def settle_unfinished(self, out: Any, shutdown: str | None) -> None:
        """The final state of an output that did not complete: its status, and why (``shutdown``:
        the message of a cancel the server made as it shut down, None while it runs)."""
        self.final_status = out.status.value
        if out.status is Status.CANCELLED:
            why = "cancelled by the client" if self.cancel_requested else shutdown or "cancelled"
            self.error = {"code": "cancelled", "message": why}
        elif out.error is not None:
            self.error = {"code": out.error.type, "message": out.error.message, "node": out.error.node,
                          "step": out.error.step}

    def fail(self, exc: BaseException) -> None:
        """Its follower raised: the job failed (never left non-terminal)."""
        self.final_status = "failed"
        self.error = {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}

    def release(self, handle: Any, engine: Any) -> None:
        """The follower ends: a terminal state for sure, the final progress kept, the handle (and the
        output's tensors) dropped and forgotten by the engine."""
        if self.final_status is None:
            self.final_status = "failed"
            self.error = self.error or {"code": "server_error", "message": "job follower stopped"}
        self.completed_at = self.completed_at or int(time.time())
        self.final_progress = int(handle.progress * 100)
        self.handle = None
        engine.forget(self.id)


J = TypeVar("J", bound=BaseJob)


class FinishedJobs(Generic[J]):
    """Jobs by id, in creation order; at most ``max_finished`` finished ones (the oldest evicted,
    with their files)."""

    def __init__(self, max_finished: int) -> None:
        self.max_finished = max_finished
        self.jobs: OrderedDict[str, J] = OrderedDict()

    def get(self, job_id: str) -> J | None:
        return self.jobs.get(job_id)

    def remove(self, job_id: str) -> J | None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            job.deleted = True
            self._removed(job)
        return job

    def _removed(self, job: J) -> None:
        """A removed job's files go (and what else a store keeps of it)."""
        if job.path is not None:
            job.path.unlink(missing_ok=True)

    def evict(self) -> None:
        finished = [j for j in self.jobs.values() if j.terminal]
        for j in finished[: max(0, len(finished) - self.max_finished)]:
            self.remove(j.id)


class Job(BaseJob):
    """A video job (OpenAI's ``Video``), with its SSE events and its durable record."""

    def __init__(self, handle: Any, *, model: str, info: dict[str, Any]) -> None:
        super().__init__(handle, model=model, info=info)
        self.frames: int | None = None
        self.fps: float | None = None
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.changed = asyncio.Event()
        #: a digest of the body that made it (``bodies.body_fingerprint``): a retry with the same
        #: Idempotency-Key or request id and the same body answers this job; None after a restart
        self.fingerprint: str | None = None

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

    @classmethod
    def from_record(cls, rec: dict[str, Any], output_dir: Path) -> Job:
        """A finished job listed again after a restart (no handle; its mp4 served if still there)."""
        job = cls.__new__(cls)
        job.handle = None
        job.fingerprint = None  # a retry of it after the restart is refused, not replayed
        job.id = str(rec["id"])
        job.model = str(rec.get("model") or "")
        job.info = {k: v for k, v in (rec.get("info") or {}).items() if isinstance(k, str)} if isinstance(rec.get("info"), dict) else {}
        job.created_at = int(rec.get("created_at") or 0)
        job.completed_at = rec.get("completed_at") if isinstance(rec.get("completed_at"), int) else None
        status = rec.get("status")
        job.final_status = status if status in TERMINAL else None
        job.error = rec.get("error") if isinstance(rec.get("error"), dict) else None
        name = rec.get("file")
        job.path = None
        if job.final_status == "completed" and isinstance(name, str) and OUTPUT_FILE.match(name) and name.endswith(".mp4"):
            p = (output_dir / name).resolve()
            if p.parent == output_dir and p.is_file():
                job.path = p
            else:  # its file is gone: it has no content any more
                job.final_status, job.error = "failed", {"code": "content_missing",
                                                         "message": "the job completed, but its output file is gone"}
        job.frames = rec.get("frames") if isinstance(rec.get("frames"), int) else None
        job.fps = float(rec["fps"]) if isinstance(rec.get("fps"), (int, float)) else None
        job.metrics = {}
        job.cancel_requested = False
        job.deleted = False
        job.events = []
        job.changed = asyncio.Event()
        job.task = None
        job.final_progress = int(rec.get("progress") or 0) if isinstance(rec.get("progress"), int) else 0
        return job

    def record(self) -> dict[str, Any]:
        """The durable final-state record (one line of ``jobs.jsonl``)."""
        return {
            "id": self.id, "status": self.status, "error": self.error, "model": self.model,
            "created_at": self.created_at, "completed_at": self.completed_at, "progress": self.progress,
            "file": self.path.name if self.path is not None else None, "frames": self.frames, "fps": self.fps,
            "deleted": self.deleted, "info": self.info,
        }

    def publish(self, event: str, data: dict[str, Any]) -> None:
        if len(self.events) < MAX_JOB_EVENTS or event == "done":
            self.events.append((event, data))
        self.changed.set()
        self.changed = asyncio.Event()


#: the derived images written next to each mp4 (``GET .../content?variant=...``)
VARIANT_SUFFIXES = (".thumbnail.png", ".spritesheet.png")
SPRITESHEET_FRAMES = 16


def write_outputs(frames: Any, fps: float, path: Path, audio: Any = None) -> None:
    """The mp4 (atomically; with ``audio``, an ``omniloop.artifacts.Audio``, as its AAC track), then
    its thumbnail (first frame) and spritesheet (frames side by side)."""
    from omniloop_io.media import to_pil, write_mp4

    write_mp4(frames, fps, path, audio=None if audio is None else (audio.samples, int(audio.sample_rate)))
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


class JobStore(FinishedJobs[Job]):
    """Video jobs by id; keeps at most ``max_finished`` finished jobs (oldest evicted with their
    files), recording each in ``jobs.jsonl``."""

    def __init__(self, output_dir: Path, max_finished: int = 1000) -> None:
        super().__init__(max_finished)
        self.output_dir = Path(output_dir).resolve()
        self.write_failures = 0
        self.written = 0
        self.record_failures = 0
        self.shutdown_reason: str | None = None
        #: ids of every job this output folder has seen (restored from the record): never reused
        self.used_ids: set[str] = set()
        self.restored = {"jobs": 0, "interrupted": 0, "files_deleted": 0}

    def used(self, job_id: str) -> bool:
        """Whether ``job_id`` names a job this folder had (listed, deleted, or before a restart)."""
        return job_id in self.used_ids or job_id in self.jobs

    def add(self, job: Job, engine: Any) -> None:
        self.jobs[job.id] = job
        self.used_ids.add(job.id)
        self._record(job)  # accepted: a restart after a kill knows it ran (its final line follows)
        job.publish("status", job.to_dict())
        job.task = asyncio.create_task(self._follow(job, engine), name=f"job-{job.id}")

    # -- restart -------------------------------------------------------------------------------
    def restore(self) -> None:
        """Read ``jobs.jsonl`` (see the module docstring): list the kept finished jobs, fail the
        interrupted ones, remember every id, delete the outputs of jobs not kept, compact the record."""
        path = self.output_dir / RECORD_NAME
        if not path.is_file():
            return
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                aside = path.with_name(f"{RECORD_NAME}.{int(time.time())}.old")
                os.replace(path, aside)
                log.warning("%s is larger than %d bytes: moved to %s, not restored", path, MAX_RECORD_BYTES, aside)
                return
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            log.exception("reading %s failed; no job restored", path)
            return
        latest: dict[str, dict[str, Any]] = {}
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                self.used_ids.add(rec["id"])
                if rec.get("status") != "used":
                    latest.pop(rec["id"], None)
                    latest[rec["id"]] = rec  # insertion order: by when it last changed
        kept: list[Job] = []
        for rec in latest.values():
            if rec.get("deleted"):
                continue
            job = Job.from_record(rec, self.output_dir)
            if job.final_status is None or job.final_status not in TERMINAL:
                job.final_status = "failed"
                job.error = {"code": "server_restarted",
                             "message": "the server stopped while this job was queued or running"}
                job.completed_at = job.completed_at or int(time.time())
                self.restored["interrupted"] += 1
            job.publish("done", job.to_dict())
            kept.append(job)
        kept = kept[max(0, len(kept) - self.max_finished):]
        kept.sort(key=lambda j: j.created_at)  # listed in creation order, as they were
        for job in kept:
            self.jobs[job.id] = job
        self.restored["jobs"] = len(kept)
        keep_files = {f.name for j in kept if j.path is not None for f in (j.path, *(j.path.with_suffix(x) for x in VARIANT_SUFFIXES))}
        for f in self.output_dir.iterdir():
            if OUTPUT_FILE.match(f.name) and f.name not in keep_files:
                f.unlink(missing_ok=True)
                self.restored["files_deleted"] += 1
        tmp = path.with_name(f".{RECORD_NAME}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                for rid in sorted(self.used_ids - {j.id for j in kept}):
                    out.write(json.dumps({"id": rid, "status": "used"}) + "\n")
                for job in kept:
                    out.write(json.dumps(job.record(), ensure_ascii=True, default=str) + "\n")
            os.replace(tmp, path)
        except OSError:
            log.exception("compacting %s failed", path)
        if kept or self.restored["files_deleted"]:
            log.info("restored %d job(s) from %s (%d interrupted by the last stop); %d stale output file(s) deleted",
                     len(kept), path, self.restored["interrupted"], self.restored["files_deleted"])

    def _removed(self, job: Job) -> None:
        if job.path is not None:
            unlink_outputs(job.path)
        if job.terminal:  # (a running one records itself, deleted, as it ends)
            self._record(job)

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
            job.fail(exc)
        except asyncio.CancelledError:  # the server gave up on it at shutdown (it set the final state)
            pass
        finally:
            job.release(h, engine)  # the output (tensors) is on disk now; drop it and the handle's events
            self._record(job)
            job.publish("done", job.to_dict())
            self.evict()

    async def _finish(self, job: Job, out: Any) -> None:
        job.keep_metrics(out)
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
                sound = out.artifacts.get("audio")  # a video with a sound track (audio_tasks): muxed in
                await asyncio.to_thread(write_outputs, video.frames, float(video.fps), path, sound)
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
        job.settle_unfinished(out, None if self.shutdown_reason is None else f"cancelled: {self.shutdown_reason}")

    def _record(self, job: Job) -> None:
        try:
            with open(self.output_dir / RECORD_NAME, "a", encoding="utf-8") as f:
                f.write(json.dumps(job.record(), ensure_ascii=True, default=str) + "\n")
        except OSError:
            self.record_failures += 1
            log.exception("recording the final state of job %s failed", job.id)
