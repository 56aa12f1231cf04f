"""The package's import graph (atom_moe with its kernels and plugins) has no cycles, and the
core never imports the tools or the engine plugins.

Every import statement counts, also those inside functions (a lazy import still ties the two
modules together); only `if TYPE_CHECKING:` blocks are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# installed package name -> source folder (pyproject's package-dir)
ROOTS = {"atom_moe": REPO / "atom_moe", "atom_moe.kernels": REPO / "kernels", "atom_moe.plugins": REPO / "plugins"}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name, for __init__.py)."""
    found = {}
    for root, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([root, *parts])] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """All nodes except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        edges.update(t for t in targets if t in known and t != name)
    return edges


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert "atom_moe.tools.bench" in graph and "atom_moe.kernels.gemm1" in graph and "atom_moe.plugins.vllm" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_does_not_import_tools_or_plugins():
    graph = import_graph()
    outer = ("atom_moe.tools", "atom_moe.plugins")
    for name, targets in graph.items():
        if name.startswith(outer):
            continue
        bad = sorted(t for t in targets if t.startswith(outer))
        assert not bad, f"core module {name} imports {bad}: tools and plugins sit on top of the core"


def test_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    assert find_cycle(graph) is None
    graph["atom_moe.tools.common"] = graph["atom_moe.tools.common"] | {"atom_moe.tools.bench"}
    cycle = find_cycle(graph)
    assert cycle and cycle[0] == cycle[-1] and "atom_moe.tools.bench" in cycle


def test_relative_and_lazy_imports_are_edges(tmp_path):
    pkg = tmp_path / "atom_moe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("")
    known = {"atom_moe", "atom_moe.a", "atom_moe.sub", "atom_moe.sub.b", "atom_moe.c"}
    assert imports_of("atom_moe.a", pkg / "a.py", known) == {"atom_moe.sub.b"}
    assert imports_of("atom_moe.sub.b", pkg / "sub" / "b.py", known) == {"atom_moe.a"}


def test_the_checkout_never_shadows_pypi_kernels(tmp_path):
    # Python started in the checkout's root has the root on sys.path, ahead of site-packages: `import kernels`
    # (transformers >= 5.25 and SGLang import PyPI's package of that name) must still get that package,
    # never this folder; where there is none it must not fail (transformers 5.20 imports whatever `kernels`
    # it finds, unguarded, to read its version) and must offer nothing.
    import subprocess
    import sys
    fake = tmp_path / "site" / "kernels"  # stands in for PyPI's `kernels`, behind the root on sys.path
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = 'pypi'\n")
    code = "import kernels; print(kernels.CUDAProperties, kernels.__file__)"
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout.startswith(f"pypi {fake / '__init__.py'}"), run.stdout + run.stderr
    code = "import kernels; print(sorted(n for n in vars(kernels) if not n.startswith('__')))"
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
