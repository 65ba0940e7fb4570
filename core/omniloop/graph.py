"""Pipelines as frozen graphs of named nodes with typed reads and writes.

A family builds one :class:`PipelineSpec` per task. Validation at build time catches: duplicate
node names, a read with no upstream producer, a read whose type differs from the producer's
declared write type, and cycles; each error names the node.

Edges are named artifacts. ``reads`` / ``writes`` map edge name → artifact type. A node with a
``when`` predicate runs only for requests it accepts (branch on ``request.task`` and options);
its reads may be optional (``optional_reads``) for nodes that run for several tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from attrs import define, field

from .artifacts import Artifact
from .errors import GraphError
from .loop import is_loop_stage
from .request import OmniRequest, TaskType


def _node_tuple(value: Iterable[Node]) -> tuple[Node, ...]:
    return tuple(value)


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _str_frozenset(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _frozen_map(value: Mapping[str, type[Artifact]] | None) -> dict[str, type[Artifact]]:
    return dict(value or {})


@define(frozen=True, eq=False)
class Node:
    """A named node. ``stage`` is a ``Stage`` (``forward``) or a ``LoopStage`` (``init/step/finalize``).

    ``params_schema`` is an attrs class; a request's ``node_params[name]`` is validated against it
    and handed to the stage as ``ctx.params``.
    """

    name: str
    stage: Any
    reads: dict[str, type[Artifact]] = field(factory=dict, converter=_frozen_map)
    writes: dict[str, type[Artifact]] = field(factory=dict, converter=_frozen_map)
    optional_reads: frozenset[str] = field(factory=frozenset, converter=_str_frozenset)
    when: Callable[[OmniRequest], bool] | None = None
    params_schema: type | None = None
    #: the component names this node uses (for memory accounting and block-interceptor checks)
    uses: tuple[str, ...] = field(default=(), converter=_str_tuple)
    #: what a loop node emits while it runs (``StepResult.emit``: PARTIAL events when a request asks
    #: for ``outputs.stream_partial``), by name and type — e.g. a causal video's ``video_chunk``
    #: frames; front ends refuse a stream request to a pipeline that emits nothing
    emits: dict[str, type[Artifact]] = field(factory=dict, converter=_frozen_map)

    @property
    def is_loop(self) -> bool:
        return is_loop_stage(self.stage)

    def runs_for(self, request: OmniRequest) -> bool:
        return self.when is None or bool(self.when(request))


@define(frozen=True)
class PipelineSpec:
    """A validated, frozen pipeline: nodes in execution order."""

    family: str
    task: TaskType
    nodes: tuple[Node, ...] = field(converter=_node_tuple)
    #: edges provided by the runtime before any node runs (none today; reserved for transports)
    inputs: dict[str, type[Artifact]] = field(factory=dict)
    #: which written artifacts become ``OmniOutput.artifacts`` (edge name → output name)
    outputs: dict[str, str] = field(factory=dict)

    def __attrs_post_init__(self) -> None:
        ordered = validate_nodes(self.nodes, self.inputs)
        object.__setattr__(self, "nodes", ordered)
        for edge in self.outputs:
            if not any(edge in n.writes for n in self.nodes):
                raise GraphError(f"pipeline output {edge!r} is written by no node")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def loop_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.is_loop)

    @property
    def partial_outputs(self) -> dict[str, type[Artifact]]:
        """What the pipeline's nodes emit while they run (``Node.emits``, merged): empty for a
        pipeline that only returns its final output (``outputs.stream_partial`` gets nothing)."""
        out: dict[str, type[Artifact]] = {}
        for n in self.nodes:
            out.update(n.emits)
        return out

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "name": n.name,
                "kind": "loop" if n.is_loop else "stage",
                "reads": {k: v.__name__ for k, v in n.reads.items()},
                "writes": {k: v.__name__ for k, v in n.writes.items()},
                "conditional": n.when is not None,
            }
            for n in self.nodes
        ]


def validate_nodes(
    nodes: tuple[Node, ...], inputs: Mapping[str, type[Artifact]] | None = None
) -> tuple[Node, ...]:
    """Check names, producers, types and cycles; return the nodes in a topological order
    that keeps the declared order wherever the dependencies allow it."""
    inputs = dict(inputs or {})
    names: set[str] = set()
    for n in nodes:
        if not n.name or not isinstance(n.name, str):
            raise GraphError(f"node {n.name!r}: a node needs a non-empty string name")
        if n.name in names:
            raise GraphError(f"node {n.name!r}: duplicate node name")
        names.add(n.name)
        if not (is_loop_stage(n.stage) or callable(getattr(n.stage, "forward", None))):
            raise GraphError(
                f"node {n.name!r}: stage {type(n.stage).__name__} has neither forward() nor init/step/finalize"
            )

    producers: dict[str, list[Node]] = {}
    for n in nodes:
        for edge in n.writes:
            if edge in inputs:
                raise GraphError(f"node {n.name!r}: writes {edge!r}, which is a pipeline input")
            producers.setdefault(edge, []).append(n)
    for edge, prods in producers.items():
        kinds = {p.writes[edge] for p in prods}
        if len(kinds) > 1:
            raise GraphError(
                f"edge {edge!r}: written with different types by "
                + ", ".join(f"{p.name!r} ({p.writes[edge].__name__})" for p in prods)
            )

    deps: dict[str, set[str]] = {n.name: set() for n in nodes}
    for n in nodes:
        for edge, kind in n.reads.items():
            if edge in inputs:
                if not issubclass(inputs[edge], kind):
                    raise GraphError(
                        f"node {n.name!r}: reads {edge!r} as {kind.__name__}, "
                        f"but the pipeline input is {inputs[edge].__name__}"
                    )
                continue
            prods = [p for p in producers.get(edge, []) if p is not n]
            if not prods:
                if edge in n.optional_reads:
                    continue
                raise GraphError(f"node {n.name!r}: reads {edge!r}, which no node writes")
            written = prods[0].writes[edge]
            if not issubclass(written, kind):
                raise GraphError(
                    f"node {n.name!r}: reads {edge!r} as {kind.__name__}, but {prods[0].name!r} "
                    f"writes it as {written.__name__}"
                )
            deps[n.name].update(p.name for p in prods)

    order: list[Node] = []
    placed: set[str] = set()
    remaining = list(nodes)
    while remaining:
        for i, n in enumerate(remaining):
            if deps[n.name] <= placed:
                order.append(n)
                placed.add(n.name)
                del remaining[i]
                break
        else:
            cyc = ", ".join(repr(n.name) for n in remaining)
            raise GraphError(f"node {remaining[0].name!r}: dependency cycle among {cyc}")
    return tuple(order)

