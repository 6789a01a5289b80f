"""The explicit key of a compile-cache entry: everything that shapes the compiled step graphs.

Why explicit: Inductor's own cache keys on the graph it is handed, which a warm start must
not have to rebuild (that is the trace we want to skip), and it does not cover a custom op's
Python fake impl (measured: stale artifacts load after changing one). So we name every input
to the graphs ourselves, as a flat dict of readable fields; its hash is the entry's key, and
on a miss the fields that differ from the nearest entry say why (`diff_fields`).

Fields (all strings, so a manifest reads and diffs as-is in JSON):
- model.*: architecture, a hash of the config (values that shape the graph), a hash of the
  weights' names, shapes and dtypes (not their values: artifacts hold no weights, see
  graphs/constant_recipes.py);
- engine.*: dtype, block size, buckets, max_num_seqs, max_num_batched_tokens, KV-cache
  layout (not its block count: that stays symbolic in the graphs, so a cache sized from free
  memory does not miss), linear fusion, attention backend, tensor-parallel rank/size (each
  rank's graphs differ: its slice of the vocabulary is a constant in them), weight quantization
  (its label: scheme and group size; the quantized weights are rebuilt by their recipes),
  pipeline stage (when pipeline-parallel: its layers and its peers' ranks);
- versions.*: python, torch, triton, transformers, and every pass / op / step version;
- device.*: kind and capability (CUDA compute capability and name; CPU instruction set).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

import torch

MANIFEST_FORMAT = "1"

Manifest = dict[str, str]


@dataclass(frozen=True)
class GraphOptions:
    """Engine options that change the compiled graphs (and nothing else the cache must know)."""

    dtype: torch.dtype
    block_size: int
    buckets: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_shape: tuple[int, ...]  # the cache layout without its block count (symbolic in graphs)
    fuse_linears: bool
    attention_backend: str
    tensor_parallel: str = "1"  # "rank/size" when sharded: each rank's graphs differ
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype; else int8 / fp8 codes
    quantization: str = "none"  # the weight quantization's label ("int8", "int4-g32"): its constants differ
    pipeline_stage: str = "1"  # a pipeline stage's label: its layers and peers are in its graphs


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def model_fields(model: torch.nn.Module) -> Manifest:
    config = getattr(model, "config", None)
    # Every value, defaults included, in a stable order; but not where the folder was read from
    # (`_name_or_path`): the same model named by a relative and an absolute path is one entry.
    config_text = ""
    if config is not None:
        values = config.to_dict()
        values.pop("_name_or_path", None)
        config_text = json.dumps(values, sort_keys=True, default=str)
    weights = sorted(
        (name, tuple(t.shape), str(t.dtype))
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers())
    )
    return {
        "model.architecture": type(model).__name__,
        "model.config_sha": _sha(config_text),
        "model.weights_sha": _sha(repr(weights)),
    }


def device_fields(device: torch.device) -> Manifest:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {
            "device.kind": "cuda",
            "device.capability": f"sm_{major}{minor} {torch.cuda.get_device_name(device)}",
        }
    # Inductor's C++ kernels are built for this instruction set (AVX512, AVX2, ...).
    capability = torch.backends.cpu.get_cpu_capability()
    return {"device.kind": device.type, "device.capability": f"{platform.machine()} {capability}"}


def build_manifest(
    model: torch.nn.Module,
    options: GraphOptions,
    device: torch.device,
    component_versions: Mapping[str, str],
) -> Manifest:
    """The manifest of `model` compiled with `options` on `device`.

    `component_versions`: name -> version of each pass, op, policy and the step builder itself
    (graphs/compiled_step.py collects them).
    """
    manifest: Manifest = {"format": MANIFEST_FORMAT}
    manifest.update(model_fields(model))
    manifest.update(
        {
            "engine.dtype": str(options.dtype),
            "engine.block_size": str(options.block_size),
            "engine.buckets": ",".join(map(str, options.buckets)),
            "engine.max_num_seqs": str(options.max_num_seqs),
            "engine.max_num_batched_tokens": str(options.max_num_batched_tokens),
            "engine.kv_cache_shape": "x".join(map(str, options.kv_cache_shape)),
            "engine.fuse_linears": str(options.fuse_linears),
            "engine.attention_backend": options.attention_backend,
            "engine.tensor_parallel": options.tensor_parallel,
            "engine.kv_cache_dtype": "auto"
            if options.kv_cache_dtype is None
            else str(options.kv_cache_dtype),
            "engine.quantization": options.quantization,
        }
    )
    if options.pipeline_stage != "1":  # only then: keys without pipeline parallelism stay as they were
        manifest["engine.pipeline_stage"] = options.pipeline_stage
    manifest.update(
        {
            "versions.python": sys.version.split()[0],
            "versions.torch": torch.__version__,
            "versions.triton": _version("triton"),
            "versions.transformers": _version("transformers"),
        }
    )
    manifest.update({f"versions.{name}": version for name, version in sorted(component_versions.items())})
    manifest.update(device_fields(device))
    return manifest


def manifest_key(manifest: Manifest) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]


def diff_fields(wanted: Manifest, other: Manifest) -> list[str]:
    """Fields whose values differ (or that only one side has), sorted."""
    return sorted(k for k in wanted.keys() | other.keys() if wanted.get(k) != other.get(k))


def nearest(wanted: Manifest, others: Sequence[Manifest]) -> tuple[Manifest, list[str]] | None:
    """The manifest among `others` with the fewest differing fields, and those fields."""
    best: tuple[Manifest, list[str]] | None = None
    for other in others:
        fields = diff_fields(wanted, other)
        if best is None or len(fields) < len(best[1]):
            best = (other, fields)
    return best
