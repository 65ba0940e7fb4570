"""Composed deployments: several models, one request, a pipeline whose nodes are families' pipelines.

A deploy names a registered composition and one model per *role* instead of ``model``::

    pipeline: prompt-upsample
    models: {upsampler: {path: /models/Qwen2.5-0.5B-Instruct, options: {kv_cache_tokens: 8192}},
             video: {preset: wan-demo}}
    pipeline_options: {upsample: {max_tokens: 120}}     # per node: that node's defaults

Shared fields (``device``, ``dtype``, ``scheduler``, ``limits``, ``options``...) apply to every
role; ``models.<role>.options`` adds family options for that role only.

A plugin registers a composition through the existing policy hook
(``omniloop_register_policies``) as ``PolicySpec(name, kind="pipeline", factory=lambda:
CompositionSpec(...))``. A :class:`CompositionSpec` declares its roles (the task each role's model
must do), its request-level inputs (edges read from the request, e.g. ``prompt``) and its nodes.
A :class:`ComposedNode` runs one role's whole pipeline as one node of the composition: it reads
typed edges, builds that role's request from the user's request and the edges it reads
(``request(user_request, edges, params)``) and publishes some of the role's output artifacts as
edges (``outputs``: role output name → edge) with declared types (``writes``).

Validation, in this order, each failure one :class:`DeployError` naming the field:

1. at registration/lookup — the composition's graph (``omniloop.graph.validate_nodes``: every
   read has a producer of a compatible type, no cycle, no duplicate), every node's role declared;
2. :class:`ComposedDeployment` (no weights): ``pipeline`` names a registered composition;
   ``models`` has exactly its roles; each role's model resolves (``models.<role>.…``, through the
   single-model :class:`~omniloop.runtime.Deployment`) and its family can do the role's task;
   when the family can ``inspect`` a checkpoint, the role pipeline's output types are checked
   against the node's declared writes;
3. :class:`ComposedRuntime` (after load): the same output-type check for families without
   ``inspect``.

A request is the composition's task (``t2v`` for ``prompt-upsample``); :meth:`ComposedRuntime.stream`
runs the nodes in graph order, each through its role's own runtime and scheduler, and re-tags
their events with ``node = "<composed node>/<family node>"`` under the user's request id; each
published edge is announced by a progress event carrying the artifact (``artifact=<edge>``,
``value=<the artifact>``); the final output holds the composition's outputs (for
``prompt-upsample``: ``expanded_prompt`` beside ``video``/``latents``) and per-node metrics
(``metrics["nodes"][name]``). Single-model deploys never come here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
from attrs import define, field

from omniloop.artifacts import Artifact
from omniloop.deploy import DeployConfig, ModelConfig, load_deploy
from omniloop.errors import DeployError, GraphError, OmniloopError, RequestError
from omniloop.graph import Node, validate_nodes
from omniloop.plugins import PluginManager, default_manager
from omniloop.request import ErrorInfo, EventKind, OmniEvent, OmniOutput, OmniRequest, Status, TaskType
from omniloop.runtime import Deployment, Runtime
from omniloop.schema import as_request, request_from_dict, structure_params
from omniloop.streams import final_output

#: the PolicySpec kind a composition registers under
PIPELINE_KIND = "pipeline"


def _typed_map(value: Mapping[str, type[Artifact]] | None) -> dict[str, type[Artifact]]:
    return dict(value or {})


@define(frozen=True)
class RoleSpec:
    """A model slot of a composition: ``name`` (the key under ``models``) and the ``task`` its
    model must support."""

    name: str
    task: TaskType
    description: str = ""


@define(frozen=True, eq=False)
class ComposedNode:
    """One role's pipeline as a node. ``request(user_request, edges, params) -> OmniRequest | dict``
    builds the role's request; ``outputs`` maps the role's output artifact names to edge names,
    whose types ``writes`` declares; ``params_schema`` (attrs) types ``pipeline_options[name]``
    overridden by the request's ``node_params[name]``."""

    name: str
    role: str
    request: Callable[[OmniRequest, Mapping[str, Artifact], Any], Any]
    reads: dict[str, type[Artifact]] = field(factory=dict, converter=_typed_map)
    writes: dict[str, type[Artifact]] = field(factory=dict, converter=_typed_map)
    outputs: dict[str, str] = field(factory=dict)
    params_schema: type | None = None
    #: where the role's refusals of the built request are reported: None when the role's request
    #: is the user's own (its field paths are the user's); else a path (``node_params.upsample``)
    #: the role's own path is appended to, for a request the node synthesizes
    errors_at: str | None = None


class _Stub:
    """The stage a composed node stands in for, for graph validation only."""

    def forward(self, *args: Any) -> None:  # pragma: no cover - never run
        raise RuntimeError("a composed node is run by its role's runtime")


@define(frozen=True)
class CompositionSpec:
    """A registered composition: roles, request inputs (edge → type, read from the request by
    ``inputs_of``), nodes, and which edges become the output's artifacts (edge → output name)."""

    name: str
    task: TaskType
    roles: tuple[RoleSpec, ...] = field(converter=tuple)
    nodes: tuple[ComposedNode, ...] = field(converter=tuple)
    inputs: dict[str, type[Artifact]] = field(factory=dict, converter=_typed_map)
    inputs_of: Callable[[OmniRequest], dict[str, Artifact]] = lambda req: {}
    outputs: dict[str, str] = field(factory=dict)
    description: str = ""

    def __attrs_post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names):
            raise GraphError(f"pipeline {self.name!r}: duplicate role in {names}")
        for n in self.nodes:
            if n.role not in names:
                raise GraphError(f"node {n.name!r}: role {n.role!r} is not a role of pipeline {self.name!r} ({', '.join(names)})")
            for out, edge in n.outputs.items():
                if edge not in n.writes:
                    raise GraphError(f"node {n.name!r}: publishes {out!r} as {edge!r}, which it does not declare in writes")
        graph = tuple(Node(name=n.name, stage=_Stub(), reads=n.reads, writes=n.writes) for n in self.nodes)
        ordered = validate_nodes(graph, self.inputs)
        by_name = {n.name: n for n in self.nodes}
        object.__setattr__(self, "nodes", tuple(by_name[g.name] for g in ordered))
        for edge in self.outputs:
            if edge not in self.inputs and not any(edge in n.writes for n in self.nodes):
                raise GraphError(f"pipeline {self.name!r}: output {edge!r} is written by no node")

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": n.name, "role": n.role, "reads": {k: v.__name__ for k, v in n.reads.items()},
                 "writes": {k: v.__name__ for k, v in n.writes.items()}} for n in self.nodes]


def is_composed(deploy: DeployConfig) -> bool:
    """True when ``deploy`` names a composed pipeline (``pipeline`` or ``models``)."""
    return deploy.pipeline is not None or bool(deploy.models)


def _role_deploy(deploy: DeployConfig, role: str) -> DeployConfig:
    """The single-model deploy of ``role``: the shared fields, its model, the shared ``options``
    overridden key by key by ``models.<role>.options``."""
    m = deploy.models[role]
    return attrs.evolve(deploy, model=ModelConfig(preset=m.preset, path=m.path, family=m.family),
                        options={**deploy.options, **m.options}, pipeline=None, models={}, pipeline_options={})


class ComposedDeployment:
    """A composed deployment resolved without loading weights (see the module docstring)."""

    def __init__(self, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *,
                 manager: PluginManager | None = None) -> None:
        deploy = load_deploy(deploy)
        if deploy.pipeline is None:
            raise DeployError("pipeline: a deploy with models by role needs a pipeline name (e.g. pipeline: prompt-upsample)")
        if deploy.model.preset or deploy.model.path or deploy.model.family:
            raise DeployError("model: a composed deploy (pipeline) names its models under models.<role>, not model")
        for name, value, default in (("plugins", deploy.plugins, {}), ("adapters", deploy.adapters, {}),
                                     ("adapter_fuse", deploy.adapter_fuse, {}), ("policies", deploy.policies, {})):
            if value != default:
                raise DeployError(f"{name}: not supported in a composed deploy yet (pipeline {deploy.pipeline!r})")
        if deploy.parallel.world_size != 1:
            raise DeployError(f"parallel: not supported in a composed deploy yet (pipeline {deploy.pipeline!r})")
        self.deploy = deploy
        self.plugins = manager or default_manager()
        self.registry = self.plugins.registry()
        self.composition = self._composition(deploy.pipeline)
        comp = self.composition
        roles = [r.name for r in comp.roles]
        missing = [r for r in roles if r not in deploy.models]
        if missing:
            raise DeployError(
                f"models: pipeline {comp.name!r} needs a model for role(s) {', '.join(map(repr, missing))} "
                f"(roles: {', '.join(roles)}; given: {', '.join(deploy.models) or 'none'})"
            )
        extra = [r for r in deploy.models if r not in roles]
        if extra:
            raise DeployError(f"models.{extra[0]}: pipeline {comp.name!r} has no role {extra[0]!r} (roles: {', '.join(roles)})")
        nodes = {n.name: n for n in comp.nodes}
        for name, opts in deploy.pipeline_options.items():  # {node: {param: value}}, the nodes' defaults
            node = nodes.get(name)
            if node is None or node.params_schema is None:
                tunable = ", ".join(n for n, x in nodes.items() if x.params_schema is not None) or "none"
                raise DeployError(f"pipeline_options.{name}: pipeline {comp.name!r} has no node {name!r} taking options (nodes with options: {tunable})")
            if not isinstance(opts, Mapping):
                raise DeployError(f"pipeline_options.{name}: expected a mapping of {name!r}'s options")
            try:
                structure_params(node.params_schema, dict(opts), f"pipeline_options.{name}")
            except RequestError as exc:
                raise DeployError(f"deploy config: {exc}") from None
        self.roles: dict[str, Any] = {}
        for role in comp.roles:
            try:
                dep = Deployment(_role_deploy(deploy, role.name), manager=self.plugins)
            except DeployError as exc:
                raise DeployError(f"models.{role.name}: {exc}") from None
            if role.task not in dep.supported_tasks:
                have = ", ".join(sorted(t.value for t in dep.supported_tasks))
                raise DeployError(
                    f"models.{role.name}: role {role.name!r} of pipeline {comp.name!r} needs a model for task "
                    f"{role.task.value!r}; family {dep.family.name!r} at {dep.model_path} does {have}"
                )
            self.roles[role.name] = dep
            model = dep.inspect()
            if model is not None:
                spec = dep._config_pipeline(model, role.task)
                if spec is not None:
                    self._check_outputs(role.name, spec)

    def _composition(self, name: str) -> CompositionSpec:
        spec = self.registry.policies.get(name)
        if spec is None or spec.kind != PIPELINE_KIND:
            self.plugins.require(name, "pipeline")
            known = sorted(n for n, s in self.registry.policies.items() if s.kind == PIPELINE_KIND)
            raise DeployError(f"pipeline: unknown pipeline {name!r} (registered pipelines: {', '.join(known) or 'none'})")
        try:
            comp = spec.factory()
        except GraphError as exc:
            raise DeployError(f"pipeline: {name!r} is not a valid composition: {exc}") from None
        if not isinstance(comp, CompositionSpec):
            raise DeployError(f"pipeline: {name!r} is registered with kind 'pipeline' but its factory returned {type(comp).__name__}, not a CompositionSpec")
        return comp

    def _check_outputs(self, role: str, spec: Any) -> None:
        """The role pipeline's output artifacts (name → type) against what its nodes publish."""
        produced: dict[str, type] = {}
        for edge, out_name in spec.outputs.items():
            for n in spec.nodes:
                if edge in n.writes:
                    produced[out_name] = n.writes[edge]
        for node in self.composition.nodes:
            if node.role != role:
                continue
            for out_name, edge in node.outputs.items():
                kind = produced.get(out_name)
                want = node.writes[edge]
                if kind is None:
                    raise DeployError(
                        f"models.{role}: node {node.name!r} publishes the {spec.family} {spec.task.value} pipeline's "
                        f"output {out_name!r}, which it does not write (outputs: {', '.join(produced) or 'none'})"
                    )
                if not issubclass(kind, want):
                    raise DeployError(
                        f"models.{role}: node {node.name!r} publishes {out_name!r} as {want.__name__}, but the "
                        f"{spec.family} pipeline writes it as {kind.__name__}"
                    )

    # -- requests ---------------------------------------------------------------------------
    def node_params(self, node: ComposedNode, req: OmniRequest) -> Any:
        """The node's params: ``pipeline_options[name]`` overridden key by key by the request's ``node_params[name]``."""
        if node.params_schema is None:
            if req.node_params.get(node.name):
                raise RequestError(f"node_params.{node.name}", f"node {node.name!r} takes no parameters")
            return None
        merged = {**self.deploy.pipeline_options.get(node.name, {}), **req.node_params.get(node.name, {})}
        return structure_params(node.params_schema, merged, f"node_params.{node.name}")

    def sub_request(self, node: ComposedNode, req: OmniRequest, edges: Mapping[str, Artifact], params: Any) -> OmniRequest:
        built = node.request(req, edges, params)
        sub = built if isinstance(built, OmniRequest) else request_from_dict(built)
        return attrs.evolve(sub, request_id=f"{req.request_id[:100]}.{node.name}")

    def check(self, request: OmniRequest | Mapping[str, Any]) -> OmniRequest:
        """Every check needing no weights: the task, each node's params, and each role's request
        (built with the request's own inputs standing in for edges not produced yet)."""
        req = as_request(request)  # an OmniRequest built in Python meets the converter's rules too
        comp = self.composition
        if req.task is not comp.task:
            raise RequestError("task", f"{req.task.value!r}: pipeline {comp.name!r} serves {comp.task.value!r} requests")
        edges: dict[str, Artifact] = dict(comp.inputs_of(req))
        for node in comp.nodes:
            params = self.node_params(node, req)
            stand_in = dict(edges)
            for edge, kind in node.reads.items():  # an edge not produced yet: a request input of its type
                same = [a for a in edges.values() if isinstance(a, kind)]
                if edge not in stand_in and same:
                    stand_in[edge] = same[0]
            if all(e in stand_in for e in node.reads):
                sub = self.sub_request(node, req, stand_in, params)
                try:
                    self.roles[node.role].check(sub)
                except RequestError as exc:
                    if node.errors_at is None:
                        raise
                    raise RequestError(node.errors_at, f"the {node.role} model refuses the {sub.task.value} "
                                                       f"request this node builds: {exc}") from None
        return req


class ComposedRuntime(ComposedDeployment):
    """A loaded composed deployment: one :class:`~omniloop.runtime.Runtime` per role."""

    def __init__(self, deploy: DeployConfig | Mapping[str, Any] | str | os.PathLike[str], *,
                 manager: PluginManager | None = None) -> None:
        super().__init__(deploy, manager=manager)
        self.runtimes: dict[str, Runtime] = {}
        for role in self.composition.roles:
            self.runtimes[role.name] = Runtime(_role_deploy(self.deploy, role.name), manager=self.plugins)
        for role in self.composition.roles:  # families without inspect: checked on the loaded model
            rt = self.runtimes[role.name]
            self._check_outputs(role.name, rt.pipeline(role.task).spec)

    @property
    def supported_tasks(self) -> frozenset[TaskType]:
        return frozenset({self.composition.task})

    def stream(self, request: OmniRequest | Mapping[str, Any]) -> Iterator[OmniEvent]:
        """Validate, then run the nodes in order, yielding their re-tagged events and a final event."""
        req = self.check(request)
        return self._run(req)

    def _run(self, req: OmniRequest) -> Iterator[OmniEvent]:
        comp, rid = self.composition, req.request_id
        edges: dict[str, Artifact] = dict(comp.inputs_of(req))
        metrics: dict[str, Any] = {"pipeline": comp.name, "nodes": {}}
        t0 = time.perf_counter()
        for node in comp.nodes:
            try:  # the edges are real now: the role validates the built request again
                sub = self.sub_request(node, req, edges, self.node_params(node, req))
                events = self.runtimes[node.role].stream(sub)
            except OmniloopError as exc:
                err = ErrorInfo(type=type(exc).__name__, message=str(exc), node=node.name)
                yield OmniEvent(rid, EventKind.FINAL, node=node.name, message=str(exc),
                                output=OmniOutput(rid, Status.FAILED, metrics=metrics, error=err))
                return
            out: OmniOutput | None = None
            for ev in events:
                if ev.kind is EventKind.FINAL:
                    out = ev.output
                    break
                yield attrs.evolve(ev, request_id=rid, node=f"{node.name}/{ev.node}" if ev.node else node.name)
            assert out is not None
            metrics["nodes"][node.name] = out.metrics
            if not out.ok:
                e = out.error
                err = ErrorInfo(type=e.type if e else "Error", message=e.message if e else out.status.value,
                                node=f"{node.name}/{e.node}" if e and e.node else node.name, step=e.step if e else None)
                yield OmniEvent(rid, EventKind.FINAL, node=node.name, message=err.message,
                                output=OmniOutput(rid, out.status, metrics=metrics, error=err))
                return
            for out_name, edge in node.outputs.items():
                art = out.artifacts.get(out_name)
                if art is None and not any(edge in n.reads for n in comp.nodes):
                    continue  # an output the role did not produce for this request, read by no node
                if not isinstance(art, node.writes[edge]):
                    err = ErrorInfo(type="GraphError", node=node.name,
                                    message=f"node {node.name!r}: its {node.role} output {out_name!r} is {type(art).__name__}, not {node.writes[edge].__name__}")
                    yield OmniEvent(rid, EventKind.FINAL, node=node.name, message=err.message,
                                    output=OmniOutput(rid, Status.FAILED, metrics=metrics, error=err))
                    return
                edges[edge] = art
                yield OmniEvent(rid, EventKind.PROGRESS, node=node.name, artifact=edge, value=art,
                                message=f"{node.name} wrote {edge}")
        metrics["seconds"] = time.perf_counter() - t0
        artifacts = {name: edges[edge] for edge, name in comp.outputs.items() if edge in edges}
        yield OmniEvent(rid, EventKind.FINAL, output=OmniOutput(rid, Status.COMPLETED, artifacts=artifacts, metrics=metrics))

    def generate(self, request: OmniRequest | Mapping[str, Any]) -> OmniOutput:
        return final_output(self.stream(request))

    def describe(self) -> dict[str, Any]:
        return {"pipeline": self.composition.name, "task": self.composition.task.value,
                "nodes": self.composition.describe(),
                "models": {role: rt.describe() for role, rt in self.runtimes.items()}}
