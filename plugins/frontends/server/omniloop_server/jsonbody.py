"""Reading a JSON body without holding the server's GIL for long.

``json.loads`` is C code that keeps the GIL for the whole body: a 30 MB body is 50-500 ms during
which the event loop (``/health``, every stream) cannot run, even though the parse happens in a
preparation thread. So a body of at least ``server.json_process_bytes`` is parsed in a helper
process (:class:`JsonProcesses`: plain ``python -I`` children running this file, which imports
nothing but the standard library); the object comes back in :mod:`marshal` form, whose loading is
little more than a copy. Smaller bodies are parsed in the thread (:func:`decode`).

Both paths give the same answer: the object, or a :class:`BodyUnreadable` with the message the
client gets (400 ``invalid_body``). Protocol with a child: the parent writes an 8-byte big-endian
length and the body; the child answers one byte (0: the object follows, 1: an error message
follows), an 8-byte length and the payload. A child that dies is replaced at the next body.
"""

from __future__ import annotations

import json
import marshal
import queue
import subprocess
import sys
import threading
from typing import Any

#: the deepest a body may nest before the parser gives up (check_tree refuses far less)
_RECURSION = "the body nests too deeply"
#: field names whose string values may be images (base64 or a data: URL): they may be as long as
#: the image cap; every other string only as long as the text cap (:class:`StringCaps`)
IMAGE_KEYS = frozenset({"input_reference", "image", "image_url", "mask", "data_b64"})


class BodyUnreadable(ValueError):
    """The body is not readable JSON; ``message`` says why (the client's 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StringTooLong(ValueError):
    """A string longer than any field at its place takes: ``path`` (dotted), its ``length``, ``cap``."""

    def __init__(self, path: str, length: int, cap: int, image: bool) -> None:
        super().__init__(path)
        self.path, self.length, self.cap, self.image = path, length, cap, image


class StringCaps:
    """The longest string a body may hold: ``text`` chars anywhere, ``image`` under an
    :data:`IMAGE_KEYS` field (a base64 image). Checked where the body is parsed — in the helper
    process for a large body, so a 30 MB prompt never becomes a string in the server's process."""

    def __init__(self, text: int, image: int) -> None:
        self.text, self.image = text, image

    def check(self, body: Any) -> None:
        """Raise :class:`StringTooLong` for the first string over its cap (iterative walk)."""
        stack: list[tuple[Any, str, str]] = [(body, "", "")]
        while stack:
            value, path, key = stack.pop()
            if isinstance(value, str):
                if len(value) > self.text:
                    cap = self.image if key in IMAGE_KEYS else self.text
                    if len(value) > cap:
                        raise StringTooLong(path or "body", len(value), cap, key in IMAGE_KEYS)
            elif isinstance(value, dict):
                stack.extend((v, f"{path}.{k}" if path else str(k), str(k)) for k, v in value.items())
            elif isinstance(value, list):
                stack.extend((v, f"{path}.{i}" if path else str(i), key) for i, v in enumerate(value))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows (non-finite numbers are refused)")


def decode(raw: bytes, max_depth: int = 32) -> Any:
    """``raw`` (UTF-8 JSON, an optional BOM) → the object, or :class:`BodyUnreadable`."""
    if not raw.strip():
        raise BodyUnreadable("the body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyUnreadable(f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise BodyUnreadable(f"the body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise BodyUnreadable(f"{_RECURSION} (at most {max_depth} levels)") from None
    except ValueError as exc:  # NaN/Infinity, integers over Python's digit limit
        text = str(exc)
        raise BodyUnreadable(f"the body is not acceptable JSON: {text if len(text) <= 200 else text[:197] + '...'}") from None


def _read_exact(stream: Any, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def _child() -> None:
    """The helper process: parse bodies from stdin until it closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            head = _read_exact(inp, 24)  # body length, text cap, image cap
        except EOFError:
            return
        text_cap, image_cap = (int.from_bytes(b, "big") for b in (head[8:16], head[16:24]))
        raw = _read_exact(inp, int.from_bytes(head[:8], "big"))
        try:
            body = decode(raw)
            StringCaps(text_cap, image_cap).check(body)
            tag, payload = 0, marshal.dumps(body)
        except StringTooLong as exc:
            tag, payload = 2, marshal.dumps((exc.path, exc.length, exc.cap, exc.image))
        except BodyUnreadable as exc:
            tag, payload = 1, exc.message.encode("utf-8", "backslashreplace")
        except ValueError:  # marshal: nested deeper than it writes
            tag, payload = 1, f"{_RECURSION}".encode()
        except MemoryError:
            tag, payload = 1, b"the body is too large to parse"
        del raw
        out.write(bytes([tag]) + len(payload).to_bytes(8, "big"))
        out.write(payload)
        out.flush()


class JsonProcesses:
    """Up to ``size`` helper processes parsing JSON bodies (started when first needed, reused)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: queue.LifoQueue[subprocess.Popen[bytes]] = queue.LifoQueue()
        self._started = 0
        self._lock = threading.Lock()
        self._closed = False
        self._all: list[subprocess.Popen[bytes]] = []

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0, close_fds=True)
        self._all.append(proc)
        return proc

    def start(self) -> None:
        """Start the helper processes now (the server's start-up), not at the first large body:
        starting a process from a big server process takes tens of milliseconds of its GIL."""
        with self._lock:
            while self._started < self.size and not self._closed:
                self._started += 1
                self._idle.put(self._spawn())

    def _take(self) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._closed:
                raise BodyUnreadable("the server is shutting down")
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                if self._started < self.size:
                    self._started += 1
                    return self._spawn()
        return self._idle.get()

    def _give(self, proc: subprocess.Popen[bytes] | None) -> None:
        with self._lock:
            if proc is None:  # it died: the next taker starts a new one
                self._started -= 1
            elif self._closed:
                proc.kill()
            else:
                self._idle.put(proc)

    def parse(self, raw: bytes | list[bytes], caps: StringCaps | None = None) -> Any:
        """``raw`` (bytes, or the body's chunks: never joined here) → the object (as :func:`decode`),
        parsed in a helper process, its strings checked against ``caps`` there (:class:`StringTooLong`).
        Blocking: call it from a worker thread (the pipe reads and writes release the GIL)."""
        big = 1 << 62
        text_cap, image_cap = (caps.text, caps.image) if caps is not None else (big, big)
        chunks = [raw] if isinstance(raw, bytes) else raw
        proc = self._take()
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(sum(map(len, chunks)).to_bytes(8, "big") + text_cap.to_bytes(8, "big")
                             + image_cap.to_bytes(8, "big"))
            for chunk in chunks:
                proc.stdin.write(chunk)
            head = _read_exact(proc.stdout, 9)
            payload = _read_exact(proc.stdout, int.from_bytes(head[1:], "big"))
        except (OSError, EOFError, ValueError):
            proc.kill()
            proc.wait()
            self._give(None)
            raise BodyUnreadable("the body could not be parsed (the parser process ended)") from None
        self._give(proc)
        if head[0] == 1:
            raise BodyUnreadable(payload.decode("utf-8", "replace"))
        if head[0] == 2:
            raise StringTooLong(*marshal.loads(payload))
        return marshal.loads(payload)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs, self._all = self._all, []
        for proc in procs:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    _child()
