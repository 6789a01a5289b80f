"""How to rebuild, from the model alone, every weight a lowered graph holds as an attribute.

Why: a compiled artifact saved to disk (graphs/compile_cache.py) holds code, not weights.
Inductor lifts a graph's parameters and buffers into run-time inputs, so an artifact loaded
in a new process must be handed those tensors, in the order the graph module lists them.
A warm start has the model but no traced graph, hence no attributes: it needs a recipe
per attribute that rebuilds the tensor from the model.

Two passes create attributes, and each records its recipe in `gm.meta[RECIPES_META]` as it
goes (JSON-serialisable dicts):
- freeze_parameters: `{"kind": "model", "source": "L['model']._modules[...]..."}`, the
  Dynamo source of the weight it froze (the same object every call);
- fuse_linears: `{"kind": "concat", "parts": [recipe, ...]}` (rows concatenated), with
  `{"kind": "zero_rows", "of": recipe}` for a sibling without bias (zeros, one per row of
  that weight);
- quantize_linears: `{"kind": "quantized", "of": recipe, "scheme": ..., "group_size": ...,
  "symmetric": ..., "part": "qweight" | "scales" | "zeros"}`, one part of the weight `of`
  quantized (kernels/weight_quantization.py; deterministic, so a warm start gets the same tensors,
  each weight quantized once however many parts ask for it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from compiled_engine.graphs.calling_convention import model_source_value
from compiled_engine.kernels.source_version import source_version
from compiled_engine.kernels.weight_quantization import QuantizedWeight, quantize_weight
from compiled_engine.records.weight_quantization import WeightQuantization

RECIPES_META = "compiled_engine_constant_recipes"
CONSTANT_RECIPES_VERSION = source_version(
    __name__, "compiled_engine.graphs.calling_convention", "compiled_engine.kernels.weight_quantization"
)

Recipe = dict[str, Any]


def model_recipe(source: str) -> Recipe:
    return {"kind": "model", "source": source}


def concat_recipe(parts: list[Recipe]) -> Recipe:
    return {"kind": "concat", "parts": parts}


def zero_rows_recipe(of: Recipe) -> Recipe:
    return {"kind": "zero_rows", "of": of}


def quantized_recipe(of: Recipe, quantization: WeightQuantization, part: str) -> Recipe:
    return {
        "kind": "quantized",
        "of": of,
        "scheme": quantization.scheme,
        "group_size": quantization.group_size,
        "symmetric": quantization.symmetric,
        "part": part,
    }


def record_recipe(gm: fx.GraphModule, attribute: str, recipe: Recipe) -> None:
    gm.meta.setdefault(RECIPES_META, {})[attribute] = recipe


def recipe_of(gm: fx.GraphModule, attribute: str) -> Recipe | None:
    return gm.meta.get(RECIPES_META, {}).get(attribute)


def lifted_constant_names(gm: fx.GraphModule) -> list[str]:
    """The attribute names of `gm`'s parameters then buffers, duplicates kept.

    This is the order AOTAutograd lifts them in (aot_module_simplified: named_parameters then
    named_buffers, remove_duplicate=False), so a loaded artifact takes them first, in this order.
    """
    names = [name for name, _ in gm.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in gm.named_buffers(remove_duplicate=False)]
    return names


def lifted_constant_recipes(gm: fx.GraphModule, recipes_from: fx.GraphModule | None = None) -> list[Recipe]:
    """One recipe per lifted constant of `gm`, in lifting order.

    `recipes_from`: the graph whose passes recorded the recipes, when `gm` is a variant built
    from it (same attribute names, e.g. a per-bucket rewrite). Raises if an attribute has none:
    such a graph cannot be saved, and must not be (it would load with a missing input).
    """
    source = recipes_from if recipes_from is not None else gm
    recipes = []
    for name in lifted_constant_names(gm):
        recipe = recipe_of(source, name)
        if recipe is None:
            raise ValueError(f"graph attribute {name!r} has no recorded recipe; it cannot be rebuilt on load")
        recipes.append(recipe)
    return recipes


def build_constant(
    recipe: Recipe, model: torch.nn.Module, quantized: dict[str, QuantizedWeight] | None = None
) -> torch.Tensor:
    """The tensor `recipe` describes, made from `model`'s own weights.

    `quantized`: weights already quantized by earlier calls (keyed by the recipe without its
    part), so that the parts of one weight share one quantization."""
    kind = recipe.get("kind")
    if kind == "quantized":
        whole = {k: v for k, v in recipe.items() if k != "part"}
        key = repr(whole)
        memo = quantized if quantized is not None else {}
        if key not in memo:
            scheme = WeightQuantization(recipe["scheme"], recipe["group_size"], bool(recipe["symmetric"]))
            memo[key] = quantize_weight(build_constant(recipe["of"], model, memo), scheme)
        value = getattr(memo[key], recipe["part"])
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"a {recipe['scheme']} weight has no {recipe['part']!r} part")
        return value
    if kind == "model":
        value = model_source_value(recipe["source"], model)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"recipe source {recipe['source']!r} is not a tensor of the model")
        return value
    with torch.no_grad():
        if kind == "concat":
            return torch.cat([build_constant(part, model).detach() for part in recipe["parts"]], dim=0)
        if kind == "zero_rows":
            of = build_constant(recipe["of"], model)
            return of.new_zeros(of.shape[0])
    raise ValueError(f"unknown constant recipe kind {kind!r}")


def build_constants(recipes: list[Recipe], model: torch.nn.Module) -> list[torch.Tensor]:
    """Every recipe's tensor; equal recipes give the same tensor object (one concatenation each)."""
    built: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    out = []
    for recipe in recipes:
        key = repr(recipe)
        if key not in built:
            built[key] = build_constant(recipe, model, quantized)
        out.append(built[key])
    return out
