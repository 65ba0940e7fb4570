"""Fixtures for the omniloop-dynamo tests: find (or, opt-in, install) ai-dynamo and run a loopback
Dynamo deployment (frontend + omniloop workers) with file discovery in a temp folder.

ai-dynamo is not a dependency of any package (``pip install ai-dynamo`` fails where only PyPI is
reachable); ``plugins/frontends/dynamo/install-dynamo.sh`` installs it into an overlay venv next to the
omniloop env. The end-to-end tests look for a Python that imports ``dynamo.llm``:

1. ``$OMNILOOP_DYNAMO_PYTHON``;
2. ``<this env>/dynamo-overlay/bin/python`` (where install-dynamo.sh puts it by default);
3. this interpreter.

With ``OMNILOOP_TEST_DYNAMO=install`` they run install-dynamo.sh first when none is found (about
a minute and ~420 MB from PyPI). Otherwise they skip, saying how to enable them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "plugins" / "frontends" / "dynamo" / "install-dynamo.sh"
SKIP_REASON = (
    "ai-dynamo 1.6.1 is not installed for the omniloop-dynamo end-to-end tests: run "
    "`bash plugins/frontends/dynamo/install-dynamo.sh` (or set OMNILOOP_TEST_DYNAMO=install to let the tests do it)"
)


def _imports_dynamo(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import dynamo.llm, dynamo.runtime, omniloop_dynamo"],
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find_dynamo_python() -> str | None:
    env = os.environ.get("OMNILOOP_DYNAMO_PYTHON")
    candidates = [env] if env else []
    candidates += [str(Path(sys.prefix) / "dynamo-overlay" / "bin" / "python"), sys.executable]
    for c in candidates:
        if c and Path(c).exists() and _imports_dynamo(c):
            return c
    return None


@pytest.fixture(scope="session")
def dynamo_python() -> str:
    py = find_dynamo_python()
    if py is None and os.environ.get("OMNILOOP_TEST_DYNAMO") == "install":
        r = subprocess.run(["bash", str(INSTALL), "--python", sys.executable], capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            pytest.fail(f"install-dynamo.sh failed:\n{r.stderr[-4000:]}")
        py = r.stdout.strip().splitlines()[-1]
    if py is None:
        pytest.skip(SKIP_REASON)
    return py


def free_port(below: int | None = None) -> int:
    """A free loopback port; ``below``: one under that number (Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16)."""
    if below is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, below)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {below}")


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one HTTP request; HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw.strip().startswith(b"{") else {"raw": raw.decode()})
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw.decode(errors="replace")}


class Deployment:
    """A frontend and omniloop workers on loopback, sharing a file-discovery folder."""

    def __init__(self, python: str, root: Path) -> None:
        self.python = python
        self.root = root
        self.kv = root / "kv"
        self.kv.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.system_ports: dict[str, int] = {}
        self.http_port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DYN_")},
            "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.kv), "DYN_REQUEST_PLANE": "tcp",
            "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        with open(log, "wb") as f:
            p = subprocess.Popen([self.python, *args], stdout=f, stderr=subprocess.STDOUT, env=env or self.env,
                                 cwd=self.root, start_new_session=True)
        self.procs[name] = p
        return p

    def start_frontend(self) -> None:
        self._spawn("frontend", ["-m", "dynamo.frontend", "--discovery-backend", "file", "--http-host", "127.0.0.1",
                                 "--http-port", str(self.http_port)])

    def start_worker(self, name: str, deploy: Path, model_name: str, *extra: str) -> None:
        port = free_port(below=32768)
        self.system_ports[name] = port
        self._spawn(name, ["-m", "omniloop_dynamo.worker", "--deploy", str(deploy), "--model-name", model_name,
                           "--discovery-backend", "file", "--host", "127.0.0.1", "--system-port", str(port),
                           "--media-dir", str(self.root / "media"), "--grace-period", "0.5", *extra])

    def instances(self) -> int:
        d = self.kv / "v1" / "instances"
        return len(list(d.iterdir())) if d.is_dir() else 0

    def wait_ready(self, model: str, instances: int, timeout: float = 150.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")
            try:
                status, body = http("GET", f"{self.url}/v1/models", timeout=5)
                ids = {m.get("id") for m in body.get("data", [])} if status == 200 else set()
            except OSError:
                ids = set()
            if model in ids and self.instances() >= instances:
                time.sleep(1.0)  # let the frontend's watcher commit every instance
                return
            time.sleep(0.5)
        raise AssertionError(f"deployment not ready after {timeout}s:\n" + "\n".join(self.tail(n) for n in self.procs))

    def metrics(self, name: str) -> dict[str, float]:
        """The worker's omniloop_* samples, keyed by the sample line's name and labels."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.system_ports[name]}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("omniloop_"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def completed(self, name: str, kind: str = "video") -> int:
        for key, v in self.metrics(name).items():
            if key.startswith("omniloop_dynamo_requests_total") and f'kind="{kind}"' in key and 'outcome="completed"' in key:
                return int(v)
        return 0

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        if p.poll() is None:
            os.kill(p.pid, sig)

    def tail(self, name: str, n: int = 4000) -> str:
        log = self.logs.get(name)
        text = log.read_text(errors="replace") if log and log.exists() else ""
        return f"--- {name} ---\n{text[-n:]}"

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)


@pytest.fixture
def http_call():
    """The :func:`http` helper: ``http_call(method, url, body=None, timeout=120) -> (status, json)``."""
    return http


@pytest.fixture
def deployment_factory(dynamo_python: str, tmp_path_factory: pytest.TempPathFactory):
    made: list[Deployment] = []

    def make(name: str = "dyn") -> Deployment:
        d = Deployment(dynamo_python, tmp_path_factory.mktemp(name))
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
