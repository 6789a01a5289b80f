"""Route (b): rewrite direct SDPA calls into the paged-attention op.

For models that call `scaled_dot_product_attention` themselves instead of going through
transformers' AttentionInterface (graphs/attention_interface.py, route (a), leaves no SDPA).

Each SDPA node `sdpa(q [1,Hq,T,D], k, v, attn_mask, is_causal, scale)` becomes
`paged_attention(q[0].T, k0[0].T, v0[0].T, kv_caches[i], <metadata>, scale)` where
- k0/v0 are the *un-repeated* [1, Hkv, T, D] tensors: GQA models repeat k/v up to Hq heads
  before SDPA (HF's repeat_kv: `x[:, :, None].expand(...).reshape(...)`); we walk back
  through that so the cache stores Hkv heads, as the runner allocated it;
- i is the SDPA node's order in the graph (one attention per layer, layers in order);
- the KV caches and metadata are the arguments of the `step_metadata` marker the captured
  step always calls (see graphs/step_inputs.py for why it exists);
- scale is the node's `scale` (a float, or a graph node when Dynamo made it one), else 1/sqrt(D).

The mask is assumed to be causal self-attention over each sequence, which is what a decoder
builds; the op applies that masking from the metadata, so the mask subgraph loses its last
user and DCE removes it. A model with a mask that means something else (sliding window,
prefix-LM) must use route (a), where the window is passed explicitly. SDPA calls that are
visibly not causal self-attention (no mask and is_causal=False, key length != query length,
dropout, k/v heads that don't match the cache) are left alone with a note, and
check_lowering then rejects the graph: never run silently wrong attention.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import compiled_engine.kernels  # noqa: F401  (registers torch.ops.compiled_engine.paged_attention)
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.fake_values import set_fake_value
from compiled_engine.graphs.step_inputs import STEP_METADATA_TARGETS
from compiled_engine.kernels.source_version import source_version

SDPA_TARGETS = (
    torch._C._nn.scaled_dot_product_attention,  # also torch.nn.functional.scaled_dot_product_attention
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)
PAGED_ATTENTION_TARGETS = (
    torch.ops.compiled_engine.paged_attention,
    torch.ops.compiled_engine.paged_attention.default,
)

# Why an SDPA node was left alone, kept on the node so check_lowering's error can say it.
UNLOWERED_REASON_META = "compiled_engine_unlowered_reason"

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def _sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    arguments = dict(_SDPA_DEFAULTS)
    arguments.update(zip(_SDPA_PARAMS, node.args, strict=False))  # args may stop early
    arguments.update(node.kwargs)
    return arguments


def _shape(node: Any) -> tuple | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _same_size(a: Any, b: Any) -> bool:
    # statically_known_true never adds a guard: an undecidable symbolic comparison is "no".
    return statically_known_true(a == b)


def _method_or_function(node: fx.Node, names: tuple[str, ...]) -> bool:
    if node.op == "call_method":
        return node.target in names
    if node.op == "call_function":
        return getattr(node.target, "__name__", None) in names
    return False


def _unrepeat(node: fx.Node) -> fx.Node:
    """The [B, Hkv, T, D] tensor a repeat_kv-style [B, Hkv*n, T, D] was built from, else `node`.

    Matches `x[:, :, None].expand(B, Hkv, n, T, D).reshape(B, Hkv*n, T, D)` (HF repeat_kv; also
    with unsqueeze(2) and view), and `x.repeat_interleave(n, dim=1)`: both give q head h the kv
    head h // n, the mapping the paged op uses. A plain `repeat`/`cat` tiles heads in another
    order and is deliberately not matched.
    """
    if _method_or_function(node, ("reshape", "view")):
        expanded = node.args[0]
        if not (isinstance(expanded, fx.Node) and _method_or_function(expanded, ("expand",))):
            return node
        inserted = expanded.args[0]
        if not isinstance(inserted, fx.Node):
            return node
        base = _base_of_head_group_axis(inserted)
        if base is None:
            return node
        base_shape, out_shape = _shape(base), _shape(node)
        if base_shape is None or out_shape is None or len(base_shape) != 4 or len(out_shape) != 4:
            return node
        if all(_same_size(base_shape[d], out_shape[d]) for d in (0, 2, 3)):
            return base
        return node
    if _method_or_function(node, ("repeat_interleave",)):
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if isinstance(repeats, int) and dim == 1 and isinstance(node.args[0], fx.Node):
            return node.args[0]
    return node


def _base_of_head_group_axis(node: fx.Node) -> fx.Node | None:
    """x for `x[:, :, None, :, :]` / `x[:, :, None]` / `x.unsqueeze(2)`, else None."""
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1]
        if (
            isinstance(index, tuple)
            and len(index) >= 3
            and index[0] == slice(None)
            and index[1] == slice(None)
            and index[2] is None
            and all(i == slice(None) for i in index[3:])
        ):
            return source
        return None
    if _method_or_function(node, ("unsqueeze",)):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return source if dim == 2 else None
    return None


def _find_step_metadata(graph: fx.Graph) -> fx.Node | None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in STEP_METADATA_TARGETS:
            return node
    return None


class LowerSdpa:
    name = "lower_sdpa"
    version = source_version(
        __name__, "compiled_engine.graphs.passes.fake_values", "compiled_engine.graphs.step_inputs"
    )

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        sdpa_nodes = [n for n in graph.nodes if is_sdpa(n)]
        if not sdpa_nodes:
            return PassResult(self.name, 0)
        notes: list[str] = []
        if any(n.op == "call_function" and n.target in PAGED_ATTENTION_TARGETS for n in graph.nodes):
            notes.append(
                "graph mixes paged_attention and SDPA nodes; layer order is ambiguous, SDPA left as is"
            )
            return PassResult(self.name, 0, tuple(notes))
        marker = _find_step_metadata(graph)
        if marker is None:
            notes.append("no step_metadata marker in the graph (not captured by CapturedModel?)")
            return PassResult(self.name, 0, tuple(notes))
        # step_metadata(kv_caches, slot_mapping, block_tables, seq_lens, query_start_loc) is called
        # on the step's inputs, so in the graph its arguments are a list of nodes, then four nodes.
        kv_caches, slot_mapping, block_tables, seq_lens, query_start_loc = cast(
            tuple[list[fx.Node], fx.Node, fx.Node, fx.Node, fx.Node], marker.args
        )
        if len(sdpa_nodes) != len(kv_caches):
            notes.append(
                f"{len(sdpa_nodes)} SDPA calls but {len(kv_caches)} KV caches (one per attention "
                "layer expected); SDPA left as is"
            )
            return PassResult(self.name, 0, tuple(notes))

        rewritten = 0
        for node, kv_cache in zip(sdpa_nodes, kv_caches, strict=True):
            problem = self._rewrite(
                graph, node, kv_cache, (slot_mapping, block_tables, seq_lens, query_start_loc)
            )
            if problem is None:
                rewritten += 1
            else:
                notes.append(f"{node.name}: {problem}")
                node.meta[UNLOWERED_REASON_META] = problem
        return PassResult(self.name, rewritten, tuple(notes))

    def _rewrite(
        self, graph: fx.Graph, node: fx.Node, kv_cache: fx.Node, metadata: tuple[fx.Node, ...]
    ) -> str | None:
        """Replace one SDPA node; returns why it could not, or None on success."""
        a = _sdpa_arguments(node)
        query = a["query"]
        q_shape = _shape(query)
        if q_shape is None or len(q_shape) != 4:
            return "query has no known 4-D shape"
        if not _same_size(q_shape[0], 1):
            return f"batch size {q_shape[0]}, expected 1 (all tokens flattened into one row)"
        if a["dropout_p"] not in (0, 0.0):
            return f"dropout_p={a['dropout_p']}"
        if a["is_causal"] not in (True, False):
            return f"is_causal is not a constant ({a['is_causal']})"
        if a["attn_mask"] is None and not a["is_causal"]:
            return "no mask and is_causal=False: bidirectional attention"

        cache_shape = _shape(kv_cache)
        if cache_shape is None:
            return "KV cache has no known shape"
        cache_heads = cache_shape[3]
        if not isinstance(cache_heads, int):
            # capture_model marks the caches static; without that the head check below is undecidable.
            return f"KV cache head count is symbolic ({cache_heads}); mark the caches static"
        key, value = _unrepeat(a["key"]), _unrepeat(a["value"])
        for label, tensor in (("key", key), ("value", value)):
            shape = _shape(tensor)
            if shape is None or len(shape) != 4:
                return f"{label} has no known 4-D shape"
            if not _same_size(shape[2], q_shape[2]):
                return f"{label} length {shape[2]} != query length {q_shape[2]} (not self-attention)"
            if not _same_size(shape[1], cache_heads):
                return (
                    f"{label} has {shape[1]} heads after undoing repeat_kv, but the KV cache holds "
                    f"{cache_heads}: unrecognised head repetition"
                )
            if not _same_size(shape[3], q_shape[3]):
                return f"{label} head dim {shape[3]} != query head dim {q_shape[3]}"

        scale = a["scale"]
        if scale is None:
            head_dim = q_shape[3]
            if not isinstance(head_dim, int):
                return "no scale given and the head dim is symbolic"
            scale = head_dim**-0.5

        stack_trace = node.meta.get("stack_trace")
        new_nodes = []

        def emit(op: str, target: Any, args: tuple) -> fx.Node:
            created = graph.create_node(op, target, args)
            if stack_trace is not None:
                created.meta["stack_trace"] = stack_trace
            new_nodes.append(created)
            return created

        def tokens_first(x: fx.Node) -> fx.Node:
            # [1, H, T, D] -> [T, H, D]
            return emit("call_method", "transpose", (emit("call_method", "select", (x, 0, 0)), 0, 1))

        with graph.inserting_before(node):
            out = emit(
                "call_function",
                torch.ops.compiled_engine.paged_attention.default,
                (
                    tokens_first(query),
                    tokens_first(key),
                    tokens_first(value),
                    kv_cache,
                    *metadata,
                    scale,
                    -1,
                    0.0,
                ),
            )
            # [T, Hq, D] -> [1, Hq, T, D], the layout SDPA returned.
            out = emit("call_method", "transpose", (emit("call_method", "unsqueeze", (out, 0)), 1, 2))
        for created in new_nodes:
            set_fake_value(created)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        return None
