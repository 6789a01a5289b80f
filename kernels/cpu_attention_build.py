"""Build and load kernels/cpu_attention.cpp as a shared library, once per machine and source.

The library lives in Inductor's cache dir (the engine points that into its compile cache, see
graphs/compile_cache.py), next to the C++ Inductor builds for the same graphs, under a name keyed
by everything that shapes the binary: the source (and the headers of its folder it includes), the
compiler and its version, the flags and
the CPU (flags are `-march=native`, so a cache copied to another machine must not reuse it). A
first build takes ~1-2 s; later processes only load it. The write is atomic (build to a temporary
name in the same folder, then rename), so concurrent first uses are safe.

It links OpenMP by soname, so in a process that imported torch the kernel shares torch's OpenMP
runtime and thread pool (torch's wheel ships libgomp.so.1), as Inductor's own kernels do.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
COMPILER_ENV = "CXX"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")

_LOCK = threading.Lock()
logger = logging.getLogger(__name__)


class CpuKernelBuildError(RuntimeError):
    """The CPU attention kernel could not be built or loaded; the message says why."""


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else g++), or None if there is none on PATH."""
    return shutil.which(os.environ.get(COMPILER_ENV, "").strip() or "g++")


@cache
def _compiler_identity(path: str) -> str:
    result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
    return result.stdout.splitlines()[0] if result.stdout else path


def _cpu_identity() -> str:
    # /proc/cpuinfo's model and flags say what -march=native will target; elsewhere the arch only.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def library_key(source: bytes, compiler_path: str, extra_flags: Sequence[str] = ()) -> str:
    digest = hashlib.sha256()
    flags = " ".join((*FLAGS, *extra_flags))
    for part in (source, _compiler_identity(compiler_path).encode(), flags.encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:20]


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"/]+)"', re.MULTILINE)


def local_headers(source_file: Path) -> list[Path]:
    """The headers of `source_file`'s own folder it includes (`#include "name.h"`)."""
    return [source_file.with_name(name.decode()) for name in _LOCAL_INCLUDE.findall(source_file.read_bytes())]


def source_with_headers(source_file: Path) -> bytes:
    """What a library built from `source_file` is made of: its text and its local headers', so a
    change to a shared header keys a new build."""
    return b"\0".join(path.read_bytes() for path in (source_file, *local_headers(source_file)))


def default_build_dir() -> Path:
    # The variable when set (the engine sets it to its compile cache): resolving Inductor's
    # default imports much of Inductor.
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").strip()
    if chosen:
        return Path(chosen) / "compiled_engine_cpu_kernels"
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "compiled_engine_cpu_kernels"


def build(directory: Path | None = None, source_file: Path = SOURCE, extra_flags: Sequence[str] = ()) -> Path:
    """The shared library for `source_file` (the attention kernel unless another of kernels/'s C++
    sources, e.g. kernels/cpu_gemv.cpp), this compiler and CPU: built into `directory` if missing.

    `extra_flags` go after the source on the command line and into the name's key (include and
    link flags: kernels/cpu_ops.py links other libraries of this folder)."""
    cxx = compiler()
    if cxx is None:
        raise CpuKernelBuildError(
            f"no C++ compiler: set ${COMPILER_ENV} or install g++ (needed for {source_file.name})"
        )
    source = source_with_headers(source_file)
    directory = directory or default_build_dir()
    target = directory / f"{source_file.stem}-{library_key(source, cxx, extra_flags)}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
        os.close(fd)
    except OSError as exc:
        raise CpuKernelBuildError(f"cannot write the kernel library into {directory}: {exc}") from exc
    try:
        result = subprocess.run(
            [cxx, *FLAGS, str(source_file), *extra_flags, "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise CpuKernelBuildError(f"{cxx} failed on {source_file.name}:\n{result.stderr[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuKernelBuildError(f"could not run {cxx} on {source_file.name}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_loaded: ctypes.CDLL | None = None
_other_libraries: dict[Path, ctypes.CDLL] = {}


def load_library(
    source_file: Path, declare: Callable[[ctypes.CDLL], None], directory: Path | None = None
) -> ctypes.CDLL:
    """Another of kernels/'s C++ sources (the GEMVs), built if needed and loaded once per process,
    with `declare` setting its functions' argument and result types."""
    with _LOCK:
        library = _other_libraries.get(source_file)
        if library is None:
            path = build(directory, source_file)
            try:
                library = ctypes.CDLL(str(path))
            except OSError as exc:
                raise CpuKernelBuildError(f"cannot load {path}: {exc}") from exc
            declare(library)
            _other_libraries[source_file] = library
        return library


def load(directory: Path | None = None) -> ctypes.CDLL:
    """The loaded library (built first if needed); the same handle for the whole process."""
    global _loaded
    with _LOCK:
        if _loaded is None:
            path = build(directory)
            try:
                library = ctypes.CDLL(str(path))
            except OSError as first:
                # A damaged file (the build's rename is atomic, but disks fail): rebuild it once.
                logger.warning("the CPU attention kernel %s did not load (%s); rebuilding it", path, first)
                with contextlib.suppress(OSError):
                    path.unlink()
                path = build(directory)
                try:
                    library = ctypes.CDLL(str(path))
                except OSError as exc:
                    raise CpuKernelBuildError(f"cannot load {path}: {exc}") from exc
            # (const int64_t* ints, float scale, float softcap) -> int; see the .cpp.
            library.ce_cpu_paged_attention.argtypes = [
                ctypes.POINTER(ctypes.c_int64),
                ctypes.c_float,
                ctypes.c_float,
            ]
            library.ce_cpu_paged_attention.restype = ctypes.c_int
            _loaded = library
        return _loaded
