"""Our source read as data, with `ast` (nothing is imported): module names, their imports, the
import graphs between modules and between packages. tests/repo/test_architecture.py's rules are built on
it; `make_tree` writes the small broken trees each rule is tested on."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "hydra_plugins" / "steadfast_launcher"
PACKAGE = "hydra_plugins.steadfast_launcher"
OURS = ("steadfast", "pipeline", "hydra_plugins", "bench", "tests", "helpers", "scripts")
CODE = ("steadfast", "launchers", "pipeline")
SKIP_DIRS = {".venv", ".git", "outputs", "build", "dist", "__pycache__", "steadfast.egg-info", "multirun"}


def module_name(path: Path, root: Path, prefix: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts]) if parts else prefix


def python_files(folder: Path) -> Iterator[Path]:
    for path in folder.rglob("*.py"):
        if not SKIP_DIRS & set(path.relative_to(folder).parts):
            yield path


def code_modules(root: Path = ROOT) -> Dict[str, Path]:
    """Module name -> file, for steadfast/, pipeline/ and the launcher (named as Python imports them)."""
    out = {}
    for folder in CODE:
        base = root / folder
        for path in python_files(base):
            out[module_name(path, base if folder == "launchers" else root, "").lstrip(".")] = path
    return out


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module `from <base> import ...` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base_parts = package.split(".")
    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
    return ".".join(base_parts + ([node.module] if node.module else []))


def _package_of(path: Path, name: str) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(path: Path, name: str) -> Iterator[Tuple[str, int]]:
    """(absolute module name, line) of every import in the file, at any depth (functions included);
    `from X import a` yields X.a too, since `a` may be a submodule."""
    tree = ast.parse(path.read_text(), str(path))
    package = _package_of(path, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def dependencies(path: Path, name: str, modules: Dict[str, Path]) -> Set[str]:
    """The modules of `modules` this file imports, at any depth (`TYPE_CHECKING` blocks included).
    `from X import a` depends on X.a when that is a module and on X (a name its `__init__` defines)
    when not: a package's `__init__` runs before any of its modules, but importing a submodule reads
    nothing the `__init__` defines."""
    out: Set[str] = set()
    package = _package_of(path, name)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                if target in modules:
                    out.add(target)
    out.discard(name)
    return out


def module_graph(modules: Dict[str, Path]) -> Dict[str, Set[str]]:
    return {name: dependencies(path, name, modules) for name, path in modules.items()}


def unit(module: str) -> str:
    """The package a module belongs to, for the package rules: a subpackage of steadfast/ or a module
    at its top level (its `__init__` included); pipeline/ whole; each of the launcher's modules on its
    own (they pass values, never the Launcher)."""
    if module.startswith(PACKAGE + "."):
        return module
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "steadfast" else parts[0]


def package_graph(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(unit(name), set()).update(unit(t) for t in targets if unit(t) != unit(name))
    return out


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    stack: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def make_tree(root: Path, files: Dict[str, str]) -> Path:
    """A small source tree for a rule's own test: relative path -> text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root
