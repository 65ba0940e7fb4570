"""bench/wan_causal_stream.py runs end to end on a tiny transformer (``--smoke``, CPU): the script
does not rot. No timing is asserted; only that both sides ran and the record is complete."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "wan_causal_stream.py"


@pytest.mark.skipif(not BENCH.exists(), reason="bench/wan_causal_stream.py not in this checkout")
def test_wan_causal_stream_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("wan_causal_stream_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--repeats", "1", "--frames", "21"]) == 0
    (path,) = tmp_path.glob("wan_causal_stream-*-smoke.json")
    rec = json.loads(path.read_text())
    assert rec["command"].startswith("python bench/wan_causal_stream.py --smoke")
    assert rec["config"]["chunks"] == 2
    assert rec["stream"]["runs"][0]["frames"] == [9, 12]
    assert rec["whole"]["runs"][0]["frames"] == 21
    assert rec["stream"]["first_chunk_s"] > 0 and rec["whole"]["first_frame_s"] > 0
