"""Which parts of a model are regions: its repeated blocks, and the modules beside them.

A repeated block list is an ``nn.ModuleList`` whose modules are all of one class
(transformers' ``model.layers``, the reference models' ``layers``); each of its blocks
shares one compiled region. Every module beside the path from the root to those lists
(embeddings, final norm, rotary embedding, head) is a region of its own; the Python
between regions (the model's own ``forward``) runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

__all__ = ["RegionPlan", "find_repeated_blocks", "plan_regions"]


def find_repeated_blocks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every non-empty ``nn.ModuleList`` whose modules are all of one class, outermost first
    (a list inside a found block belongs to that block's region)."""
    found: list[tuple[str, nn.ModuleList]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList) and len(child) >= 1 and len({type(m) for m in child}) == 1:
                found.append((path, child))
            else:
                visit(path, child)

    visit("", model)
    return found


@dataclass
class RegionPlan:
    """What :func:`compile` compiles: the repeated block lists and the modules beside them."""

    blocks: list[tuple[str, nn.ModuleList]]
    #: (parent, attribute name, dotted path) of every module compiled on its own.
    rest: list[tuple[nn.Module, str, str]] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"block list {path}: {len(lst)} x {type(lst[0]).__name__}" for path, lst in self.blocks]
        lines += [f"region {path}: {type(getattr(parent, name)).__name__}" for parent, name, path in self.rest]
        return "\n".join(lines)


def plan_regions(model: nn.Module) -> RegionPlan:
    """The regions of ``model``: its repeated block lists, and every module beside the path
    from the root to them (a module that contains no block list is one region)."""
    blocks = find_repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"qaic_dynamo.compile: {type(model).__name__} has no repeated blocks (an nn.ModuleList of modules "
            "of one class); compile it whole with torch.compile(model, backend='qaic')"
        )
    on_path = {""}
    for path, _ in blocks:
        parts = path.split(".")
        on_path |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    plan = RegionPlan(blocks)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in on_path:
                if not isinstance(child, nn.ModuleList):
                    visit(path, child)
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                plan.rest.append((module, name, path))

    visit("", model)
    return plan
