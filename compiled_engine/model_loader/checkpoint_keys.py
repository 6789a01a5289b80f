"""Which model tensor each checkpoint tensor becomes, decided by transformers' own key conversion.

`save_pretrained` writes some architectures in their original checkpoint layout rather than in module
names: one tensor per MoE expert where the module holds one stacked tensor, an older prefix, a
`gamma` where the module says `weight`. `from_pretrained` undoes that with the conversion mapping
transformers registers for the architecture (`conversion_mapping.get_model_conversion_mapping`):
renamings, and converters that merge, split or reshape tensors. This module asks transformers for
that same list and renames every checkpoint key with transformers' own `rename_source_key`, so the
loader fills exactly the parameters `from_pretrained` would; it re-implements none of the tables.

The result is a plan, decided from the names alone before any tensor is read:
- `renamed`: one checkpoint tensor fills one model tensor (most keys; the name may be unchanged);
- `converted`: groups of checkpoint tensors that a transformers converter turns into model tensors;
- `unmatched`: checkpoint tensors the model has no place for.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)


@dataclass(frozen=True)
class ConvertedGroup:
    """Checkpoint tensors one transformers converter turns into model tensors (e.g. experts stacked)."""

    first_target: str  # the model name transformers files the group under
    sources: tuple[tuple[str, str], ...]  # (checkpoint name, the converter's source pattern it matched)
    converter: WeightConverter  # an unused prototype; `convert` runs on a copy

    def convert(self, tensors: Mapping[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """Run transformers' converter over the group's tensors: model name -> tensor."""
        converter = copy.deepcopy(self.converter)
        for checkpoint_name, pattern in self.sources:
            # transformers annotates the value as a Future (its loader's), but materialises plain
            # tensors as well.
            tensor = tensors[checkpoint_name]
            converter.add_tensor(self.first_target, checkpoint_name, pattern, tensor)  # type: ignore[arg-type]
        produced = converter.convert(self.first_target, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in produced.items()}


@dataclass(frozen=True)
class CheckpointKeyPlan:
    renamed: dict[str, str]  # model name -> the checkpoint name that fills it
    converted: tuple[ConvertedGroup, ...]
    unmatched: tuple[str, ...]  # checkpoint names that map to no model tensor (after renaming)

    @property
    def checkpoint_names_read(self) -> set[str]:
        names = set(self.renamed.values())
        for group in self.converted:
            names.update(name for name, _ in group.sources)
        return names


def plan_checkpoint_keys(model: PreTrainedModel, checkpoint_names: Iterable[str]) -> CheckpointKeyPlan:
    """Decide, as `from_pretrained` would, which model tensor each checkpoint name becomes.

    `model` may be on the meta device: only its names, classes and config are read.
    """
    # The same list from_pretrained builds (legacy renamings such as LayerNorm.gamma included).
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    model_names = model.state_dict()
    prefix = model.base_model_prefix

    renamed: dict[str, str] = {}
    groups: dict[str, list[tuple[str, str]]] = {}
    group_converter: dict[str, WeightConverter] = {}
    unmatched: list[str] = []
    # Sorted as transformers sorts them: some renamings decide from the first key they see.
    for name in sorted(checkpoint_names, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, prefix, model_names)
        if target not in model_names and name in model_names:
            # A key already in module form that a pattern still caught: taken as it is (transformers
            # does the same), only the base-model prefix may be added or removed.
            target, pattern = rename_source_key(name, [], [], prefix, model_names)
        if target not in model_names:
            unmatched.append(name)
        elif pattern is None:
            if target in renamed:
                unmatched.append(name)  # a second tensor for the same place: reported, not loaded
            else:
                renamed[target] = name
        else:
            groups.setdefault(target, []).append((name, pattern))
            group_converter.setdefault(target, by_pattern[pattern])

    converted = tuple(
        ConvertedGroup(first_target=target, sources=tuple(sources), converter=group_converter[target])
        for target, sources in groups.items()
    )
    return CheckpointKeyPlan(renamed=renamed, converted=converted, unmatched=tuple(unmatched))
