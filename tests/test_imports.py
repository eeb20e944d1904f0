"""The package's import graph, read from the source (no module is imported): no cycles,
the planner reaches nothing in the benchmarks or the notebooks' code, the benchmarks nothing
in the notebooks' code, and the planner never imports torch at module level."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "minipar"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The minipar modules ``path`` imports (lazy imports inside functions too, unless
    ``top_level_only``), each as the module named (``from minipar import comm`` names
    minipar.comm)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names}
            # ``from pkg import sub``: the submodule; ``from pkg import name``: the package
            out |= subs & MODULES if subs <= MODULES else {mod} | (subs & MODULES)
    return out


MODULES = {module_name(p) for p in PKG.rglob("*.py")}


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in imports(p, top_level_only) if m in files and m != name}
            for name, p in files.items()}


def test_the_parser_resolves_relative_imports():
    g = graph()
    assert "minipar.plan.network" in g["minipar.plan.estimate"]         # from .network ...
    assert "minipar.runtime.cli" in g["minipar.plan.commands"]          # from ..runtime.cli ...
    assert "minipar.plan" in g["minipar.bench.pp"]                       # from ..plan import ...


ALLOWED: set = set()      # no cycle is kept on purpose


def test_no_import_cycles():
    g = {name: {d for d in deps if (name, d) not in ALLOWED} for name, deps in graph().items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(
                    path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node)


def test_layers_import_downwards_only():
    g = graph()
    for name, deps in g.items():
        if name.startswith("minipar.plan"):
            bad = {d for d in deps if d.startswith(("minipar.bench", "minipar.lab"))}
            assert not bad, f"{name} imports {sorted(bad)}"
        if name.startswith("minipar.bench"):
            bad = {d for d in deps if d.startswith("minipar.lab")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_planner_is_torch_free_at_import():
    for p in (PKG / "plan").glob("*.py"):
        mods = imports(p, top_level_only=True)
        assert not {m for m in mods if m == "torch" or m.startswith("torch.")}, p.name
        # ... nor through a minipar module that imports torch at its top
        for m in mods:
            target = PKG.parent / (m.replace(".", "/") + ".py")
            if m.startswith("minipar.") and target.is_file():
                assert "torch" not in {x.split(".")[0] for x in imports(target, True)}, (p, m)
