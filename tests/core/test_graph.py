"""PipelineSpec validation: each error names the node."""

import pytest

from omniloop.artifacts import Embeddings, Latents, VideoFrames
from omniloop.errors import GraphError
from omniloop.graph import Node, PipelineSpec
from omniloop.request import TaskType


class S:
    def forward(self, ctx, state):
        pass


def spec(*nodes, outputs=None):
    return PipelineSpec(family="t", task=TaskType.T2V, nodes=nodes, outputs=outputs or {})


def test_valid_graph_is_ordered_topologically():
    p = spec(
        Node("decode", S(), reads={"lat": Latents}, writes={"video": VideoFrames}),
        Node("encode", S(), writes={"emb": Embeddings}),
        Node("denoise", S(), reads={"emb": Embeddings}, writes={"lat": Latents}),
        outputs={"video": "video"},
    )
    assert [n.name for n in p.nodes] == ["encode", "denoise", "decode"]


@pytest.mark.parametrize("nodes, words", [
    ((Node("a", S()), Node("a", S())), "node 'a': duplicate"),
    ((Node("a", S(), reads={"x": Latents}),), "node 'a': reads 'x', which no node writes"),
    ((Node("a", S(), writes={"x": Embeddings}), Node("b", S(), reads={"x": Latents})), "node 'b': reads 'x' as Latents"),
    ((Node("a", S(), reads={"y": Latents}, writes={"x": Latents}),
      Node("b", S(), reads={"x": Latents}, writes={"y": Latents})), "dependency cycle"),
    ((Node("a", object()),), "node 'a': stage object has neither"),
])
def test_invalid_graphs_are_refused_naming_the_node(nodes, words):
    with pytest.raises(GraphError, match=words):
        spec(*nodes)


def test_optional_read_may_have_no_producer():
    p = spec(Node("a", S(), reads={"img": Embeddings}, optional_reads={"img"}))
    assert p.nodes[0].name == "a"


def test_output_must_be_written():
    with pytest.raises(GraphError, match="written by no node"):
        spec(Node("a", S()), outputs={"video": "video"})


def test_when_predicate_selects_nodes():
    n = Node("img", S(), when=lambda r: r.task is TaskType.I2V)
    from omniloop.schema import request_from_dict
    assert not n.runs_for(request_from_dict({"task": "t2v"}))
    assert n.runs_for(request_from_dict({"task": "i2v"}))
