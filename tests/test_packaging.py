"""`pip install .` installs the product's packages only: bench/ and devtools/ are repository tools,
run from the checkout (pyproject.toml's packages.find; pytest finds them through its `pythonpath`).

The install goes into a fresh virtual environment (no system site-packages), from a copy of the
checkout's sources, without dependencies: what it checks is which packages the wheel carries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = {"serve_app", "actors", "connector", "memory", "kvarena", "gpuplan", "loadtest"}
TOOLS = {"bench", "devtools"}


@pytest.mark.slow
def test_a_clean_install_holds_the_product_packages_only(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in sorted(PRODUCT | TOOLS):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}  # nothing of this checkout
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    probe = (
        "import importlib.metadata as m, importlib.util as u, json\n"
        "files = m.files('kv-memory-serve')\n"
        "tops = sorted({f.parts[0] for f in files if not f.parts[0].endswith(('.dist-info', '.pth')) and f.parts[0] != '..'})\n"
        "print(json.dumps({'tops': tops, 'importable': {n: u.find_spec(n) is not None for n in %r}}))" % sorted(PRODUCT | TOOLS)
    )
    found = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(found.stdout.strip().splitlines()[-1])
    assert set(report["tops"]) == PRODUCT
    assert {name for name, ok in report["importable"].items() if ok} == PRODUCT  # bench and devtools: not installed
