"""The code layout's promises (docs/architecture.md), checked on the source itself.

- the HTTP ingress imports neither torch nor vLLM (it starts fast and stays small);
- the memory domain imports neither vLLM nor Ray (it runs and tests without either);
- kvarena, the contract between memory and engine, imports no vLLM;
- no module over 400 lines; no test or benchmark imports another module's private name;
- no call into another process is named by a string (getattr on a handle, `op: str` dispatch).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ["serve_app", "actors", "memory", "kvarena", "connector", "devtools", "loadtest", "bench"]


def modules_loaded_after(code: str) -> set[str]:
    """Top-level module names in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_ingress_imports_neither_torch_nor_vllm() -> None:
    loaded = modules_loaded_after("import serve_app.app, serve_app.ingress, serve_app.settings, serve_app.protocol")
    assert "fastapi" in loaded and "ray" in loaded  # the probe did import the ingress
    assert not loaded & {"torch", "vllm", "transformers", "sentence_transformers"}


def test_memory_domain_imports_neither_vllm_nor_ray() -> None:
    loaded = modules_loaded_after(
        "import memory.shard, memory.planner, memory.kv_lifecycle, memory.fact_store, memory.index, "
        "memory.embedder, memory.prompting, memory.composition, memory.settings, kvarena.arena, kvarena.params"
    )
    assert "memory" in loaded and "torch" in loaded
    assert not loaded & {"vllm", "ray"}


def test_kvarena_contract_imports_no_vllm() -> None:
    loaded = modules_loaded_after("import kvarena.params, kvarena.arena")
    assert "vllm" not in loaded and "ray" not in loaded


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in python_files(*PACKAGES, "tests") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_every_module_says_its_role() -> None:
    silent = [
        str(p.relative_to(REPO))
        for p in python_files(*PACKAGES)
        if p.name != "__init__.py" and p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert silent == []


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
