"""Weight-only quantization: every constant-weight linear (by default the LM head too) becomes a
quantized op.

Why: one-request decode reads every weight once per token, so its speed is bytes; int8 halves
them and int4 quarters them (docs/quantization.md). Done on the graph, not the model, so the
model's modules stay transformers' own, and the quantized weights are graph constants with
recipes like any other (graphs/constant_recipes.py): a warm start rebuilds them from the model.

Rewrite, for `linear(x, W, b)` whose weight is a graph constant (`get_attr`: after
freeze_parameters, and after fuse_linears so fused q/k/v and gate/up are quantized as one):

    int8:  int8_weight_linear(x, W_q, scales, b)
    int4:  int4_weight_linear(x, W_q, scales, zeros, group_size, b)

(kernels/quantized_linear.py; kernels/weight_quantization.py has the layouts). The LM head (the
model's output embedding) is quantized like the rest unless `WeightQuantization.lm_head` is off
(EngineArgs' `quantize_lm_head`): one-request decode streams it every token (a tied head of a
151,936-token vocabulary is over a quarter of a 0.5B model's bytes). A tied input embedding keeps
its float weight: the embedding is a gather of a few rows, not a stream. Each weight is quantized
once per model: `QuantizedWeightCache` is shared by every graph Dynamo traces of it. The per-bucket
pass graphs/passes/cpu_gemv_quantized.py may later swap these ops for the C++ GEMV's.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx

from compiled_engine.graphs.calling_convention import model_source_value
from compiled_engine.graphs.constant_recipes import (
    Recipe,
    concat_recipe,
    model_recipe,
    quantized_recipe,
    recipe_of,
    record_recipe,
)
from compiled_engine.graphs.pass_manager import PassResult
from compiled_engine.graphs.passes.fake_values import fake_evaluation, set_fake_value
from compiled_engine.graphs.passes.freeze_parameters import register_constant
from compiled_engine.graphs.passes.fuse_linears import constant_tensor, linear_nodes
from compiled_engine.kernels.quantized_linear import int4_weight_linear, int8_weight_linear
from compiled_engine.kernels.source_version import source_version
from compiled_engine.kernels.weight_quantization import QuantizedWeight, quantize_weight
from compiled_engine.records.weight_quantization import QUANTIZED_BUFFERS, WeightQuantization

QUANTIZED_ATTRIBUTE_PREFIX = "quantized_"
# A frozen weight's Dynamo source: the module's source, then the parameter.
_WEIGHT_SOURCE = re.compile(r"^(L\['model'\].*)\._parameters\['weight'\]$")
# The ops this pass emits, by scheme (the C++ GEMV pass reads them back).
QUANTIZED_LINEAR_OPS = (int8_weight_linear, int4_weight_linear)


class QuantizedWeightCache:
    """Quantized copies keyed by the identity of the float weight, shared across a model's graphs.

    For a pre-quantized checkpoint (`quantization.source` not "engine"), `prequantized` finds the
    checkpoint's own integers instead: the buffers model_loader/quantized_checkpoint.py put on each
    linear (`QUANTIZED_BUFFERS`), found through the weight's recipe, rows concatenated for a fused one.
    """

    def __init__(self, quantization: WeightQuantization, model: torch.nn.Module | None = None) -> None:
        self.quantization = quantization
        self.model = model
        self._entries: dict[int, tuple[torch.Tensor, QuantizedWeight]] = {}
        self._prequantized: dict[str, tuple[QuantizedWeight, dict[str, Recipe]] | None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, weight: torch.Tensor) -> QuantizedWeight:
        found = self._entries.get(id(weight))
        if found is not None and found[0] is weight:
            return found[1]
        quantized = quantize_weight(weight, self.quantization)
        self._entries[id(weight)] = (weight, quantized)  # the weight kept alive: its id stays valid
        return quantized

    def prequantized(self, weight_recipe: Recipe | None) -> tuple[QuantizedWeight, dict[str, Recipe]] | None:
        """The checkpoint's quantized form of the weight `weight_recipe` rebuilds, and each part's
        recipe; None when any of its rows is not quantized in the checkpoint."""
        if weight_recipe is None or self.model is None:
            return None
        key = repr(weight_recipe)
        if key not in self._prequantized:
            self._prequantized[key] = self._find_prequantized(weight_recipe)
        return self._prequantized[key]

    def _find_prequantized(self, weight_recipe: Recipe) -> tuple[QuantizedWeight, dict[str, Recipe]] | None:
        assert self.model is not None
        rows = weight_recipe["parts"] if weight_recipe.get("kind") == "concat" else [weight_recipe]
        modules = []
        for row in rows:
            match = _WEIGHT_SOURCE.match(row.get("source", "")) if row.get("kind") == "model" else None
            if match is None:
                return None
            module = model_source_value(match.group(1), self.model)
            if not isinstance(getattr(module, QUANTIZED_BUFFERS["qweight"], None), torch.Tensor):
                return None
            modules.append(match.group(1))
        names = (
            ("qweight", "scales") if self.quantization.scheme == "int8" else ("qweight", "scales", "zeros")
        )
        tensors: dict[str, torch.Tensor] = {}
        recipes: dict[str, Recipe] = {}
        for name in names:
            sources = [f"{module}._buffers['{QUANTIZED_BUFFERS[name]}']" for module in modules]
            parts = [model_source_value(source, self.model) for source in sources]
            tensors[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            part_recipes = [model_recipe(source) for source in sources]
            recipes[name] = part_recipes[0] if len(part_recipes) == 1 else concat_recipe(part_recipes)
        quantized = QuantizedWeight(
            tensors["qweight"], tensors["scales"], tensors.get("zeros"), self.quantization.group_size
        )
        return quantized, recipes


def _same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    if b is None:
        return False
    return a is b or (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _fake(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


class QuantizeLinears:
    """Constant-weight linears become int8/int4 weight-only ops over quantized constants (the LM head
    too unless the scheme keeps it in the model dtype)."""

    name = "quantize_linears"
    version = source_version(
        __name__,
        "compiled_engine.graphs.constant_recipes",
        "compiled_engine.graphs.passes.fake_values",
        "compiled_engine.graphs.passes.freeze_parameters",
        "compiled_engine.graphs.passes.fuse_linears",
        "compiled_engine.kernels.quantized_linear",
        "compiled_engine.kernels.weight_quantization",
        "compiled_engine.records.weight_quantization",
    )

    def __init__(self, cache: QuantizedWeightCache, lm_head: torch.Tensor | None = None) -> None:
        self.cache = cache
        self.lm_head = lm_head

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        quantization = self.cache.quantization
        graph = gm.graph
        rewritten = 0
        notes: list[str] = []
        for node, x, weight_node, bias_node in linear_nodes(graph):
            weight = constant_tensor(gm, weight_node)
            if weight is None or weight.dim() != 2:
                notes.append(f"kept {node.name}: weight is not a 2-D graph constant")
                continue
            is_lm_head = _same_tensor(weight, self.lm_head)
            if is_lm_head and not quantization.quantizes_lm_head():
                notes.append(f"kept {node.name}: the LM head stays in {weight.dtype}")
                continue
            if bias_node is not None and constant_tensor(gm, bias_node) is None:
                notes.append(f"kept {node.name}: bias is not a graph constant")
                continue
            weight_recipe = recipe_of(gm, str(weight_node.target))
            part_recipes: dict[str, Recipe] = {}
            if quantization.source == "engine":
                quantized = self.cache.get(weight)
                if weight_recipe is not None:
                    part_recipes = {
                        part: quantized_recipe(weight_recipe, quantization, part)
                        for part in ("qweight", "scales", "zeros")
                    }
            else:
                found = self.cache.prequantized(weight_recipe)
                if found is None:
                    notes.append(f"kept {node.name}: not quantized in the {quantization.source} checkpoint")
                    continue
                quantized, part_recipes = found
            parts: dict[str, torch.Tensor] = {"qweight": quantized.qweight, "scales": quantized.scales}
            if quantized.zeros is not None:
                parts["zeros"] = quantized.zeros
            fake_mode = getattr(_fake(x), "fake_mode", None)
            with graph.inserting_before(node):
                operands = []
                for part, tensor in parts.items():
                    name = register_constant(
                        gm, f"{QUANTIZED_ATTRIBUTE_PREFIX}{weight_node.name}_{part}", tensor
                    )
                    if part in part_recipes:
                        record_recipe(gm, name, part_recipes[part])
                    attribute = graph.get_attr(name)
                    if fake_mode is not None:
                        with fake_evaluation(fake_mode):
                            attribute.meta["example_value"] = fake_mode.from_tensor(
                                tensor, static_shapes=True
                            )
                    operands.append(attribute)
                if quantized.group_size is None:
                    replacement = graph.call_function(int8_weight_linear, (x, *operands, bias_node))
                else:
                    replacement = graph.call_function(
                        int4_weight_linear, (x, *operands, quantized.group_size, bias_node)
                    )
            replacement.meta.update(node.meta)
            set_fake_value(replacement)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
            rewritten += 1
            if is_lm_head:
                notes.append(f"quantized {node.name}: the LM head, to {quantization.label}")
        notes.insert(0, f"{rewritten} linear(s) quantized to {quantization.label}")
        return PassResult(self.name, rewritten, tuple(notes))
