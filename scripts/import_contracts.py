"""import-linter contract types of our own (pyproject's [tool.importlinter] `contract_types`; lint-imports puts
the working directory on sys.path, so it runs from the repository root, as tests/e2e/test_lint.py runs it).

`acyclic_packages`: no import cycle between a package's `__init__` and a module inside it. import-linter's
`acyclic_siblings` compares a package's children with each other, so `dm_cli.families` (the registry, in the
`__init__`) importing `dm_cli.families.calls` while `calls` imports `family_for` back (issue 31) passed it.
"""

from __future__ import annotations

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicPackagesContract(Contract):
    """Every package under `ancestors` (themselves included): no chain of imports (inside functions counted)
    leads from its `__init__` to one of its descendants and back."""

    type_name = "acyclic_packages"
    ancestors = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        cycles = []
        for ancestor in self.ancestors:  # type: ignore[attr-defined]
            packages = [m for m in sorted({ancestor, *graph.find_descendants(ancestor)}) if graph.find_children(m)]
            for package in packages:
                for module in sorted(graph.find_descendants(package)):
                    down = graph.find_shortest_chain(importer=package, imported=module, as_packages=False)
                    if down is None:
                        continue
                    up = graph.find_shortest_chain(importer=module, imported=package, as_packages=False)
                    if up is not None:
                        cycles.append({"package": package, "module": module, "down": list(down), "up": list(up)})
        return ContractCheck(kept=not cycles, warnings=[], metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print(f"{cycle['package']} and {cycle['module']} import each other:")
            output.print("    " + " -> ".join(cycle["down"]))
            output.print("    " + " -> ".join(cycle["up"]))
            output.new_line()
