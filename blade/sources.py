"""Where a TorchScript node came from in the user's code, for reports and check-mode messages.

The frontend scripts dynamo's FX GraphModule, so a node's source range points into the generated
FX code, at a line ``name = ...`` where ``name`` is the FX node. Dynamo records the user's stack
for every FX node (``node.meta["stack_trace"]``); its last frame is the line the user wrote.
"""
from __future__ import annotations

import re

import torch

_ASSIGNED = re.compile(r"^\s*(\w+)\s*=")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)')


def fx_locations(gm: torch.fx.GraphModule) -> dict:
    """FX node name -> "path:line: code" of the user's line that produced it."""
    locations = {}
    for node in gm.graph.nodes:
        frames = _FRAME.findall(node.meta.get("stack_trace") or "")
        if frames:
            path, line, code = frames[-1]
            locations[node.name] = f"{path}:{line}: {code.strip()}"
    return locations


def node_location(node: torch.Node, fx_locs: dict) -> str:
    """The user's line for a node, else its place in the generated code, else ""."""
    text = node.sourceRange()
    lines = text.splitlines()
    marker = next((i for i, line in enumerate(lines) if "<--- HERE" in line), None)
    if marker is None or marker == 0:
        return ""
    assigned = _ASSIGNED.match(lines[marker - 1])
    if assigned and assigned.group(1) in fx_locs:
        return fx_locs[assigned.group(1)]
    header = re.search(r'File "([^"]+)", line (\d+)', text)
    return f"{header.group(1)}:{header.group(2)}" if header else ""
