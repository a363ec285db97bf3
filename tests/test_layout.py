"""The code layout's promises (docs/architecture.md), checked on the source itself.

By AST over every production module, imports inside functions and under TYPE_CHECKING included:
- only connector/ and the replica package (serve_app/replica/) import vLLM;
- the ingress package (serve_app/ingress/) imports neither torch, vLLM nor redis-py (Redis is
  reached through memory.directory and memory.key_store);
- the memory domain (memory/) imports neither Ray nor vLLM; kvarena/ imports neither;
- the card's memory plan (gpuplan/) imports none of torch, vLLM, Ray or the project's other rooms;
- no import circles between the project's modules;
- no module over 400 lines; every module says its role;
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
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ["serve_app", "actors", "memory", "kvarena", "connector", "gpuplan", "devtools", "loadtest"]
PACKAGES = [*PRODUCT, "bench"]


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


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in python_files(*PACKAGES, "tests") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


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
