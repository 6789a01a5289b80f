"""The source tree's `kernels/` folder never stands in for the PyPI `kernels` distribution.

From a checkout, `python -m ...` and pytest put the repository root on `sys.path`, where
`kernels/` (installed as `compiled_engine.kernels`) is importable as a bare `kernels` too.
transformers >= 5.25 depends on the PyPI distribution of that name and imports it while it loads,
so a shadowing folder broke every import of a transformers model class. Each check runs in a
fresh interpreter started in the repository root, the way those commands start.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run_in_root(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


def _kernels_distribution_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _kernels_distribution_installed(), reason="the PyPI `kernels` is not installed")
def test_bare_kernels_is_the_installed_distribution_and_transformers_loads():
    code = (
        "import pathlib\n"
        "import kernels\n"
        "print(pathlib.Path(kernels.__file__).resolve())\n"
        "from transformers import LlamaForCausalLM\n"
        "import compiled_engine.kernels as ours\n"
        "print(ours.PAGED_ATTENTION_VERSION, pathlib.Path(ours.__file__).resolve())\n"
    )
    done = _run_in_root(code)
    assert done.returncode == 0, done.stderr
    bare, ours = done.stdout.splitlines()[-2:]
    assert not Path(bare).is_relative_to(REPO_ROOT / "kernels"), bare
    version, ours_file = ours.split(" ", 1)
    assert Path(ours_file) == REPO_ROOT / "kernels" / "__init__.py"
    assert version


def test_bare_kernels_without_the_distribution_is_a_clear_import_error():
    # -S leaves site-packages off sys.path: no installed `kernels` to defer to, only the folder.
    done = _run_in_root("import kernels", "-S")
    assert done.returncode != 0
    assert "ModuleNotFoundError: No module named 'kernels'" in done.stderr
    assert "installs as compiled_engine.kernels" in done.stderr
