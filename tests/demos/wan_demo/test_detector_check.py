"""The adherence detector on the training renderer's ground truth (``omniloop_wan_demo_training.detector_check``;
``python bench/adherence.py --detector-check``)."""

from omniloop_wan_demo_training.detector_check import DEGRADATIONS, detector_check


def test_detector_check_reports_every_condition():
    got = detector_check(n_images=12, n_clips=2, seed=3)
    assert set(got) == {f"{k} {name}" for k in ("image", "video") for name, _, _ in DEGRADATIONS}
    assert got["image clean"] == {"color": 1.0, "shape": 1.0, "position": 1.0, "n": 12}
    assert got["video clean"] == {"color": 1.0, "direction": 1.0, "shape": 1.0, "clean": 1.0, "n": 2}
