"""Point every paged-attention call at the attention backend the engine resolved.

Capture and every earlier pass speak one op, `compiled_engine::paged_attention` (the torch
reference). This last pass retargets those calls to the chosen backend's op — for "triton",
`compiled_engine::paged_attention_triton` (kernels/triton_attention.py) — which takes the same
arguments and returns the same thing (the contract in kernels/paged_attention.py). For "torch" it
changes nothing. The backend's version is part of the pass's version, so graphs built for one
backend never load as another's from the compile cache.
"""

from __future__ import annotations

from torch import fx

from compiled_engine.errors import UnsupportedModelError
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.kernels.source_version import source_version


def _reference_targets() -> tuple:
    import torch

    import compiled_engine.kernels  # noqa: F401  (registers the ops)

    return (torch.ops.compiled_engine.paged_attention, torch.ops.compiled_engine.paged_attention.default)


class SelectAttentionBackend:
    name = "select_attention_backend"

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.version = f"{source_version(__name__)}+{backend.name}:{backend.version}"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if self.backend.name == "torch":
            return PassResult(self.name, 0)
        targets = _reference_targets()
        retargeted = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in targets:
                # The op's 12th argument, `causal`, is only ever passed as False (an encoder body).
                if len(node.args) > 11 or node.kwargs.get("causal", True) is False:
                    raise UnsupportedModelError(
                        f"attention_backend {self.backend.name!r} attends causally only; this model's "
                        "bidirectional attention runs on attention_backend='torch'"
                    )
                node.target = self.backend.op.default
                retargeted += 1
        return PassResult(self.name, retargeted, (f"{retargeted} call(s) now run {self.backend.name}",))
