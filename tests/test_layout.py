"""The code layout's promises (docs/architecture.md), checked on the source itself.

By AST over every production module, imports inside functions and under TYPE_CHECKING included:
- only connector/ and the replica package (serve_app/replica/) import vLLM;
- the ingress package (serve_app/ingress/) imports neither torch, vLLM nor redis-py (Redis is
  reached through memory.directory and memory.key_store);
- the memory domain (memory/) imports neither Ray nor vLLM; kvarena/ imports neither;
- the card's memory plan (gpuplan/) imports none of torch, vLLM, Ray or the project's other rooms;
- the rooms stand on declared floors (FLOORS): a module imports only its own room and rooms on a
  lower floor, so no arrow runs up, two rooms of one floor never import each other (the replica
  does not import the ingress), and no circle can run between rooms;
- no import circles between the project's modules;
- an import inside a function keeps a heavy library (HEAVY, or a project module that loads one)
  out of a process, and says why in a comment;
- reading the service settings loads settings modules only;
- a module over 400 lines is named in a warning (split by job, not by count); every module says its role;
- docs/architecture.md names every production module by its path, and every path it names exists.
bench/ and tests/ are instruments, not the product: they may import anything, but no private
name of another module. No call into another process is named by a string.
A runtime probe also checks that importing the ingress loads no torch or vLLM transitively.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ["serve_app", "actors", "memory", "kvarena", "connector", "gpuplan", "loadtest"]
PACKAGES = [*PRODUCT, "devtools", "bench"]

# The rooms, floor by floor from the bottom (a room: the modules under one of its prefixes; a module
# belongs to the room of its longest prefix). A room imports only itself and the floors below it.
FLOORS: list[dict[str, tuple[str, ...]]] = [
    {"gpuplan": ("gpuplan",), "kvarena": ("kvarena",)},
    {"memory.index": ("memory.index",)},
    {"memory": ("memory",), "connector": ("connector",)},
    {"actors": ("actors",)},
    {"serve_app (shared)": ("serve_app",)},
    {"ingress": ("serve_app.ingress",), "replica": ("serve_app.replica",)},
    {"builder": ("serve_app.app", "serve_app.direct_ingress")},
    {"loadtest": ("loadtest",), "devtools": ("devtools",)},
    {"bench": ("bench",)},
]


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def imported_names(path: Path) -> tuple[str, ...]:
    """Every module name an `import` or `from ... import` in the file names, anywhere in it
    (functions and TYPE_CHECKING blocks included); `from a import b` gives `a` and `a.b`."""
    names: list[str] = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return tuple(names)


def importers_of(top: str, roots: list[str]) -> set[str]:
    return {str(p.relative_to(REPO)) for p in python_files(*roots) if any(n.split(".")[0] == top for n in imported_names(p))}


def test_only_the_connector_and_the_replica_import_vllm() -> None:
    allowed = ("connector/", "serve_app/replica/")
    assert sorted(f for f in importers_of("vllm", PRODUCT) if not f.startswith(allowed)) == []
    assert importers_of("vllm", ["serve_app/replica"]) and importers_of("vllm", ["connector"])  # the rule bites


@pytest.mark.parametrize("top", ["torch", "vllm", "redis"])
def test_the_ingress_package_imports_neither_torch_vllm_nor_redis(top: str) -> None:
    assert sorted(importers_of(top, ["serve_app/ingress"])) == []


@pytest.mark.parametrize("top", ["ray", "vllm"])
def test_memory_and_kvarena_import_neither_ray_nor_vllm(top: str) -> None:
    assert sorted(importers_of(top, ["memory", "kvarena"])) == []


@pytest.mark.parametrize("top", ["torch", "vllm", "ray", "transformers", "serve_app", "actors", "memory", "kvarena", "connector"])
def test_the_card_plan_imports_no_implementation(top: str) -> None:
    """gpuplan/ is pure: the builder, the replica and the shard import it without loading anything."""
    assert sorted(importers_of(top, ["gpuplan"])) == []


def project_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in python_files(*PACKAGES)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {n for n in imported_names(path) if n in modules and n != name}
        graph[name] = targets
    return graph


def test_no_import_circles() -> None:
    graph = project_graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # a package's __init__ re-exporting its own modules is no circle when those modules do not import it back
    assert circles == []


def room_of(module: str) -> tuple[int, str] | None:
    """(floor, room) of a project module: its longest declared prefix."""
    best: tuple[int, int, str] | None = None
    for floor, rooms in enumerate(FLOORS):
        for room, prefixes in rooms.items():
            for prefix in prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), floor, room)
    return None if best is None else (best[1], best[2])


def room_arrows() -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> the module imports that draw that arrow, between different rooms."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, targets in project_graph().items():
        source = room_of(module)
        for target in targets:
            destination = room_of(target)
            if source and destination and source[1] != destination[1]:
                arrows.setdefault((source[1], destination[1]), []).append(f"{module} -> {target}")
    return arrows


def test_every_module_is_in_a_declared_room() -> None:
    assert sorted(m for m in project_graph() if room_of(m) is None) == []


def test_a_room_imports_only_the_floors_below_it() -> None:
    """No arrow runs up or sideways: the replica does not import the ingress, nor the shared
    modules the builder; with every arrow pointing down, no circle can run between rooms."""
    floor = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
    arrows = room_arrows()
    upward = {f"{a} -> {b}": imports for (a, b), imports in arrows.items() if floor[b] >= floor[a]}
    assert upward == {}
    assert ("replica", "ingress") not in arrows and ("ingress", "replica") not in arrows
    assert ("builder", "replica") in arrows and ("builder", "ingress") in arrows  # the rule bites


def test_long_modules_are_named_in_a_warning() -> None:
    """A module past 400 lines is a warning naming it, not a failure: split a module by its jobs,
    not to meet a line count."""
    long = {str(p.relative_to(REPO)): n for p in python_files(*PACKAGES, "tests") if (n := len(p.read_text().splitlines())) > 400}
    for path, lines in sorted(long.items()):
        warnings.warn(f"{path} has {lines} lines (over 400): does it do more than one job?", stacklevel=1)


# Libraries a process may be spared by importing them inside the function that needs them.
HEAVY = {"vllm", "torch", "transformers", "sentence_transformers", "bm25s", "Stemmer", "cuvs", "triton", "cuda", "jax", "pynvml", "huggingface_hub"}


def in_function_and_top_level_imports(path: Path) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(imports inside functions, imports run when the module is imported); imports under
    `if TYPE_CHECKING:` are neither."""
    inside: list[ast.stmt] = []
    top: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inside if in_function else top).append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return inside, top


def statement_names(node: ast.stmt, path: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


@lru_cache(maxsize=1)
def heavy_modules() -> frozenset[str]:
    """Project modules whose import loads a HEAVY library (through their top-level imports)."""
    modules = {module_name(p): p for p in python_files(*PRODUCT)}
    direct = {name: {n for node in in_function_and_top_level_imports(p)[1] for n in statement_names(node, p)} for name, p in modules.items()}
    heavy = {name for name, names in direct.items() if any(n.split(".")[0] in HEAVY for n in names)}
    while True:
        more = {name for name, names in direct.items() if name not in heavy and names & heavy}
        if not more:
            return frozenset(heavy)
        heavy |= more


def commented(lines: list[str], lineno: int) -> bool:
    """The import's line, another line of its group of imports, or the line above the group says why."""
    first = last = lineno - 1
    while first > 0 and re.match(r"\s*(from|import) ", lines[first - 1]):
        first -= 1
    while last + 1 < len(lines) and re.match(r"\s*(from|import) ", lines[last + 1]):
        last += 1
    return any("#" in line for line in lines[first - 1 if first else 0 : last + 1])


def test_imports_inside_functions_keep_a_heavy_library_out_and_say_why() -> None:
    unneeded, silent = [], []
    for path in python_files(*PRODUCT):
        lines = path.read_text().splitlines()
        for node in in_function_and_top_level_imports(path)[0]:
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            names = statement_names(node, path)
            if not any(n.split(".")[0] in HEAVY or n in heavy_modules() for n in names):
                unneeded.append(f"{where} {lines[node.lineno - 1].strip()}")
            elif not commented(lines, node.lineno):
                silent.append(where)
    assert unneeded == [], "imports inside functions that keep nothing heavy out: import them at the top"
    assert silent == [], "imports inside functions without a comment saying why"


def test_reading_the_settings_loads_settings_modules_only() -> None:
    probe = "import serve_app.settings, json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = [m for m in json.loads(done.stdout.strip().splitlines()[-1]) if m.split(".")[0] in PRODUCT]
    packages = {module_name(p) for p in python_files(*PRODUCT) if p.name == "__init__.py"}
    assert [m for m in loaded if m not in packages and not m.endswith("settings") and m != "serve_app.client_limits"] == []


def test_every_module_says_its_role() -> None:
    silent = [
        str(p.relative_to(REPO))
        for p in python_files(*PACKAGES)
        if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert silent == []


def holds_code(path: Path) -> bool:
    """More than a docstring (a package's __init__ that only says what the package is, is not a module to name)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def test_the_architecture_document_names_every_module_and_only_real_ones() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:[\w-]+/)+[\w-]+\.py)`", text))
    production = {str(p.relative_to(REPO)) for p in python_files(*PRODUCT) if p.name != "__init__.py" or holds_code(p)}
    assert sorted(production - named) == [], "production modules docs/architecture.md does not name"
    assert sorted(n for n in named if not (REPO / n).exists()) == [], "docs/architecture.md names modules that do not exist"


def modules_loaded_after(code: str) -> set[str]:
    """Top-level module names in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_ingress_loads_neither_torch_nor_vllm() -> None:
    loaded = modules_loaded_after("import serve_app.ingress.routes, serve_app.ingress.auth, serve_app.settings, serve_app.protocol")
    assert "fastapi" in loaded and "ray" in loaded  # the probe did import the ingress
    assert not loaded & {"torch", "vllm", "transformers", "sentence_transformers"}


def test_building_the_application_loads_no_vllm() -> None:
    """`serve run`'s driver imports the builder and the deployment classes, not the engine."""
    loaded = modules_loaded_after("import serve_app.app")
    assert "vllm" not in loaded and "torch" not in loaded


def project_module(name: str | None) -> bool:
    return bool(name) and name.split(".")[0] in set(PACKAGES) | {"tests"}


@pytest.mark.parametrize("root", ["tests", "bench"])
def test_no_private_name_of_another_module_is_imported(root: str) -> None:
    offenders = []
    for path in python_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and project_module(node.module):
                offenders += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []


def test_no_cross_process_call_is_named_by_a_string() -> None:
    """`getattr(handle, name).remote(...)` or a method that dispatches on an operation name."""
    offenders = []
    for path in python_files("serve_app", "actors"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in {"remote", "options"}
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "getattr"
            ):
                offenders.append(f"{path.name}:{node.lineno} getattr(...).{node.attr}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args:
                    named_by_string = isinstance(arg.annotation, ast.Name) and arg.annotation.id == "str"
                    if named_by_string and arg.arg in {"op", "method", "method_name", "operation"}:
                        offenders.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
    assert offenders == []
