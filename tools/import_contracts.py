"""An import-linter contract for submodules of external packages (`forbidden_submodules`).

import-linter's own ``forbidden`` contract takes external packages only at their top level
(``deepspeed``, never ``torch.distributed``): its graph (grimp) records an import of
``torch.distributed`` as an import of ``torch``. This contract reads the source of every module under
``source_modules`` instead and reports each place that imports a forbidden module or one of its
submodules, at any depth of the file (imports inside functions included), in any spelling:
``import torch.distributed``, ``from torch.distributed import ...``, ``from torch import distributed``
and a bare use of the attribute chain (``torch.distributed.barrier()`` after ``import torch``).

Configured in ``.importlinter`` (``contract_types``); lint-imports imports this module from the
repository root, which it puts on ``sys.path``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _matches(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def forbidden_uses(source: str, forbidden: list[str]) -> list[tuple[int, str]]:
    """(line, what) for every import or attribute use of a ``forbidden`` module in ``source``."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
        for name in names:
            hit = next((f for f in forbidden if _matches(name, f)), None)
            if hit is not None:
                found.append((node.lineno, hit))
                break
    return sorted(set(found))


class ForbiddenSubmodulesContract(Contract):
    """``source_modules`` (and their descendants) must not use ``forbidden_modules``, which may be
    submodules of external packages (``torch.distributed``)."""

    type_name = "forbidden_submodules"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        forbidden = list(self.forbidden_modules)  # type: ignore[arg-type]
        violations = []
        for source in self.source_modules:  # type: ignore[attr-defined]
            modules = {source.name} | set(graph.find_descendants(source.name))
            for module in sorted(modules):
                spec = importlib.util.find_spec(module)
                if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                    continue
                for line, what in forbidden_uses(Path(spec.origin).read_text(encoding="utf-8"), forbidden):
                    violations.append({"module": module, "line": line, "forbidden": what})
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for v in check.metadata["violations"]:
            output.print_error(f"{v['module']} uses {v['forbidden']} (l.{v['line']})", bold=False)
            output.new_line()
