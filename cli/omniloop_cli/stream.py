"""``omniloop generate --stream``: frames written as they come.

A streaming deployment (e.g. Wan with ``options.rollout: causal``) emits PARTIAL events whose
artifact is a ``VideoFrames`` chunk (or an ``Image``). :class:`FrameStream` writes each chunk's
frames the moment its event arrives, as numbered PNGs in ``<out stem>.frames/``
(``frame_000000.png``, ...; a frame is complete on disk when its name appears: files are
written under a temporary name and renamed), and keeps ``<out stem>.frames/index.json``
up to date (chunks so far: first frame, frame count, fps). The whole clip is still written to
``--out`` at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omniloop.artifacts import Image, VideoFrames
from omniloop.request import EventKind
from omniloop_io import media


class FrameStream:
    def __init__(self, out: Path) -> None:
        self.folder = out.with_name(out.stem + ".frames")
        self.frames = 0
        self.chunks: list[dict[str, Any]] = []

    def update(self, event: Any) -> list[Path]:
        """Write the frames of a PARTIAL event; return the files written (none for other events)."""
        if event.kind is not EventKind.PARTIAL:
            return []
        art = event.value
        if isinstance(art, VideoFrames):
            frames, fps = art.frames, float(art.fps)
        elif isinstance(art, Image):
            frames, fps = art.pixels.unsqueeze(0), None
        else:
            return []
        self.folder.mkdir(parents=True, exist_ok=True)
        written = []
        first = self.frames
        for frame in frames:
            written.append(media.write_png(frame, self.folder / f"frame_{self.frames:06d}.png"))
            self.frames += 1
        self.chunks.append({"node": event.node, "step": event.step, "artifact": event.artifact,
                            "first_frame": first, "frames": int(frames.shape[0]), "fps": fps})
        tmp = self.folder / "index.json.tmp"
        tmp.write_text(json.dumps({"frames": self.frames, "chunks": self.chunks}, indent=2))
        tmp.replace(self.folder / "index.json")
        return written
