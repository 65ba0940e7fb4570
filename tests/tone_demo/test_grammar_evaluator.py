"""tone-demo's grammar and evaluator: prompts round-trip, and the evaluator reads the synthetic
ground-truth clips right (100 %) and catches a wrong timbre, pitch or rhythm."""

from __future__ import annotations

import pytest
import torch

from omniloop_tone_demo.evaluate import evaluate_clips, read, score
from omniloop_tone_demo.grammar import (
    CLIP_SAMPLES,
    NOTES,
    Spec,
    all_specs,
    eval_specs,
    nearest_note,
    note_hz,
    parse,
    synthesize,
)


def test_every_prompt_round_trips():
    specs = all_specs()
    assert len(specs) == 100 and len(set(specs)) == 100
    for s in specs:
        assert parse(s.prompt) == s
    assert parse("a square wave playing E4 three beats per second") == Spec("square", "E4", 3)
    assert parse("A Sine wave playing a4 one beat per second") == Spec("sine", "A4", 1)
    assert parse("a noise drum playing two beats per second") == Spec("noise", None, 2)


@pytest.mark.parametrize("bad", ["a violin playing A4 two beats per second", "a sine wave playing A4",
                                 "a sine wave playing A6 two beats per second", "a noise drum playing A4 two beats per second",
                                 "a sine wave playing A4 five beats per second", ""])
def test_prompts_outside_the_grammar_are_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"tone-demo prompt|outside the trained notes"):
        parse(bad)


def test_notes():
    assert note_hz("A4") == 440.0
    assert note_hz("C5") == pytest.approx(523.2511, abs=1e-3)
    assert [nearest_note(note_hz(n)) for n in NOTES] == list(NOTES)
    assert nearest_note(note_hz("D4") * 2 ** (1 / 12)) == "D#4"


def test_eval_set_is_balanced():
    specs = eval_specs(96)
    assert len(specs) == 96
    for t in ("sine", "square", "sawtooth", "noise"):
        assert sum(s.timbre == t for s in specs) == 24
    for r in (1, 2, 3, 4):
        assert sum(s.bps == r for s in specs) == 24
    assert {s.note for s in specs if s.note} == set(NOTES)


def test_evaluator_scores_the_ground_truth_clips_100_percent():
    specs = eval_specs(48)
    clips = synthesize(specs, gen=torch.Generator().manual_seed(7))
    assert clips.shape == (48, 1, CLIP_SAMPLES) and clips.dtype == torch.float32
    rep = evaluate_clips([c.numpy() for c in clips], specs)
    assert rep.accuracy == {"timbre": 1.0, "pitch": 1.0, "rhythm": 1.0, "all": 1.0}, [
        (v.prompt, v.reading) for v in rep.verdicts if not v.all_ok]
    assert rep.counts["pitch"] == [36, 36]  # the noise drum has no pitch to score


def test_evaluator_catches_wrong_timbre_pitch_and_rhythm():
    clip = synthesize([Spec("square", "E4", 3)], jitter=False)[0].numpy()
    assert score(clip, "a square wave playing E4 three beats per second").all_ok
    v = score(clip, "a sawtooth wave playing E4 three beats per second")
    assert not v.timbre_ok and v.pitch_ok and v.rhythm_ok
    v = score(clip, "a square wave playing F4 three beats per second")
    assert v.timbre_ok and not v.pitch_ok and v.rhythm_ok
    v = score(clip, "a square wave playing E4 two beats per second")
    assert v.timbre_ok and v.pitch_ok and not v.rhythm_ok
    drum = synthesize([Spec("noise", None, 4)], jitter=False)[0].numpy()
    r = read(drum)
    assert r.timbre == "noise" and r.bps == 4
    assert score(drum, "a sine wave playing E4 four beats per second").pitch_ok is False


def test_silence_reads_as_no_rhythm():
    import numpy as np

    r = read(np.zeros(CLIP_SAMPLES, dtype=np.float32))
    assert r.bps is None and r.onsets == []
