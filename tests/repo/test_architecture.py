"""The layout's rules, read from the source with `ast` (nothing is imported). "A package" below is a
subpackage of steadfast/ (contract, checkpoint, loop, distributed, telemetry, report), a module at
steadfast/'s top level (run, config, preflight, faults, verify_recovery, and the package's own
`__init__`), the whole of pipeline/, and each of the launcher's modules.

- no import circle between modules, over steadfast/, pipeline/ and the launcher together
  (function-level imports and `TYPE_CHECKING` imports included);
- no import circle between packages either: the arrows docs/architecture.md draws go one way;
- a private module (`_x`), or a module's private name, is imported only inside its own package
  (tests and benchmarks may reach in);
- each package's `__init__` names its public modules: every module and subpackage of steadfast/
  and pipeline/ whose name has no leading underscore heads a line of its `__init__`'s docstring
  (`name   what it holds`, or `a, b   what they hold`); `__all__` is for the names a package
  re-exports, and only some do (importing a package must stay cheap: `import steadfast` and the
  contract never import torch);
- steadfast.contract imports nothing of ours outside itself, and no torch (and but for naming.py, which
  parses Hydra's overrides, no Hydra or OmegaConf);
- no module holds more than MAX_STATEMENTS statements (lines where a statement starts: the
  measure does not move when the formatter splits a long call over several lines);
- no parameter typed `Any` where one package calls another, unless it holds a value of any type;
- the registry rule: no backend is named outside its own module in `_backends/` and its YAML file;
- the compat rule: third-party private names are touched (and third-party code patched) only in
  the launcher's `_compat` package.
- the tests' rule: every test file is in a folder of tests/ that tests/README.md's table names, and
  its name is unique across the folders.

tests/source_tree.py reads the source (module names, imports, the graphs). The finders of the graph,
private, `__init__`, `Any` and compat rules are functions over a tree of files, each tested on a small
broken tree of its own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

from source_tree import (
    LAUNCHER,
    OURS,
    PACKAGE,
    ROOT,
    code_modules,
    find_cycle,
    imports,
    make_tree,
    module_graph,
    module_name,
    package_graph,
    python_files,
    unit,
)

CONTRACT = ROOT / "steadfast" / "contract"
MAX_STATEMENTS = 300  # about 450 lines of this codebase's dense style before `ruff format`


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graphs_see_function_level_imports_and_packages(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "steadfast/__init__.py": "",
            "steadfast/a/__init__.py": '"""a: x"""\nfrom .x import f\n',
            "steadfast/a/x.py": "def f():\n    from ..b import y\n",
            "steadfast/b/__init__.py": "",
            "steadfast/b/y.py": "from ..a import x\n",  # the submodule, not a's __init__
            "steadfast/c.py": "from . import a\n",
        },
    )
    graph = module_graph(code_modules(root))
    assert graph["steadfast.a.x"] == {"steadfast.b.y"} and graph["steadfast.b.y"] == {"steadfast.a.x"}
    assert graph["steadfast.c"] == {"steadfast.a"}
    assert find_cycle(graph) == ["steadfast.a.x", "steadfast.b.y", "steadfast.a.x"]
    assert find_cycle(package_graph(graph)) == ["steadfast.a", "steadfast.b", "steadfast.a"]
    (root / "steadfast/b/y.py").write_text("")
    assert find_cycle(module_graph(code_modules(root))) is None


def test_modules_import_each_other_without_cycles() -> None:
    graph = module_graph(code_modules())
    for known in (f"{PACKAGE}._core", f"{PACKAGE}._backends.torchrun", "steadfast.loop.boundary", "pipeline.trainer"):
        assert known in graph, known
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_packages_import_each_other_without_cycles() -> None:
    graph = package_graph(module_graph(code_modules()))
    assert {"steadfast.loop", "steadfast.checkpoint", "steadfast.faults", "pipeline"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_types_is_a_leaf() -> None:
    """The launcher's shared types import none of its modules (the contract only)."""
    imported = module_graph(code_modules())[f"{PACKAGE}._types"]
    assert {m for m in imported if not m.startswith("steadfast.contract")} == set(), imported


# ---- private modules -----------------------------------------------------------------------------------


def private_imports(modules: Dict[str, Path]) -> List[str]:
    """Imports of one of our private modules (or a module's private name: `_x` either way) from
    outside the package that holds it."""
    offenders = []
    for name, path in modules.items():
        for target, line in sorted(set(imports(path, name)), key=lambda t: (t[1], t[0])):
            parts = target.split(".")
            private = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
            if not private or parts[0] not in OURS:
                continue
            owner = ".".join(parts[: private[0]])
            if owner in modules and modules[owner].name != "__init__.py":
                owner = owner.rpartition(".")[0]  # a module's private name: its package owns it
            if name != owner and not name.startswith(owner + "."):
                offenders.append(f"{name}:{line} imports {target}")
    return offenders


def test_the_private_rule_sees_a_reach_in(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "steadfast/a/__init__.py": "from . import _x\n",
            "steadfast/a/y.py": "from ._x import f\nfrom .z import _helper\n",
            "steadfast/a/z.py": "import torch._C\n",  # third-party internals: the compat rule's
            "steadfast/b.py": "from .a._x import f\n",
            "steadfast/c.py": "from .a.z import _helper\n",
            "pipeline/p.py": "import steadfast.a._x\n",
        },
    )
    assert sorted(private_imports(code_modules(root))) == [
        "pipeline.p:1 imports steadfast.a._x",
        "steadfast.b:1 imports steadfast.a._x",
        "steadfast.b:1 imports steadfast.a._x.f",
        "steadfast.c:1 imports steadfast.a.z._helper",
    ]


def test_private_modules_are_imported_only_inside_their_package() -> None:
    offenders = private_imports(code_modules())
    assert not offenders, "a private module imported from outside its package:\n" + "\n".join(offenders)


# ---- each package's __init__ names its public modules -----------------------------------------------------

_HEAD = re.compile(r"^\s*([A-Za-z_]\w*(?:\(\))?(?:,?\s[A-Za-z_]\w*(?:\(\))?)*)(?:\s{2,}|:\s)")


def listed(docstring: str) -> Set[str]:
    """The names that head a line of a docstring: `  name   what`, `  a, b   what`, `name: what`."""
    out: Set[str] = set()
    for line in docstring.splitlines():
        head = _HEAD.match(line)
        if head:
            out.update(re.findall(r"[A-Za-z_]\w*", head.group(1)))
    return out


def unnamed_modules(folders: List[Path]) -> List[str]:
    """Public modules and subpackages that their package's `__init__` docstring does not name."""
    offenders = []
    for folder in folders:
        for init in sorted(folder.rglob("__init__.py")):
            here = init.parent
            public = sorted(
                p.stem if p.is_file() else p.name
                for p in here.iterdir()
                if not p.name.startswith("_")
                and ((p.suffix == ".py" and p.is_file()) or (p.is_dir() and (p / "__init__.py").exists()))
            )
            named = listed(ast.get_docstring(ast.parse(init.read_text(), str(init))) or "")
            offenders += [f"{init.relative_to(folder.parent)} does not name {m}" for m in public if m not in named]
    return offenders


def test_the_init_rule_sees_an_unnamed_module(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "pkg/__init__.py": '"""The package.\n\n  a, b     two modules\n  sub      a subpackage; c too\n"""\n',
            "pkg/a.py": "",
            "pkg/b.py": "",
            "pkg/c.py": "",
            "pkg/_private.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "",
            "pkg/data/x.yaml": "",  # not a package
        },
    )
    heads = listed("x\n  a, b     two\n  init()   one\nprose: with words\n  more prose, not a list\n")
    assert heads == {"a", "b", "init", "prose"}
    assert unnamed_modules([root / "pkg"]) == ["pkg/__init__.py does not name c", "pkg/sub/__init__.py does not name d"]


def test_each_package_init_names_its_public_modules() -> None:
    offenders = unnamed_modules([ROOT / "steadfast", ROOT / "pipeline"])
    assert not offenders, "name each public module in its package's __init__ docstring:\n" + "\n".join(offenders)


# ---- the contract stands alone ---------------------------------------------------------------------------


def test_contract_imports_nothing_of_ours_outside_itself_and_no_torch() -> None:
    offenders = []
    for path in python_files(CONTRACT):
        name = module_name(path, ROOT, "").lstrip(".")
        for target, line in imports(path, name):
            top = target.split(".")[0]
            if top == "torch" or (
                top in OURS and not (target == "steadfast.contract" or target.startswith("steadfast.contract."))
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not offenders, "steadfast.contract must stand alone (no torch, nothing of ours outside it):\n" + "\n".join(offenders)


def test_contract_schemas_and_records_import_no_hydra_or_omegaconf() -> None:
    """Plain dataclasses and functions: only naming.py, which parses Hydra's override syntax and registers
    OmegaConf resolvers, imports them (inside the functions that need them)."""
    offenders = []
    for path in python_files(CONTRACT):
        if path.name == "naming.py":
            continue
        name = module_name(path, ROOT, "").lstrip(".")
        for target, line in imports(path, name):
            if target.split(".")[0] in ("hydra", "omegaconf"):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not offenders, "the contract's schemas and records must not need Hydra or OmegaConf:\n" + "\n".join(offenders)


# ---- module size -----------------------------------------------------------------------------------------


def _statements(path: Path) -> int:
    return len({node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.stmt)})


def test_no_module_is_over_the_limit() -> None:
    counts = {str(p.relative_to(ROOT)): _statements(p) for p in python_files(ROOT)}
    assert "steadfast/run.py" in counts and "tests/repo/test_architecture.py" in counts
    over = {p: n for p, n in counts.items() if n > MAX_STATEMENTS}
    assert not over, f"modules over {MAX_STATEMENTS} statements (split them by job): " + ", ".join(
        f"{p} ({n})" for p, n in sorted(over.items())
    )


# ---- no `Any` parameters between packages --------------------------------------------------------------

# `Any` says "a value of any type": a task's result, a JSON value, a pickled payload, a config node; a
# dataset (torch types DataLoader's as Dataset, but takes any object with __len__ and __getitem__).
VALUE_NAMES = {"value", "v", "obj", "data", "result", "node", "tree", "state", "record", "payload", "raw", "dataset"}
# (file, function, parameter): why `Any` is right there.
ANY_ALLOWED = {
    ("steadfast/checkpoint/shards.py", "is_dtensor", "t"): "anything, asked whether it is a DTensor",
    ("steadfast/checkpoint/tensorfile.py", "parse", "buf"): "a buffer of any kind (bytes, memoryview, mmap)",
}


def _used_across(modules: Dict[str, Path]) -> Set[Tuple[str, str]]:
    """(module, name) of every top-level name that a module of another package imports or reads."""
    used: Set[Tuple[str, str]] = set()
    for name, path in modules.items():
        aliases: Dict[str, str] = {}
        tree = ast.parse(path.read_text(), str(path))
        for target, _ in imports(path, name):
            owner, _, attr = target.rpartition(".")
            if owner in modules and unit(owner) != unit(name):
                used.add((owner, attr))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for target, _ in imports(path, name):
                    if target in modules:
                        aliases[target.rpartition(".")[2]] = target
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                owner = aliases[node.value.id]
                if unit(owner) != unit(name):
                    used.add((owner, node.attr))
    return used


def _is_any(annotation: Optional[ast.expr]) -> bool:
    return (isinstance(annotation, ast.Name) and annotation.id == "Any") or (
        isinstance(annotation, ast.Constant) and annotation.value == "Any"
    )


def any_parameters(modules: Dict[str, Path], root: Path) -> List[str]:
    """Parameters typed `Any` of the functions and public methods another package uses."""
    used = _used_across(modules)
    offenders = []
    for name, path in modules.items():
        for top in ast.parse(path.read_text(), str(path)).body:
            functions: List[Tuple[str, ast.FunctionDef]] = []
            if isinstance(top, ast.FunctionDef) and (name, top.name) in used:
                functions.append((top.name, top))
            if isinstance(top, ast.ClassDef) and (name, top.name) in used:
                functions += [
                    (f"{top.name}.{f.name}", f)
                    for f in top.body
                    if isinstance(f, ast.FunctionDef) and (not f.name.startswith("_") or f.name == "__init__")
                ]
            rel = str(path.relative_to(root))
            for label, f in functions:
                for arg in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]:
                    allowed = arg.arg in VALUE_NAMES or (rel, label.rpartition(".")[2], arg.arg) in ANY_ALLOWED
                    if _is_any(arg.annotation) and not allowed:
                        offenders.append(f"{rel}:{f.lineno} {label}({arg.arg}: Any)")
    return offenders


def test_the_any_rule_sees_each_package(tmp_path: Path) -> None:
    shared = "from typing import Any\n\ndef f(cfg: Any, value: Any) -> None: ...\n"
    root = make_tree(
        tmp_path,
        {
            "steadfast/__init__.py": "",
            "steadfast/loop/__init__.py": "",
            "steadfast/loop/a.py": shared + "\ndef inner(cfg: Any) -> None: ...\n",
            "steadfast/loop/b.py": "from .a import inner\n",  # the same package: not looked at
            "steadfast/telemetry/__init__.py": "",
            "steadfast/telemetry/c.py": "from ..loop import a\n\na.f(1, 2)\n",
            "steadfast/run.py": "from .faults import g\n",
            "steadfast/faults.py": "from typing import Any\n\ndef g(kind: Any) -> None: ...\n",
        },
    )
    assert sorted(any_parameters(code_modules(root), root)) == [
        "steadfast/faults.py:3 g(kind: Any)",
        "steadfast/loop/a.py:3 f(cfg: Any)",
    ]


def test_no_any_parameters_between_packages() -> None:
    offenders = any_parameters(code_modules(), ROOT)
    assert not offenders, "parameters typed Any between packages (type them, or say why in ANY_ALLOWED):\n" + "\n".join(offenders)


# ---- the registry rule ---------------------------------------------------------------------------------

BACKENDS_DIR = LAUNCHER / "_backends"
# (file, name): a string that equals a backend's name but is not one.
NAME_ALLOWED = {
    ("steadfast/contract/env.py", "horovod"): "the collective library's name (STEADFAST_COLLECTIVE), which that backend shares",
    (
        "launchers/hydra_plugins/steadfast_launcher/_compat/horovod_runner.py",
        "horovod",
    ): "the distribution its patches are gated on",
}


def _backend_names() -> Set[str]:
    return {p.stem for p in (ROOT / "steadfast" / "conf" / "backend").glob("*.yaml")}


def test_backends_are_named_only_in_their_own_module_and_yaml() -> None:
    names = _backend_names()
    assert {"torchrun", "horovod", "local"} <= names, names
    offenders = []
    for name, path in code_modules().items():
        if BACKENDS_DIR in path.parents:
            continue
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names and (rel, node.value) not in NAME_ALLOWED:
                offenders.append(f"{rel}:{node.lineno} names backend {node.value!r}")
        for target, line in imports(path, name):
            if target.startswith(f"{PACKAGE}._backends.") and target.split(".")[3] in names:
                offenders.append(f"{rel}:{line} imports the backend module {target} (ask the registry)")
    assert not offenders, "backend knowledge outside _backends/ (the registry answers it):\n" + "\n".join(offenders)


# ---- the compat rule -----------------------------------------------------------------------------------

COMPAT_DIR = LAUNCHER / "_compat"
# Underscore names of the standard library that are documented as its API.
DOCUMENTED = {"os._exit", "sys._getframe", "_thread", "_thread.interrupt_main"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _third_party(module: str) -> bool:
    return module.split(".")[0] not in OURS and module != "__future__"


def _compat_offences(path: Path, name: str) -> Iterator[Tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    aliases: Dict[str, str] = {}  # local name -> the third-party module or object it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _third_party(alias.name):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _third_party(node.module):
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for target, line in imports(path, name):
        if _third_party(target) and any(_private(part) for part in target.split(".")) and target not in DOCUMENTED:
            yield line, f"imports {target}"

    def rooted(node: ast.expr) -> Optional[str]:
        """The dotted third-party name an expression reads (`alias.attr.attr`), or None."""
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = rooted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            full = rooted(node)
            if full and _private(node.attr) and full not in DOCUMENTED:
                yield node.lineno, f"reads {full}"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and rooted(target.value):
                    yield node.lineno, f"patches {rooted(target)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            owner = rooted(node.args[0])
            if node.func.id in ("setattr", "delattr") and owner:
                yield node.lineno, f"patches {owner} ({node.func.id})"
            attribute = node.args[1] if len(node.args) > 1 else None
            if (
                node.func.id in ("getattr", "hasattr")
                and owner
                and isinstance(attribute, ast.Constant)
                and isinstance(attribute.value, str)
                and _private(attribute.value)
            ):
                yield node.lineno, f"reads {owner}.{attribute.value}"


def test_third_party_internals_are_touched_only_in_compat() -> None:
    offenders = []
    for name, path in code_modules().items():
        if COMPAT_DIR not in path.parents:
            offenders += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in _compat_offences(path, name)]
    assert not offenders, "third-party internals outside the launcher's _compat package:\n" + "\n".join(offenders)


def test_the_compat_rule_sees_a_patch(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import multiprocessing.forkserver as fs\nfrom horovod.runner import gloo_run\nfrom torch._logging import x\n"
        "gloo_run.register_shutdown_event = None\nfs._forkserver._forkserver_pid\ngetattr(fs, '_forkserver')\n"
    )
    found = [what for _, what in _compat_offences(sample, "tests.sample")]
    assert "imports torch._logging" in found and "patches horovod.runner.gloo_run.register_shutdown_event" in found
    assert (
        "reads multiprocessing.forkserver._forkserver" in found
        and "reads multiprocessing.forkserver._forkserver._forkserver_pid" in found
    )


# ---- the tests' folders --------------------------------------------------------------------------------


def test_every_test_is_in_a_folder_the_tests_readme_names() -> None:
    """Where a test for X goes is tests/README.md's table: a test file at tests/'s top, or in a folder
    the table does not name, fails here. Names stay unique (the folders are no packages)."""
    tests = ROOT / "tests"
    named = set(re.findall(r"^\| `(\w+)/` \|", (tests / "README.md").read_text(), re.M))
    files = sorted(p.relative_to(tests) for p in python_files(tests) if p.name.startswith("test_"))
    assert len(files) > 60 and {"launcher", "checkpoint", "loop"} <= named, (len(files), named)
    misplaced = [str(f) for f in files if len(f.parts) < 2 or f.parts[0] not in named]
    assert not misplaced, "test files outside the folders tests/README.md names (add them to one): " + ", ".join(misplaced)
    by_name: Dict[str, List[str]] = {}
    for f in files:
        by_name.setdefault(f.name, []).append(str(f))
    twins = [" and ".join(v) for v in by_name.values() if len(v) > 1]
    assert not twins, "test files of one name (pytest imports each by its name alone: rename one): " + "; ".join(twins)
