"""The house rules a newcomer relies on: wings with few rooms on the ground floor, small rooms,
imports that point one way, and media that know nothing of the connector."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tiered_kv", "storage_backends")
MAX_LINES = 350
MAX_TOP_LEVEL = 8
MEDIA_MAY_IMPORT = {"tiered_kv.errors", "tiered_kv.units"}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ours that ``path`` imports: top-level, inside functions and under
    ``if TYPE_CHECKING`` alike (a cycle is a cycle for a reader, whenever it runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)  # a package's own __init__ is not an edge back to it
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_itself_back_through_others():
    edges = graph()
    # a package's __init__ re-exporting its modules is not a cycle with them
    edges = {n: {m for m in e if not (n.startswith(m + ".") or m.startswith(n + "."))} for n, e in edges.items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_media_import_nothing_of_tiered_kv_but_errors_and_units():
    bad = {f"{name} imports {target}" for name, targets in graph().items() if name.startswith("storage_backends")
           for target in targets if target.startswith("tiered_kv") and target not in MEDIA_MAY_IMPORT}
    assert not bad, sorted(bad)


def test_ground_floor_holds_few_modules():
    top = sorted(p.name for p in (ROOT / "tiered_kv").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, top


@pytest.mark.parametrize("package", PACKAGES)
def test_no_product_file_is_over_350_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_scheduler_side_modules_never_import_torch():
    """The connector's scheduler half and what it uses run where no torch may be loaded."""
    edges, mods = graph(), modules()
    seen, todo = set(), ["tiered_kv.connector.scheduler", "tiered_kv.store.lower_index",
                         "tiered_kv.integrations.vllm_scheduler"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [m for m in edges[name] if not name.startswith(m + ".")]
    heavy = sorted(n for n in seen if "torch" in {a.split(".")[0] for a in _top_imports(mods[n])})
    assert not heavy, heavy


def _top_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


PUBLIC = [("tiered_kv.store", "TieredStore"), ("tiered_kv.store", "LoadPlan"), ("tiered_kv.store", "SaveBatch"),
          ("tiered_kv.config", "TieredKVConfig"), ("tiered_kv.keys", "Namespace"), ("tiered_kv.keys", "block_keys"),
          ("tiered_kv.keys", "tenant_label"), ("tiered_kv.connector", "build_connector"),
          ("tiered_kv.connector", "TieredKVConnector"), ("tiered_kv.connector.scheduler", "ConnectorScheduler"),
          ("tiered_kv.connector.worker", "ConnectorWorker"), ("storage_backends", "register_backend"),
          ("storage_backends", "open_backend")]


@pytest.mark.parametrize(("module", "name"), PUBLIC)
def test_the_public_imports_the_readme_documents_resolve(module, name):
    import importlib

    assert getattr(importlib.import_module(module), name) is not None
    assert f"{module}.{name}" in (ROOT / "README.md").read_text() or name in (ROOT / "README.md").read_text()
