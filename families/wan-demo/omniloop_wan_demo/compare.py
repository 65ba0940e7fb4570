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

The verdicts are thresholds on the detector's continuous measurements (an image's ``area``, ``fill``,
``convexity``, ``hull_fill``, ``centroid``; a clip's ``travel``, ``velocity``, ...), which every report
keeps in each clip's ``detected``. :func:`feature_shifts` compares those clip by clip: the mean paired
shift of each (other − base), its standard error and a paired t-test's two-sided p — overall and per expected value of
one check (``by``, e.g. per expected shape). A change that moves the images systematically shows there
long before it shows in the verdict counts, and two changes that flip verdicts differently can be seen
to move the images alike (issue 40: FP8 linears shrink flux-demo's objects by ~2 pixels on the GPU and
on the CPU alike, while the shape verdicts they flip split differently).
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


def _numeric_features(detected: Any) -> dict[str, float]:
    """The finite numbers of a clip's ``detected`` dict: scalars by name, lists of numbers as
    ``name[i]`` (a centroid, a velocity); labels, booleans and non-finite values are left out."""
    out: dict[str, float] = {}
    if not isinstance(detected, dict):
        return out

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for k, v in detected.items():
        if number(v):
            out[k] = float(v)
        elif isinstance(v, list) and v and all(number(x) for x in v):
            out.update({f"{k}[{i}]": float(x) for i, x in enumerate(v)})
    return out


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    out = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            out *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * out


def student_t_p(t: float, df: int) -> float:
    """Two-sided p of Student's t with ``df`` degrees of freedom (the paired t-test of ``n = df + 1`` shifts)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if math.isinf(t):
        return 0.0
    return min(1.0, _betainc(df / 2.0, 0.5, df / (df + t * t)))


def feature_shifts(base: dict[str, Any], other: dict[str, Any], by: str | None = None) -> list[dict[str, Any]]:
    """The paired shift (other − base) of each numeric feature the detector measured, over the shared
    clips where both runs measured it: ``{"group", "feature", "n", "base_mean", "shift", "se", "z", "p",
    "reading"}`` per row, first over all clips (group ``"all"``), then — with ``by`` — per expected value of
    that check (``clip["expected"][by]``, e.g. ``by="shape"``: squares apart from circles, whose features a
    change may move in opposite directions).

    ``se`` is the standard error of the mean shift (sample sd / √n), ``z = shift / se`` and ``p`` the
    paired t-test's two-sided p (Student's t with n − 1 degrees of freedom; n ≥ 2; a row whose shifts are
    all equal has ``se`` 0 and ``p`` 1.0 when the shift is 0, else 0.0). ``reading`` is ``"shifts"`` when ``p`` is below :data:`SIGNIFICANCE` divided by the
    number of rows (Bonferroni: many features are tested at once), else ``"no shift seen"``.
    ``ValueError`` when the kinds differ or no clip is shared."""
    kb, ko = base.get("kind", "video"), other.get("kind", "video")
    if kb != ko:
        raise ValueError(f"the reports score different kinds ({kb} vs {ko})")

    def by_key(doc: dict[str, Any]) -> dict[tuple[int, str, int], dict[str, Any]]:
        return {(int(rep.get("steps", 0)), c["prompt"], c["seed"]): c for rep in doc["reports"] for c in rep["clips"]}

    a, b = by_key(base), by_key(other)
    shared = [k for k in a if k in b]
    if not shared:
        raise ValueError("the reports share no clip (same steps, prompt and seed): compare runs of the same "
                         "prompts and seeds")
    groups: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for key in shared:
        fa, fb = _numeric_features(a[key].get("detected")), _numeric_features(b[key].get("detected"))
        expected = a[key].get("expected")
        names = ["all"]
        if by is not None and isinstance(expected, dict) and isinstance(expected.get(by), str):
            names.append(f"{by}={expected[by]}")
        for name in names:
            g = groups.setdefault(name, {})
            for feat in fa.keys() & fb.keys():
                g.setdefault(feat, []).append((fa[feat], fb[feat]))
    rows = []
    order = ["all", *sorted(n for n in groups if n != "all")]
    for name in order:
        for feat in sorted(groups.get(name, {})):
            pairs = groups[name][feat]
            n = len(pairs)
            if n < 2:
                continue
            d = [y - x for x, y in pairs]
            mean = math.fsum(d) / n
            var = math.fsum((v - mean) ** 2 for v in d) / (n - 1)
            se = math.sqrt(var / n)
            if se > 0:
                z = mean / se
                p = student_t_p(z, n - 1)
            else:
                z, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
            rows.append({"group": name, "feature": feat, "n": n, "base_mean": math.fsum(x for x, _ in pairs) / n,
                         "shift": mean, "se": se, "z": z, "p": p})
    threshold = SIGNIFICANCE / max(len(rows), 1)
    for r in rows:
        r["reading"] = "shifts" if r["p"] < threshold else "no shift seen"
    return rows


def _setting(rep: dict[str, Any]) -> str:
    """What makes two reports' clips comparable: steps, guidance, backend and the deploy under test."""
    deploy = (rep.get("extra") or {}).get("deploy") if isinstance(rep.get("extra"), dict) else None
    return json.dumps({"steps": rep.get("steps"), "guidance_scale": rep.get("guidance_scale"),
                       "backend": rep.get("backend"), "deploy": deploy}, sort_keys=True)


def merge_reports(docs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One report from several runs of the same evaluation over different seeds or prompts (a long evaluation split
    over machines or time limits): each setting's clips concatenated in the order given, ``n``, ``seconds`` and the
    clip-weighted ``accuracy`` recomputed. ``ValueError`` naming the file when the runs differ in model, kind or the
    settings they hold (steps, guidance, backend, deploy), or when a clip (steps, prompt, seed) is in two of them."""
    if len(docs) < 2:
        raise ValueError("give at least two reports to merge")
    first, head = docs[0], names[0]
    for doc, name in zip(docs[1:], names[1:], strict=True):
        for key in ("model", "kind"):
            if doc.get(key) != first.get(key):
                raise ValueError(f"{name}: {key} {doc.get(key)!r} is not {head}'s {first.get(key)!r}")
    groups: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[Any, str, int], str] = {}
    expected = sorted(_setting(r) for r in first["reports"])
    for doc, name in zip(docs, names, strict=True):
        settings = sorted(_setting(r) for r in doc["reports"])
        if settings != expected:
            if len(settings) == len(expected) == 1:  # the usual case: name the fields that differ
                a, b = json.loads(settings[0]), json.loads(expected[0])
                what = ", ".join(f"{k} {json.dumps(a[k])} (not {json.dumps(b[k])})" for k in a if a[k] != b[k])
            else:
                what = f"settings {settings} (not {expected})"
            raise ValueError(f"{name} differs from {head}: {what}; merge runs of one evaluation")
        for rep in doc["reports"]:
            key = _setting(rep)
            for c in rep["clips"]:
                clip = (rep.get("steps"), c["prompt"], c["seed"])
                if clip in seen:
                    raise ValueError(f"{name}: the clip {c['prompt']!r} seed {c['seed']} ({rep.get('steps')} steps) "
                                     f"is also in {seen[clip]}")
                seen[clip] = name
            acc = rep.get("accuracy") or {}
            if key not in groups:
                groups[key] = dict(rep, clips=list(rep["clips"]), n=len(rep["clips"]),
                                   accuracy={k: v * len(rep["clips"]) for k, v in acc.items()},
                                   seconds=float(rep.get("seconds") or 0.0))
                continue
            g = groups[key]
            if set(acc) != set(g["accuracy"]):
                raise ValueError(f"{name}: accuracy keys {sorted(acc)} are not {head}'s {sorted(g['accuracy'])}")
            g["clips"] += rep["clips"]
            g["n"] += len(rep["clips"])
            g["seconds"] += float(rep.get("seconds") or 0.0)
            g["accuracy"] = {k: g["accuracy"][k] + v * len(rep["clips"]) for k, v in acc.items()}
    for g in groups.values():
        g["accuracy"] = {k: v / g["n"] for k, v in g["accuracy"].items()}
    return {"model": first.get("model"), "kind": first.get("kind"), "merged_from": list(names),
            "reports": list(groups.values())}


__all__ = ["SIGNIFICANCE", "ReportError", "compare", "feature_shifts", "load_report", "mcnemar_p", "merge_reports",
           "student_t_p"]
