"""Versions derived from source (kernels/source_version.py): an edit to a pass is a new cache key."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
import torch

from compiled_engine.graphs import pass_pipeline
from compiled_engine.graphs.compile_manifest import GraphOptions, build_manifest, diff_fields, manifest_key
from compiled_engine.graphs.compiled_step import step_component_versions
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.kernels.source_version import files_version, module_file, source_version

OPTIONS = GraphOptions(
    dtype=torch.float32,
    block_size=16,
    buckets=(1, 2),
    max_num_seqs=2,
    max_num_batched_tokens=32,
    kv_cache_shape=(2, 16, 2, 16),
    fuse_linears=True,
    attention_backend="torch",
)
DCE = "compiled_engine.graphs.passes.dce"
STEP_INPUTS = "compiled_engine.graphs.step_inputs"

# Prints the manifest key of a fixed model and options, computed in a fresh interpreter.
KEY_SCRIPT = """
import torch
from compiled_engine.graphs.compile_manifest import GraphOptions, build_manifest, manifest_key
from compiled_engine.graphs.compiled_step import step_component_versions
torch.manual_seed(0)
options = GraphOptions(torch.float32, 16, (1, 2), 2, 32, (2, 16, 2, 16), True, "torch")
versions = step_component_versions(True)
print(manifest_key(build_manifest(torch.nn.Linear(4, 3), options, torch.device("cpu"), versions)))
"""


def _edited_copy(tmp_path, module: str, edit: str | None):
    """A copy of `module`'s source file (same name), optionally with `edit` appended."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    copy = tmp_path / module_file(module).name
    shutil.copyfile(module_file(module), copy)
    if edit is not None:
        copy.write_text(copy.read_text() + edit)
    return copy


def test_a_pass_version_is_the_hash_of_its_source(tmp_path) -> None:
    same = _edited_copy(tmp_path / "same", DCE, None)
    assert DeadCodeElimination.version == files_version(same, module_file(STEP_INPUTS))
    assert DeadCodeElimination.version == source_version(DCE, STEP_INPUTS)
    edited = _edited_copy(tmp_path / "edited", DCE, "\n# a comment is an edit too\n")
    assert files_version(edited, module_file(STEP_INPUTS)) != DeadCodeElimination.version
    # Its helpers' source counts too, and the order of the files.
    assert source_version(DCE) != DeadCodeElimination.version
    assert source_version(STEP_INPUTS, DCE) != DeadCodeElimination.version


def test_editing_a_pass_changes_the_manifest_key(tmp_path, monkeypatch) -> None:
    model = torch.nn.Linear(4, 3)
    base = build_manifest(model, OPTIONS, torch.device("cpu"), step_component_versions(True))
    # The real pass module, edited: loaded from its own (modified) file under another name.
    copy = _edited_copy(tmp_path, DCE, "\n\ndef _an_edit():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("edited_dce", copy)
    edited = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "edited_dce", edited)
    spec.loader.exec_module(edited)
    assert edited.DeadCodeElimination.version == files_version(copy, module_file(STEP_INPUTS))
    # The default pipeline built with the edited pass (as if the file had been changed in place).
    monkeypatch.setattr(pass_pipeline, "DeadCodeElimination", edited.DeadCodeElimination)
    changed = build_manifest(model, OPTIONS, torch.device("cpu"), step_component_versions(True))
    assert diff_fields(base, changed) == ["versions.pass.dce"]
    assert manifest_key(changed) != manifest_key(base)


def test_the_key_is_stable_across_processes() -> None:
    torch.manual_seed(0)
    here = manifest_key(
        build_manifest(torch.nn.Linear(4, 3), OPTIONS, torch.device("cpu"), step_component_versions(True))
    )
    # Both processes at once: each spends its time importing torch, on a core of its own.
    procs = [
        subprocess.Popen([sys.executable, "-c", KEY_SCRIPT], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    keys = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert [k.strip() for k in keys] == [here, here]


def test_a_module_without_source_has_no_version() -> None:
    with pytest.raises(RuntimeError, match="no Python source"):
        source_version("torch._C")  # an extension module
    with pytest.raises(ValueError):
        files_version()
