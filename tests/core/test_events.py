"""The event stream's shape (issue 14: no ``progress denoise None None`` after the last step)."""

from omniloop.request import EventKind
from omniloop.testing import toy_runtime


def test_progress_events_always_carry_step_and_total_and_nodes_end_with_a_node_event(toy_checkpoint):
    rt = toy_runtime(toy_checkpoint)
    events = list(rt.stream({"task": "t2v", "prompt": "a red circle", "diffusion": {"steps": 3, "seed": 0}}))
    progress = [e for e in events if e.kind is EventKind.PROGRESS]
    assert progress and all(e.step is not None and e.total is not None for e in progress)
    assert [(e.step, e.total) for e in progress if e.node == "denoise"] == [(1, 3), (2, 3), (3, 3)]
    finished = [e.node for e in events if e.kind is EventKind.NODE]
    assert "denoise" in finished and all(e.message == "done" for e in events if e.kind is EventKind.NODE)
    # the denoise node's NODE event comes after its last step, and the stream ends with one final
    kinds = [(e.kind, e.node) for e in events]
    assert kinds.index((EventKind.NODE, "denoise")) > max(i for i, e in enumerate(events) if e.kind is EventKind.PROGRESS and e.node == "denoise")
    assert events[-1].kind is EventKind.FINAL and [e.kind for e in events].count(EventKind.FINAL) == 1
