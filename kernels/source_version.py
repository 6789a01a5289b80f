"""Versions of the engine's graph-shaping code, derived from its source text.

Every pass, op, policy and runtime that shapes a compiled graph puts a version into the
compile-cache key (graphs/compile_manifest.py). A hand-kept string is only as good as the
memory of whoever edits the code; a hash of the code cannot be forgotten. So a component's
version is a hash of the source files that define it: its own module and the in-package
helpers whose code ends up in its output. Any edit, even a comment, makes a new version;
a needless rebuild is cheap next to a stale artifact that loads.

The hash covers each file's name and bytes (not its path), so two checkouts of the same
source agree, and it is computed once per file and process. It lives in kernels/ because both
kernels/ (op versions) and graphs/ (pass, policy, runtime versions) use it, and graphs/ already
depends on kernels/, never the reverse.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from functools import cache
from pathlib import Path

# Hex digits kept: 64 bits, far beyond any collision risk among a few dozen files' histories.
_DIGITS = 16


@cache
def _file_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        # No source, no version: refusing is better than keying the cache on nothing.
        raise RuntimeError(f"cannot read {path} to derive its version: {exc}") from exc


def files_version(*paths: str | os.PathLike[str]) -> str:
    """A short hash of these files' names and contents, in the order given."""
    if not paths:
        raise ValueError("a version needs at least one source file")
    digest = hashlib.sha256()
    for path in map(Path, paths):
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(_file_bytes(path.resolve()))
        digest.update(b"\0")
    return digest.hexdigest()[:_DIGITS]


def module_file(module_name: str) -> Path:
    """The source file of a module, found without importing it (it may be importing right now)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise RuntimeError(f"module {module_name!r} has no Python source file to derive a version from")
    return Path(spec.origin)


def source_version(*module_names: str) -> str:
    """A short hash of these modules' source files; the first is usually the caller's `__name__`."""
    return files_version(*(module_file(name) for name in module_names))
