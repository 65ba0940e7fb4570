"""``omniloop eval compare``: what a change of arithmetic, backend or checkpoint did to the verdicts
of the same clips.

Two ``omniloop eval adherence --json`` reports of the same prompts and seeds are matched clip by
clip (steps, prompt, seed); for each check, the verdicts *lost* (held in the base run, fail in the
other) and *gained* are counted. A detector at its threshold flips verdicts both ways under any
change of rounding — on wan-demo, rounding attention's q/k/v to bf16 alone changes ~14 % of the
shape verdicts, half of them each way — so the count lost alone says little; what says whether
the change costs adherence is the balance, read by McNemar's exact test: with no effect, each
changed verdict is as likely lost as gained (a binomial with p = 1/2 over the changes), and
:func:`mcnemar_p` is the two-sided probability of a split at least as uneven as the one seen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: below this McNemar p, a lost/gained imbalance is reported as an effect, not noise
SIGNIFICANCE = 0.05


class ReportError(ValueError):
    """A report file that cannot be compared (the message names the file and what is wrong)."""


def mcnemar_p(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p of ``lost`` against ``gained`` changed verdicts (1.0 when none changed)."""
    if lost < 0 or gained < 0:
        raise ValueError(f"counts must be >= 0, got lost={lost}, gained={gained}")
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def load_report(path: str | Path) -> dict[str, Any]:
    """An ``eval adherence --json`` file, checked: ``{"kind", "reports": [{"steps", "clips": [...]}]}``
    with every clip's ``prompt``, ``seed`` and ``ok`` verdicts."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ReportError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{p}: not a JSON report ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("reports"), list) or not doc["reports"]:
        raise ReportError(f"{p}: not an 'omniloop eval adherence --json' report (no 'reports' list)")
    for i, rep in enumerate(doc["reports"]):
        clips = rep.get("clips") if isinstance(rep, dict) else None
        if not isinstance(clips, list) or not clips:
            raise ReportError(f"{p}: reports[{i}] has no per-clip verdicts ('clips'); write the report with --json")
        for j, c in enumerate(clips):
            if not (isinstance(c, dict) and isinstance(c.get("prompt"), str) and isinstance(c.get("seed"), int)
                    and isinstance(c.get("ok"), dict) and all(isinstance(v, bool) for v in c["ok"].values())):
                raise ReportError(f"{p}: reports[{i}].clips[{j}] lacks a prompt, an integer seed or boolean 'ok' verdicts")
    return doc


def _clips_by_key(doc: dict[str, Any]) -> dict[tuple[int, str, int], dict[str, bool]]:
    out: dict[tuple[int, str, int], dict[str, bool]] = {}
    for rep in doc["reports"]:
        for c in rep["clips"]:
            out[(int(rep.get("steps", 0)), c["prompt"], c["seed"])] = c["ok"]
    return out


def _rows(a: dict[tuple[int, str, int], dict[str, bool]], b: dict[tuple[int, str, int], dict[str, bool]],
          shared: list[tuple[int, str, int]]) -> list[dict[str, Any]]:
    checks = [k for k in a[shared[0]] if all(k in a[s] and k in b[s] for s in shared)]
    rows = []
    for check in checks:
        lost = sum(1 for s in shared if a[s][check] and not b[s][check])
        gained = sum(1 for s in shared if not a[s][check] and b[s][check])
        p = mcnemar_p(lost, gained)
        rows.append({"check": check, "base": sum(a[s][check] for s in shared) / len(shared),
                     "other": sum(b[s][check] for s in shared) / len(shared), "lost": lost, "gained": gained,
                     "p": p, "reading": "no effect seen" if p >= SIGNIFICANCE else ("loses" if lost > gained else "gains")})
    return rows


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Per check over the clips both reports hold: accuracy of each, verdicts lost and gained (base →
    other), McNemar p, and ``reading``: ``"no effect seen"``, ``"loses"`` or ``"gains"`` (p below
    :data:`SIGNIFICANCE`). Reports of several step counts (``--steps 20,4``) are compared over all
    shared clips (``checks``) and per step count (``by_steps``, when there is more than one).
    ``ValueError`` when the kinds differ or no clip is shared."""
    kb, ko = base.get("kind", "video"), other.get("kind", "video")
    if kb != ko:
        raise ValueError(f"the reports score different kinds ({kb} vs {ko})")
    a, b = _clips_by_key(base), _clips_by_key(other)
    shared = [k for k in a if k in b]
    if not shared:
        raise ValueError("the reports share no clip (same steps, prompt and seed): compare runs of the same "
                         "prompts and seeds")
    steps = sorted({k[0] for k in shared}, reverse=True)
    out: dict[str, Any] = {"clips": len(shared), "only_in_base": len(a) - len(shared),
                           "only_in_other": len(b) - len(shared), "kind": kb, "checks": _rows(a, b, shared)}
    if len(steps) > 1:
        out["by_steps"] = [{"steps": n, "clips": len(sub), "checks": _rows(a, b, sub)}
                           for n in steps for sub in [[k for k in shared if k[0] == n]]]
    return out


__all__ = ["SIGNIFICANCE", "ReportError", "compare", "load_report", "mcnemar_p"]
