"""The tone-demo evaluator: what a clip plays, read from the waveform alone.

* **pitch** by spectrum: the strongest peak of the clip's magnitude spectrum (Hann window, zero
  padded to 2^17 points) between 240 and 560 Hz (the trained notes are 262 to 523 Hz), refined by
  a parabola; named as the nearest chromatic note (so a generated C#4 for D4 is wrong);
* **timbre** by harmonic profile: the share of the spectrum's energy within 2.5 % of f0 around
  each harmonic's peak (sought within 1 % of h * f0) (below 0.4: a noise drum); otherwise the 2nd and 3rd harmonic amplitudes relative to
  the fundamental pick the nearest of sine (0, 0), square (0, 1/3) and sawtooth (1/2, 1/3);
* **rhythm** by onset envelope: the rise of each 10 ms frame's log energy over the 3 frames before
  it, peaks above 0.3 of its maximum at least 0.15 s apart; beats per second = 1 / the median inter-onset interval, rounded
  to 1 .. 4.

:func:`score` compares those readings with the prompt's :class:`~omniloop_tone_demo.grammar.Spec`.
On the synthetic ground-truth clips it scores 100 % (tests/tone_demo/test_evaluator.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .grammar import SAMPLE_RATE, Spec, nearest_note, parse

NFFT = 1 << 17
PITCH_BAND = (240.0, 560.0)
HARMONIC_TOL = 0.025  # half-width of a harmonic's band, as a share of f0
SEEK_TOL = 0.01  # where harmonic h's peak is looked for: within 1 % of h * f0
NOISE_BELOW = 0.4
PROTOTYPES = {"sine": (0.0, 0.0), "square": (0.0, 1 / 3), "sawtooth": (0.5, 1 / 3)}
FRAME_HOP = SAMPLE_RATE // 100
FRAME_WIN = 2 * FRAME_HOP


@dataclass
class Reading:
    """What the evaluator heard in one clip."""

    f0: float
    note: str
    harmonicity: float
    h2: float
    h3: float
    timbre: str
    onsets: list[float]
    bps: int | None


def _spectrum(x: np.ndarray) -> np.ndarray:
    w = np.hanning(len(x))
    return np.abs(np.fft.rfft(x * w, NFFT))


def _bin(hz: float) -> float:
    return hz * NFFT / SAMPLE_RATE


def _peak(mag: np.ndarray, hz: float, tol: float) -> float:
    lo, hi = int(_bin(hz * (1 - tol))), math.ceil(_bin(hz * (1 + tol))) + 1
    return float(mag[lo:hi].max()) if hi > lo else 0.0


def read(clip: np.ndarray) -> Reading:
    """Read pitch, timbre and rhythm from a mono clip (``[samples]``, or ``[channels, samples]``:
    channels are averaged) at :data:`SAMPLE_RATE`."""
    x = np.asarray(clip, dtype=np.float64)
    if x.ndim == 2:
        x = x.mean(axis=0)
    x = x - x.mean()
    mag = _spectrum(x)
    lo, hi = int(_bin(PITCH_BAND[0])), int(_bin(PITCH_BAND[1]))
    k = lo + int(np.argmax(mag[lo:hi]))
    # parabolic refinement on the log magnitude
    a, b, c = np.log(mag[k - 1:k + 2] + 1e-12)
    shift = 0.5 * (a - c) / (a - 2 * b + c) if (a - 2 * b + c) != 0 else 0.0
    f0 = (k + float(np.clip(shift, -0.5, 0.5))) * SAMPLE_RATE / NFFT
    power = mag ** 2
    total = float(power[int(_bin(60.0)):].sum()) + 1e-20
    near = 0.0
    half = max(1, round(_bin(HARMONIC_TOL * f0)))
    h = 1
    while h * f0 * (1 + SEEK_TOL) < SAMPLE_RATE / 2:
        lo_h, hi_h = int(_bin(h * f0 * (1 - SEEK_TOL))), math.ceil(_bin(h * f0 * (1 + SEEK_TOL))) + 1
        top = lo_h + int(np.argmax(mag[lo_h:hi_h]))
        near += float(power[max(0, top - half):top + half + 1].sum())
        h += 1
    harmonicity = near / total
    a1 = _peak(mag, f0, 0.01) + 1e-12
    h2, h3 = _peak(mag, 2 * f0, 0.01) / a1, _peak(mag, 3 * f0, 0.01) / a1
    if harmonicity < NOISE_BELOW:
        timbre = "noise"
    else:
        timbre = min(PROTOTYPES, key=lambda t: (h2 - PROTOTYPES[t][0]) ** 2 + (h3 - PROTOTYPES[t][1]) ** 2)
    onsets = onset_times(x)
    bps = None
    if len(onsets) >= 2:
        ioi = float(np.median(np.diff(onsets)))
        bps = int(min(4, max(1, round(1.0 / ioi))))
    return Reading(f0=f0, note=nearest_note(f0), harmonicity=harmonicity, h2=h2, h3=h3, timbre=timbre,
                   onsets=onsets, bps=bps)


def onset_times(x: np.ndarray) -> list[float]:
    """Onset times (s): peaks of the onset envelope — how far each 10 ms frame's log energy
    (floored 20 dB below the loudest frame) rises above the quietest of the 3 frames before it —
    above 0.3 of its maximum, at least 0.15 s apart."""
    n = 1 + max(0, (len(x) - FRAME_WIN) // FRAME_HOP)
    frames = np.stack([x[i * FRAME_HOP:i * FRAME_HOP + FRAME_WIN] for i in range(n)])
    energy = (frames ** 2).mean(axis=1)
    loud = np.log(np.maximum(energy, 1e-2 * energy.max()) + 1e-12)
    lag = 3
    padded = np.concatenate([np.full(lag, loud.min()), loud])
    before = np.min(np.stack([padded[j:j + n] for j in range(lag)]), axis=0)
    flux = np.maximum(0.0, loud - before)
    if flux.max() <= 0:
        return []
    thr = 0.3 * flux.max()
    gap = int(0.15 * SAMPLE_RATE / FRAME_HOP)
    picked: list[int] = []
    for i in np.argsort(-flux, kind="stable"):
        if flux[i] < thr:
            break
        if all(abs(int(i) - j) >= gap for j in picked):
            picked.append(int(i))
    return sorted(p * FRAME_HOP / SAMPLE_RATE for p in picked)


@dataclass
class Verdict:
    prompt: str
    timbre_ok: bool
    pitch_ok: bool | None  # None: a noise drum has no pitch to score
    rhythm_ok: bool
    reading: Reading

    @property
    def all_ok(self) -> bool:
        return self.timbre_ok and self.rhythm_ok and self.pitch_ok is not False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["all_ok"] = self.all_ok
        return d


def score(clip: np.ndarray, spec: Spec | str) -> Verdict:
    """Judge one clip against the prompt (a :class:`Spec` or a grammar string)."""
    spec = parse(spec) if isinstance(spec, str) else spec
    r = read(clip)
    pitch_ok = None if spec.note is None else (r.note == spec.note and r.timbre != "noise")
    return Verdict(prompt=spec.prompt, timbre_ok=r.timbre == spec.timbre, pitch_ok=pitch_ok,
                   rhythm_ok=r.bps == spec.bps, reading=r)


@dataclass
class Report:
    """Accuracies over a set of clips (pitch over the tonal clips only)."""

    n: int
    accuracy: dict[str, float]
    counts: dict[str, list[int]]
    verdicts: list[Verdict] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, clips: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"n": self.n, "accuracy": self.accuracy, "counts": self.counts, **self.extra}
        if clips:
            d["clips"] = [v.to_dict() for v in self.verdicts]
        return d


def summarize(verdicts: Sequence[Verdict], **extra: Any) -> Report:
    def frac(flags: list[bool]) -> tuple[float, list[int]]:
        return (sum(flags) / len(flags) if flags else float("nan")), [sum(flags), len(flags)]

    acc, counts = {}, {}
    for key, flags in (("timbre", [v.timbre_ok for v in verdicts]),
                       ("pitch", [bool(v.pitch_ok) for v in verdicts if v.pitch_ok is not None]),
                       ("rhythm", [v.rhythm_ok for v in verdicts]),
                       ("all", [v.all_ok for v in verdicts])):
        acc[key], counts[key] = frac(flags)
    return Report(n=len(verdicts), accuracy=acc, counts=counts, verdicts=list(verdicts), extra=dict(extra))


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion ``p`` over ``n`` trials."""
    if n == 0 or p != p:
        return (float("nan"), float("nan"))
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def clip_seed(seed: int, index: int) -> int:
    """The generator seed of evaluation clip ``index`` (its place in :func:`~omniloop_tone_demo.grammar.eval_specs`)
    under ``seed``: every clip draws its own noise. (``eval_specs`` repeats prompts, e.g. each of
    the 4 drum prompts 6 times in 96: with one seed for all, those would be copies of one sample.)"""
    return seed * 100_000 + index


def evaluate_clips(clips: Sequence[np.ndarray], specs: Sequence[Spec], **extra: Any) -> Report:
    return summarize([score(c, s) for c, s in zip(clips, specs, strict=True)], **extra)


Generate = Callable[[list[str], list[int]], list[np.ndarray]]
