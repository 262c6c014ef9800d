"""The layer order, read from the imports of every module in controlplane/.

    errors, logs, metrics, retry  <-  domain, settings  <-  store  <-  actors  <-  web  <-  app

`wire` (the HTTP and WebSocket vocabulary) sits beside web: web and the clients in `agent` may
import it; it imports only the base and domain. `agent` (the reference runner, provisioner and
the CLI's HTTP clients) talks to a replica over the wire and never imports its insides. The top
(`app`, `cli`, `dev`, `startup_errors`, `__main__`) may import anything. Imports under
`if TYPE_CHECKING:` count: a type-only import is still a dependency, and a circle of them is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "controlplane"

BASE = {"errors", "logs", "metrics", "retry"}
DOMAIN = {"domain", "settings"}
RANK = {
    **dict.fromkeys(BASE, 0),
    **dict.fromkeys(DOMAIN, 1),
    "store": 2,
    "actors": 3,
    "web": 4,
}
TOP = {"app", "cli", "dev", "startup_errors", "__main__", "__init__"}
# Unit -> the units it may import, for the two that stand beside the order.
BESIDE = {
    "wire": BASE | DOMAIN | {"wire"},
    "agent": BASE | DOMAIN | {"wire", "agent"},
}


def unit_of(module: str) -> str:
    """`controlplane.store.queue` -> `store`; `controlplane.errors` -> `errors`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def allowed(source: str, target: str) -> bool:
    if source == target or source in TOP:
        return True
    if source in BESIDE:
        return target in BESIDE[source]
    if target in BESIDE:
        return target == "wire" and source == "web"
    if target in TOP:
        return False
    return RANK[target] <= RANK[source]


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported controlplane module) for every import in the file, nested ones too."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name.split(".")[0] == "controlplane"]


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(module_name(path))
        for line, target_module in imports_of(path):
            target = unit_of(target_module)
            if target_module == "controlplane" or allowed(source, target):
                continue
            out.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} -> {target_module}")
    return out


def test_every_unit_has_a_place() -> None:
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    unplaced = units - set(RANK) - TOP - set(BESIDE)
    assert not unplaced, f"add these to the layer table: {sorted(unplaced)}"


def test_no_import_climbs_a_layer() -> None:
    assert violations() == []


@pytest.mark.parametrize(
    ("source", "target", "ok"),
    [
        ("store", "domain", True),
        ("domain", "store", False),
        ("actors", "wire", False),
        ("web", "wire", True),
        ("agent", "store", False),
        ("agent", "wire", True),
        ("wire", "domain", True),
        ("wire", "web", False),
        ("store", "actors", False),
        ("errors", "domain", False),
        ("cli", "store", True),
        ("web", "app", False),
    ],
)
def test_the_rule_itself(source: str, target: str, ok: bool) -> None:
    assert allowed(source, target) is ok
