"""The tone-demo grammar and its synthetic clips.

A prompt names a timbre, a pitch (tonal timbres only) and a rhythm::

    a sine wave playing A4 two beats per second
    a square wave playing E4 three beats per second
    a sawtooth wave playing C5 one beat per second
    a noise drum playing four beats per second

* timbres: ``sine``, ``square``, ``sawtooth`` (band-limited additive synthesis: only the
  fundamental; odd harmonics at 1/k; every harmonic at 1/k) and ``noise`` (a ``noise drum``:
  white-noise bursts, no pitch);
* pitches: the natural notes of one octave, C4 .. C5 (equal temperament, A4 = 440 Hz);
* rhythms: one to four beats per second; beat ``k`` starts at ``offset + k / bps`` with a 5 ms
  attack and an exponential decay whose time constant is a quarter of the beat period (a drum
  decays twice as fast).

Clips are mono, :data:`SAMPLE_RATE` Hz, :data:`CLIP_SAMPLES` samples (2.048 s). :func:`synthesize`
renders a batch of clips with torch (CPU or GPU, one generator), so training data and the
evaluator's ground-truth check come from the same code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

SAMPLE_RATE = 8000
CLIP_SAMPLES = 16384  # 2.048 s; a multiple of the VAE hop (64)
CLIP_SECONDS = CLIP_SAMPLES / SAMPLE_RATE

TIMBRES: tuple[str, ...] = ("sine", "square", "sawtooth", "noise")
TONAL: tuple[str, ...] = ("sine", "square", "sawtooth")
NOTES: tuple[str, ...] = ("C4", "D4", "E4", "F4", "G4", "A4", "B4", "C5")
RATES: tuple[int, ...] = (1, 2, 3, 4)
MAX_HARMONIC = 15  # C4's 14th harmonic is the last below 0.95 x Nyquist
RATE_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
_SEMITONE = {"C": -9, "D": -7, "E": -5, "F": -4, "G": -2, "A": 0, "B": 2}
CHROMATIC = ("C", "C#", "D", "D#", "E", "F", "F#", "G", "G#", "A", "A#", "B")

#: every word a prompt can use (the tokenizer's vocabulary after its special tokens)
WORDS: tuple[str, ...] = ("a", "wave", "drum", "playing", "beat", "beats", "per", "second", *TIMBRES,
                          *(n.lower() for n in NOTES), *RATE_WORDS.values())


def note_hz(note: str) -> float:
    """``A4`` -> 440.0 (equal temperament)."""
    m = re.fullmatch(r"([A-G])(#?)(-?\d)", note.strip().upper())
    if m is None:
        raise ValueError(f"not a note name: {note!r}")
    semis = _SEMITONE[m.group(1)] + (1 if m.group(2) else 0) + 12 * (int(m.group(3)) - 4)
    return 440.0 * 2.0 ** (semis / 12.0)


def nearest_note(hz: float) -> str:
    """The chromatic note name nearest to ``hz`` (``C#4``, ``A4``, ...)."""
    semis = round(12.0 * math.log2(hz / 440.0)) + 9  # semitones above C4
    octave, pc = 4 + semis // 12, semis % 12
    return f"{CHROMATIC[pc]}{octave}"


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for; ``note`` is ``None`` for the noise drum."""

    timbre: str
    note: str | None
    bps: int

    @property
    def prompt(self) -> str:
        beats = "beat" if self.bps == 1 else "beats"
        rhythm = f"{RATE_WORDS[self.bps]} {beats} per second"
        if self.timbre == "noise":
            return f"a noise drum playing {rhythm}"
        return f"a {self.timbre} wave playing {self.note} {rhythm}"


_PROMPT = re.compile(
    r"\s*an?\s+(?:(sine|square|sawtooth)\s+wave\s+playing\s+([a-g]#?\d)|noise\s+drum\s+playing)\s+"
    r"(one|two|three|four)\s+beats?\s+per\s+second\s*", re.IGNORECASE)


def parse(prompt: str) -> Spec:
    """The :class:`Spec` of a grammar prompt; ``ValueError`` naming the grammar otherwise."""
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a tone-demo prompt: {prompt!r} (expected e.g. 'a square wave playing E4 three "
                         "beats per second' or 'a noise drum playing two beats per second')")
    timbre = (m.group(1) or "noise").lower()
    note = m.group(2).upper() if m.group(2) else None
    if note is not None and note not in NOTES:
        raise ValueError(f"note {note} is outside the trained notes {', '.join(NOTES)}")
    bps = {w: k for k, w in RATE_WORDS.items()}[m.group(3).lower()]
    return Spec(timbre, note, bps)


def all_specs() -> list[Spec]:
    """Every prompt of the grammar: 3 tonal timbres x 8 notes x 4 rates + 4 drum rates = 100."""
    out = [Spec(t, n, r) for t in TONAL for n in NOTES for r in RATES]
    return out + [Spec("noise", None, r) for r in RATES]


def eval_specs(n: int = 96) -> list[Spec]:
    """A fixed, balanced evaluation set of ``n`` prompts: timbres in turn (a quarter each), notes
    and rates cycling so that every (timbre, rate) and every (tonal timbre, note) pair appears."""
    out = []
    for i in range(n):
        timbre = TIMBRES[i % 4]
        bps = RATES[(i // 4) % 4]
        note = None if timbre == "noise" else NOTES[(i // 4 + i // 16) % len(NOTES)]
        out.append(Spec(timbre, note, bps))
    return out


def random_specs(n: int, gen: torch.Generator) -> list[Spec]:
    """``n`` prompts drawn with a quarter of each timbre."""
    t = torch.randint(0, 4, (n,), generator=gen).tolist()
    k = torch.randint(0, len(NOTES), (n,), generator=gen).tolist()
    r = torch.randint(0, len(RATES), (n,), generator=gen).tolist()
    return [Spec(TIMBRES[a], None if a == 3 else NOTES[b], RATES[c]) for a, b, c in zip(t, k, r, strict=True)]


def synthesize(specs: Iterable[Spec], *, gen: torch.Generator | None = None, device: str | torch.device = "cpu",
               jitter: bool = True) -> torch.Tensor:
    """Render clips ``[N, 1, CLIP_SAMPLES]`` (float32). With ``jitter`` the first onset (0.02 to
    0.12 s), the peak level (0.35 to 0.7) and the oscillator phase vary per clip (drawn from
    ``gen`` on the CPU); without it they are fixed (0.05 s, 0.5, phase 0)."""
    specs = list(specs)
    n = len(specs)
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    if jitter:
        offset = 0.02 + 0.10 * torch.rand(n, generator=gen)
        level = 0.35 + 0.35 * torch.rand(n, generator=gen)
        phase = 2 * math.pi * torch.rand(n, generator=gen)
    else:
        offset, level, phase = torch.full((n,), 0.05), torch.full((n,), 0.5), torch.zeros(n)
    noise = torch.randn(n, CLIP_SAMPLES, generator=gen)
    t = (torch.arange(CLIP_SAMPLES, dtype=torch.float64) / SAMPLE_RATE).to(device)
    offset, level, phase, noise = (x.to(device) for x in (offset, level, phase, noise))
    bps = torch.tensor([s.bps for s in specs], dtype=torch.float64, device=device)
    period = 1.0 / bps
    # time since the latest onset (negative before the first one)
    since = t[None, :] - offset.double()[:, None]
    local = torch.where(since >= 0, torch.remainder(since, period[:, None]), since)
    is_drum = torch.tensor([s.timbre == "noise" for s in specs], device=device)
    tau = torch.where(is_drum, period / 8, period / 4)
    attack = 0.005
    env = torch.where(local < 0, torch.zeros_like(local),
                      torch.where(local < attack, local / attack, torch.exp(-(local - attack) / tau[:, None])))
    # band-limited additive synthesis, vectorised over clips: amps[i, k-1] is harmonic k's amplitude
    nyquist = SAMPLE_RATE / 2
    amps = torch.zeros(n, MAX_HARMONIC, dtype=torch.float64)
    f0 = torch.zeros(n, dtype=torch.float64)
    for i, s in enumerate(specs):
        if s.timbre == "noise":
            continue
        f0[i] = note_hz(s.note or "A4")
        for k in range(1, MAX_HARMONIC + 1):
            if k * f0[i] >= nyquist * 0.95 or (s.timbre == "sine" and k > 1) or (s.timbre == "square" and k % 2 == 0):
                continue
            amps[i, k - 1] = 1.0 / k
    amps, f0 = amps.to(device), f0.to(device)
    tone = torch.where(is_drum[:, None], noise.double(), torch.zeros((), dtype=torch.float64, device=device))
    for k in range(1, MAX_HARMONIC + 1):
        if bool((amps[:, k - 1] != 0).any()):
            tone = tone + amps[:, k - 1:k] * torch.sin(2 * math.pi * k * f0[:, None] * t[None, :] + k * phase.double()[:, None])
    # peak-normalise the steady waveform, then shape it
    tone = tone / tone.abs().amax(dim=1, keepdim=True).clamp_min(1e-9)
    out = tone * env * level.double()[:, None]
    return out.float().unsqueeze(1)
