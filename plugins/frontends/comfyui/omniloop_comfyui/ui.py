"""The editor (UI) format → the API format.

The editor saves ``{"nodes": [...], "links": [...], "definitions": {"subgraphs": [...]}}``: each node
holds its widget values as a list in input order (``widgets_values``; a seed's UI-only
"control after generate" value follows the seed) and its linked inputs by link id. The API format
is ``{node_id: {"class_type", "inputs": {name: value | [source_id, output_index]}}}``.

What the converter resolves, as ComfyUI's front end does when it queues a workflow:

* ``Reroute`` nodes and bypassed nodes (mode 4: each output passes the first input of its type
  through) are removed, their links followed;
* muted nodes (mode 2) are dropped (an input fed by one is then missing);
* the legacy ``PrimitiveNode``'s value is written into the inputs it feeds (``PrimitiveInt`` and
  friends are real nodes, compiled as such);
* subgraphs (``definitions.subgraphs``) are expanded, inner node ids prefixed ``<outer id>:``; a
  subgraph input left unlinked keeps the inner widget's own value;
* ``Note`` / ``MarkdownNote`` are ignored.

Widget values of a node class this package does not know cannot be named: such a node keeps its
linked inputs only, and the compiler refuses its class (``missing_node_type``).
"""

from __future__ import annotations

from typing import Any

from .errors import WorkflowError, show
from .nodes import SPECS

MUTED, BYPASSED = 2, 4
PASS_THROUGH = frozenset({"Reroute"})
#: the editor's legacy primitive (its value is written into the inputs it feeds); ``PrimitiveInt``
#: and friends are real nodes (:mod:`.nodes`)
PRIMITIVES = frozenset({"PrimitiveNode"})
NOTES = frozenset({"Note", "MarkdownNote"})
#: nested subgraphs deeper than this are refused (a definition that contains itself)
MAX_DEPTH = 16
SUBGRAPH_IN, SUBGRAPH_OUT = -10, -20


def is_ui_format(workflow: Any) -> bool:
    return isinstance(workflow, dict) and isinstance(workflow.get("nodes"), list) and "links" in workflow


def _links(raw: Any) -> dict[Any, tuple[Any, int, Any, int, Any]]:
    out: dict[Any, tuple[Any, int, Any, int, Any]] = {}
    for link in raw or []:
        if isinstance(link, list) and len(link) >= 5:
            out[link[0]] = (link[1], link[2], link[3], link[4], link[5] if len(link) > 5 else None)
        elif isinstance(link, dict) and "id" in link:
            out[link["id"]] = (link.get("origin_id"), link.get("origin_slot"), link.get("target_id"),
                               link.get("target_slot"), link.get("type"))
        else:
            raise WorkflowError("invalid_prompt", f"invalid link {show(link)} in the editor workflow")
    return out


class _Flat:
    def __init__(self, subgraphs: dict[str, Any]) -> None:
        self.subgraphs = subgraphs
        self.nodes: dict[str, dict[str, Any]] = {}
        #: (node id, output slot) -> another (node id, slot), ("value", v), or None (nothing)
        self.alias: dict[tuple[str, int], Any] = {}

    def level(self, nodes: list[Any], links: dict[Any, Any], prefix: str, depth: int,
              outer_inputs: dict[int, Any] | None = None, out_key: str | None = None) -> None:
        if depth > MAX_DEPTH:
            raise WorkflowError("invalid_prompt", f"subgraphs nested deeper than {MAX_DEPTH} levels (a subgraph that contains itself?)")

        def src(link_id: Any) -> Any:
            if link_id is None:
                return None
            link = links.get(link_id)
            if link is None:
                return ("dangling", link_id)
            origin, slot = link[0], link[1]
            if origin == SUBGRAPH_IN:
                return (outer_inputs or {}).get(slot)
            return (f"{prefix}{origin}", int(slot) if isinstance(slot, int) else slot)

        if out_key is not None:  # the subgraph's outputs: links into its output node
            for link in links.values():
                if link[2] == SUBGRAPH_OUT:
                    self.alias[(out_key, link[3])] = src_of(link, prefix, outer_inputs)
        for node in nodes:
            if not isinstance(node, dict) or "id" not in node:
                raise WorkflowError("invalid_prompt", f"invalid node {show(node)} in the editor workflow")
            nid, ntype, mode = f"{prefix}{node['id']}", node.get("type"), node.get("mode", 0)
            inputs = [i for i in node.get("inputs") or [] if isinstance(i, dict)]
            outputs = [o for o in node.get("outputs") or [] if isinstance(o, dict)]
            if ntype in NOTES:
                continue
            if mode == MUTED:
                for k in range(len(outputs)):
                    self.alias[(nid, k)] = None
                continue
            if ntype in PASS_THROUGH:
                self.alias[(nid, 0)] = src(inputs[0].get("link")) if inputs else None
                continue
            if ntype in PRIMITIVES:
                values = node.get("widgets_values") or [None]
                self.alias[(nid, 0)] = ("value", values[0] if isinstance(values, list) else None)
                continue
            if mode == BYPASSED:
                for k, out in enumerate(outputs):
                    match = next((i for i in inputs if i.get("type") == out.get("type") and i.get("link") is not None), None)
                    self.alias[(nid, k)] = src(match.get("link")) if match else None
                continue
            if isinstance(ntype, str) and ntype in self.subgraphs:
                sg = self.subgraphs[ntype]
                sg_inputs = sg.get("inputs") or []
                by_name = {i.get("name"): i for i in inputs}
                outer: dict[int, Any] = {}
                for k, si in enumerate(sg_inputs):
                    mine = by_name.get(si.get("name")) or (inputs[k] if k < len(inputs) else None)
                    outer[k] = src(mine.get("link")) if mine else None
                self.level(sg.get("nodes") or [], _links(sg.get("links")), f"{nid}:", depth + 1, outer, nid)
                continue
            self.nodes[nid] = {"type": ntype, "inputs": [(i.get("name"), src(i.get("link"))) for i in inputs],
                               "widgets": node.get("widgets_values"), "title": node.get("title")}

    def resolve(self, source: Any) -> Any:
        seen = 0
        while isinstance(source, tuple) and source and source[0] not in ("value", "dangling") and source in self.alias:
            source = self.alias[source]
            seen += 1
            if seen > 10000:
                raise WorkflowError("invalid_prompt", "a loop of reroutes / bypassed nodes in the editor workflow")
        return source


def src_of(link: tuple[Any, ...], prefix: str, outer_inputs: dict[int, Any] | None) -> Any:
    origin, slot = link[0], link[1]
    if origin == SUBGRAPH_IN:
        return (outer_inputs or {}).get(slot)
    return (f"{prefix}{origin}", slot)


def to_api_format(workflow: dict[str, Any]) -> dict[str, Any]:
    """The API-format prompt of an editor-format workflow (see the module docstring)."""
    subgraphs = {}
    for sg in ((workflow.get("definitions") or {}).get("subgraphs") or []):
        if isinstance(sg, dict) and isinstance(sg.get("id"), str):
            subgraphs[sg["id"]] = sg
    flat = _Flat(subgraphs)
    flat.level(workflow["nodes"], _links(workflow.get("links")), "", 0)
    prompt: dict[str, Any] = {}
    for nid, node in flat.nodes.items():
        linked: dict[str, Any] = {}
        for name, source in node["inputs"]:
            if not isinstance(name, str):
                continue
            s = flat.resolve(source)
            if s is None:
                continue
            if s[0] == "value":
                linked[name] = s[1]
            elif s[0] == "dangling":
                linked[name] = ["?", 0]  # the compiler reports the dangling link on this input
            elif s[0] in flat.nodes:
                linked[name] = [s[0], s[1]]
            else:
                linked[name] = [s[0], s[1]]  # a removed node: reported as a dangling link
        inputs: dict[str, Any] = {}
        spec = SPECS.get(node["type"]) if isinstance(node["type"], str) else None
        widgets = node["widgets"]
        if spec is not None:
            k = 0
            for i in spec.inputs:
                if not i.widget:
                    if i.name in linked:
                        inputs[i.name] = linked[i.name]
                    continue
                value_here = isinstance(widgets, list) and k < len(widgets)
                if isinstance(widgets, dict):
                    value_here = i.name in widgets
                    value = widgets.get(i.name)
                elif value_here:
                    value = widgets[k]  # type: ignore[index]
                k += 2 if i.control_after_generate else 1
                if i.name in linked:
                    inputs[i.name] = linked[i.name]
                elif value_here:
                    inputs[i.name] = value
        else:
            inputs = dict(linked)
        entry: dict[str, Any] = {"class_type": node["type"], "inputs": inputs,
                                 "_meta": {"title": node.get("title") or node["type"]}}  # as ComfyUI exports
        prompt[nid] = entry
    return prompt
