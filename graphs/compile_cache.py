"""The on-disk compile cache: entries of compiled step artifacts, keyed by an explicit manifest.

Layout under the cache root (default `~/.cache/compiled_engine`, or COMPILED_ENGINE_CACHE_DIR,
or `cache_dir=`):

    inductor/                 Inductor's own cache (TORCHINDUCTOR_CACHE_DIR), unless the user set one
    entries/<key>/manifest.json   the fields that made <key> (graphs/compile_manifest.py)
    entries/<key>/<name>.json     small records (the step's calling convention, GEMV decision)
    entries/<key>/<name>.artifact one compiled graph: a header line and Inductor's saved bytes

Safety rules, all tested:
- Every file is written to a temporary name in its directory and renamed into place, so a
  reader sees a whole file or none; two processes writing the same entry at once each rename
  a complete file, and the last one wins (both are valid compilations of the same key).
- An artifact's header records its payload's length and SHA-256, checked on every read; a
  JSON record must parse and have the expected fields. Anything else (truncation, bit rot, a
  torch that cannot load it) is reported with a warning naming the file, the file is removed,
  and the caller rebuilds it: never a crash, never stale code.
- On a miss, the fields that differ from the nearest existing entry are logged.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compiled_engine.graphs.compile_manifest import Manifest, manifest_key, nearest

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "COMPILED_ENGINE_CACHE_DIR"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_ARTIFACT_MAGIC = b"compiled-engine-artifact 1\n"


def default_cache_root() -> Path:
    value = os.environ.get(CACHE_DIR_ENV, "").strip()
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "compiled_engine"


def use_inductor_cache_in(root: Path) -> Path:
    """Point Inductor's cache into `root` unless the user chose one; return the one in use.

    Inductor's cache holds the C++/Triton builds our artifacts' code needs: kept next to our
    entries, a warm start loads in seconds instead of rebuilding them. Inductor sets the
    variable itself (to its default) on first use, so "the user chose one" means "set to
    anything but that default".
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if current and current != default_cache_dir():
        return Path(current)
    ours = root / "inductor"
    ours.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(ours)
    return ours


def usable_compile_cache(root: str | os.PathLike[str] | None = None) -> CompileCache:
    """The compile cache at `root` (default as CompileCache's), or, when that cannot be written
    (a read-only disk, a path through a file), one in a fresh temporary directory with a
    warning: the engine still compiles, caches and hands graphs between its processes, but
    nothing is kept after it exits."""
    cache = CompileCache(root)
    try:
        cache.entries_dir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=cache.entries_dir, prefix=".write-probe-")  # noqa: SIM115
        probe.close()
    except OSError as exc:
        fallback = tempfile.mkdtemp(prefix="compiled-engine-cache-")
        logger.warning(
            "compile cache %s is not writable (%s): using %s for this process; compiled graphs will "
            "not be kept after it exits",
            cache.root,
            exc,
            fallback,
        )
        atexit.register(shutil.rmtree, fallback, ignore_errors=True)
        return CompileCache(fallback)
    return cache


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that no reader ever sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CorruptCacheFile(Exception):
    """A cache file failed its checks; the message says which check."""


class CompileCache:
    """The cache root: hands out entries by manifest."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_root()
        self.entries_dir = self.root / "entries"

    def entry(self, manifest: Manifest) -> CacheEntry:
        return CacheEntry(self, manifest)

    def manifests(self) -> Iterator[tuple[Path, Manifest]]:
        """Every readable manifest under the root (unreadable ones are skipped)."""
        if not self.entries_dir.is_dir():
            return
        for path in sorted(self.entries_dir.glob("*/manifest.json")):
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict):
                yield path.parent, manifest


class CacheEntry:
    """One manifest's directory of records and artifacts."""

    def __init__(self, cache: CompileCache, manifest: Manifest) -> None:
        self.cache = cache
        self.manifest = dict(manifest)
        self.key = manifest_key(self.manifest)
        self.dir = cache.entries_dir / self.key

    def exists(self) -> bool:
        return (self.dir / "manifest.json").is_file()

    def explain_miss(self) -> str:
        """Why this entry is new: the fields differing from the nearest entry, if there is one."""
        others = [m for d, m in self.cache.manifests() if d != self.dir]
        found = nearest(self.manifest, others)
        if found is None:
            return f"compile cache miss: {self.cache.entries_dir} has no entries yet"
        other, fields = found
        changes = ", ".join(
            f"{f}: {other.get(f, '<absent>')!r} -> {self.manifest.get(f, '<absent>')!r}" for f in fields
        )
        return f"compile cache miss: nearest entry differs in {len(fields)} field(s): {changes}"

    def ensure(self) -> None:
        """Create the entry (its manifest) if it is not there yet."""
        if not self.exists():
            atomic_write(
                self.dir / "manifest.json", json.dumps(self.manifest, indent=1, sort_keys=True).encode()
            )

    # Small JSON records.

    def read_record(self, name: str, required: tuple[str, ...]) -> dict[str, Any] | None:
        path = self.dir / f"{name}.json"
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_bytes())
            if not isinstance(record, dict) or any(k not in record for k in required):
                raise CorruptCacheFile(f"missing fields (want {list(required)})")
        except (OSError, ValueError, CorruptCacheFile) as exc:
            self.discard(path, exc)
            return None
        return record

    def write_record(self, name: str, record: dict[str, Any]) -> None:
        self.ensure()
        atomic_write(self.dir / f"{name}.json", json.dumps(record, indent=1, sort_keys=True).encode())

    # Compiled artifacts.

    def artifact_path(self, name: str) -> Path:
        return self.dir / f"{name}.artifact"

    def artifact_names(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.artifact")) if self.dir.is_dir() else []

    def write_artifact(self, name: str, header: dict[str, Any], payload: bytes) -> None:
        self.ensure()
        header = dict(header, payload_size=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
        data = _ARTIFACT_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload
        atomic_write(self.artifact_path(name), data)

    def read_artifact(self, name: str) -> tuple[dict[str, Any], bytes] | None:
        """(header, payload) of a verified artifact; None if absent or corrupt (then removed)."""
        path = self.artifact_path(name)
        if not path.is_file():
            return None
        try:
            data = path.read_bytes()
            if not data.startswith(_ARTIFACT_MAGIC):
                raise CorruptCacheFile("bad magic")
            header_end = data.index(b"\n", len(_ARTIFACT_MAGIC))
            header = json.loads(data[len(_ARTIFACT_MAGIC) : header_end])
            payload = data[header_end + 1 :]
            if len(payload) != header.get("payload_size"):
                raise CorruptCacheFile(
                    f"payload is {len(payload)} bytes, header says {header.get('payload_size')}"
                )
            if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
                raise CorruptCacheFile("payload checksum mismatch")
        except (OSError, ValueError, CorruptCacheFile) as exc:
            self.discard(path, exc)
            return None
        return header, payload

    def discard(self, path: Path, reason: BaseException | str) -> None:
        """Report a bad cache file and remove it, so the caller's rebuild replaces it."""
        logger.warning("compile cache: %s is unusable (%s); removing it and rebuilding", path, reason)
        with contextlib.suppress(OSError):
            path.unlink()
