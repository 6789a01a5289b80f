"""Load a Hugging Face model folder: build the model on the meta device, then fill it from safetensors.

No random init (the model is built with no storage at all), no pickle, no network. The steps:
  1. read and check config.json, pick the transformers causal-LM class for its model_type;
  2. build that class under `torch.device("meta")` in the target dtype;
  3. give every non-persistent buffer (rotary `inv_freq`, embedding scales, ...) real storage and
     recompute it with the model's own `initialize_weights` — the route transformers' loader takes,
     checked so that a buffer the model does not recompute is an error, not silent garbage;
  4. map every checkpoint tensor name to the model tensor it fills with transformers' own checkpoint
     key conversion for the architecture (checkpoint_keys.py: the renamings and converters
     `from_pretrained` applies, since `save_pretrained` may write original names, e.g. one tensor
     per MoE expert), refusing names that map to nothing;
  5. read each tensor from model.safetensors or the shards of model.safetensors.index.json straight
     onto `device` (converted groups through transformers' converter), cast it, and assign it in
     place of the meta parameter — tied parameters (lm_head sharing the embedding) get one tensor
     under every name;
  6. check that nothing is left on meta and freeze every parameter.
With `tensor_parallel=(rank, world_size)`, step 5 reads only the slice of each tensor that rank
holds (compiled_engine/distributed/layout.py), straight from the file. With `keep` (a pipeline
stage's `holds_tensor`: distributed/pipeline_stages.py), steps 5-6 read and check only the model
tensors `keep` names; the others stay on meta, for the caller to drop with their modules.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import safetensors
import torch
import transformers
from safetensors import safe_open
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_MAPPING,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from compiled_engine.distributed.layout import VOCAB_EMBEDDING, TensorParallelLayout
from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.model_loader.checkpoint_keys import CheckpointKeyPlan, plan_checkpoint_keys
from compiled_engine.model_loader.model_config import SUPPORTED_DTYPES, ModelConfig, config_dtype
from compiled_engine.model_loader.quantized_checkpoint import QuantizedCheckpoint, checkpoint_quantization

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Older checkpoints stored the rotary table per layer; it is recomputed now, so such entries are ignored.
_ALWAYS_IGNORED_UNEXPECTED = ("*rotary_emb.inv_freq",)
_NAMES_SHOWN = 5


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel  # eval mode, every parameter requires_grad=False
    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None  # None when the folder has no tokenizer files
    tensor_parallel: TensorParallelLayout | None = None  # this rank's slices, when sharded
    # The checkpoint tensors read from the files (not just listed from their headers).
    checkpoint_tensors_read: frozenset[str] = frozenset()


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    tensor_parallel: tuple[int, int] | None = None,
    body_only: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> LoadedModel:
    """Load the causal LM in `model_dir` in `dtype` ("auto" | "float32" | "bfloat16" | "float16").

    `tensor_parallel=(rank, world_size)`: load only that rank's slice of every sharded weight.
    `body_only`: load the model's body without a head (AutoModel's class: `Qwen3Model`,
    `BertModel`), as embedding models (compiled_engine/pooling/) run it.
    `keep`: which model tensors (by name) to fill; the rest are never read and stay on meta (a
    pipeline stage's other layers). Tied names count as one: filled if `keep` names any of them.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist or is not a directory")
    device = torch.device(device)
    hf_config = _read_config(model_dir)
    model_class = _body_class(hf_config, model_dir) if body_only else _causal_lm_class(hf_config, model_dir)
    target_dtype = _resolve_dtype(dtype, hf_config, model_dir)
    shards = _find_weight_files(model_dir)
    quantization = checkpoint_quantization(
        getattr(hf_config, "quantization_config", None), model_dir / "config.json"
    )
    model_config = ModelConfig.from_hf(
        hf_config,
        model_dir / "generation_config.json",
        architecture=model_class.__name__,
        dtype=target_dtype,
        quantization=quantization,
    )

    model = _build_on_meta(model_class, hf_config, target_dtype, model_dir, body_only)
    layout = TensorParallelLayout.for_model(model, *tensor_parallel) if tensor_parallel else None
    _materialise_non_persistent_buffers(model, device, model_dir)
    where = _checkpoint_names(shards)
    quantized = None
    if quantization is not None:
        # The quantized linears' tensors are read apart (model_loader/quantized_checkpoint.py); the
        # plain path fills their `weight`s with the dequantized values.
        quantized = QuantizedCheckpoint.read(where, quantization, target_dtype)
        compressed = QuantizedCheckpoint.compressed_names(where)
        where = {name: path for name, path in where.items() if name not in compressed}
    plan = plan_checkpoint_keys(model, where)
    _check_unmatched(plan, model, model_dir)
    kept = _kept_names(model, keep)
    if kept is not None:
        plan = _only_targets(plan, kept)
    tensors, read = _read_tensors(where, plan, model, device, layout)
    if quantized is not None:
        tensors.update(quantized.dequantized)
    _assign_weights(model, tensors, target_dtype, model_dir, layout, kept)
    _check_nothing_on_meta(model, model_dir, kept)
    if quantized is not None:
        quantized.attach(model)
    if layout is not None:
        for path, style in layout.communicating_modules:
            if style == VOCAB_EMBEDDING:
                # Ids are shifted into this rank's rows by the graph; padding_idx (a training
                # detail) would name a row of the whole table.
                # torch annotates Module.__setattr__ for tensors and modules only, though it sets
                # any attribute.
                model.get_submodule(path).padding_idx = None  # type: ignore[assignment]
    model.eval()
    return LoadedModel(
        model=model,
        model_config=model_config,
        tokenizer=_load_tokenizer(model_dir),
        tensor_parallel=layout,
        checkpoint_tensors_read=frozenset(read),
    )


def _names(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    return ", ".join(names[:_NAMES_SHOWN]) + more


# -- config -----------------------------------------------------------------------------------------


def _read_config(model_dir: Path):
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"no config.json in {model_dir}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{path} has no model_type (got {model_type!r}); cannot tell which architecture")
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"model_type {model_type!r} in {path} is not an architecture transformers "
            f"{transformers.__version__} knows"
        )
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a valid {model_type} config: {exc}") from exc


def _causal_lm_class(hf_config, model_dir: Path) -> type[PreTrainedModel]:
    # The class comes from the model_type, as in AutoModelForCausalLM (classes registered with
    # AutoModelForCausalLM.register included).
    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(
            f"model_type {hf_config.model_type!r} in {model_dir / 'config.json'} has no causal-LM "
            f"class in transformers {transformers.__version__}"
        )
    # transformers annotates every lazy auto mapping's values as the tokenizer mapping's (slow, fast)
    # pair; this model mapping holds one class per config.
    model_class = cast("type[PreTrainedModel]", MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)])
    # Any other architecture name transformers lacks means custom code we will not run
    # (no trust_remote_code), not something to load silently as model_class.
    for name in getattr(hf_config, "architectures", None) or ():
        if name != model_class.__name__ and not hasattr(transformers, name):
            raise UnsupportedModelError(
                f"architecture {name!r} in {model_dir / 'config.json'} is not a class transformers "
                f"{transformers.__version__} provides"
            )
    return model_class


def _body_class(hf_config, model_dir: Path) -> type[PreTrainedModel]:
    # AutoModel's class for the model_type: the body whose last hidden states a pooler reads.
    if type(hf_config) not in MODEL_MAPPING:
        raise UnsupportedModelError(
            f"model_type {hf_config.model_type!r} in {model_dir / 'config.json'} has no base-model "
            f"class in transformers {transformers.__version__}"
        )
    return cast("type[PreTrainedModel]", MODEL_MAPPING[type(hf_config)])


def _resolve_dtype(dtype: str, hf_config, model_dir: Path) -> torch.dtype:
    if dtype == "auto":
        return config_dtype(hf_config)
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(
            f"dtype {dtype!r} is not supported for {model_dir}; "
            f"use 'auto' or one of {sorted(SUPPORTED_DTYPES)}"
        )
    return SUPPORTED_DTYPES[dtype]


# -- model skeleton ---------------------------------------------------------------------------------


def _build_on_meta(
    model_class, hf_config, dtype: torch.dtype, model_dir: Path, body_only: bool = False
) -> PreTrainedModel:
    auto_class = AutoModel if body_only else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = auto_class.from_config(hf_config, dtype=dtype)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        raise UnsupportedModelError(
            f"{model_class.__name__} from {model_dir} cannot be built on the meta device: {exc}"
        ) from exc
    return model


def _owned_non_persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str]]:
    for module_name, module in model.named_modules():
        for buffer_name in sorted(module._non_persistent_buffers_set):
            if module._buffers.get(buffer_name) is not None:
                yield module, buffer_name, f"{module_name}.{buffer_name}" if module_name else buffer_name


def _owned_buffer(module: torch.nn.Module, buffer_name: str) -> torch.Tensor:
    buffer = module._buffers[buffer_name]
    # _owned_non_persistent_buffers yields only set buffers, and only tensors replace them.
    assert buffer is not None, f"buffer {buffer_name!r} was removed"
    return buffer


def _materialise_non_persistent_buffers(
    model: PreTrainedModel, device: torch.device, model_dir: Path
) -> None:
    owned = list(_owned_non_persistent_buffers(model))

    def fill_and_recompute(fill_value: int) -> list[torch.Tensor]:
        for module, buffer_name, _ in owned:
            meta_buffer = _owned_buffer(module, buffer_name)
            module._buffers[buffer_name] = torch.full_like(meta_buffer, fill_value, device=device)
        # The model's own initialiser is what recomputes these in transformers' from_pretrained, run
        # over every module as there (a parent may fill its children's buffers: FalconH1's MuP
        # vector). Parameters are still on meta here, so whatever it does to them costs nothing.
        for module in model.modules():
            # It marks each module it ran on and then skips it: clear the mark to run it again.
            module.__dict__.pop("_is_hf_initialized", None)
        model.initialize_weights()
        return [_owned_buffer(module, buffer_name).clone() for module, buffer_name, _ in owned]

    try:
        after_zeros = fill_and_recompute(0)
        after_ones = fill_and_recompute(1)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, KeyError) as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} from {model_dir}: recomputing its non-persistent buffers failed: {exc}"
        ) from exc
    # A buffer that still shows the fill value was never written: it would hold garbage.
    unwritten = [
        name
        for (_, _, name), a, b in zip(owned, after_zeros, after_ones, strict=True)
        if not torch.equal(a, b)
    ]
    if unwritten:
        raise UnsupportedModelError(
            f"{type(model).__name__} from {model_dir}: the model's initialiser does not recompute "
            f"buffer(s) {_names(unwritten)}"
        )


# -- weights ----------------------------------------------------------------------------------------


def _find_weight_files(model_dir: Path) -> dict[Path, frozenset[str] | None]:
    """Each safetensors file to read, with the tensor names the index promises it holds (if any)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{index_path} is not valid JSON: {exc}") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index_path} has no weight_map of tensor name -> shard file")
        names_by_shard: dict[Path, set[str]] = {}
        for tensor_name, shard in weight_map.items():
            names_by_shard.setdefault(model_dir / shard, set()).add(tensor_name)
        absent = [path.name for path in names_by_shard if not path.is_file()]
        if absent:
            raise ModelLoadError(
                f"shard(s) {_names(absent)} listed in {index_path} are missing from {model_dir}"
            )
        return {path: frozenset(names) for path, names in names_by_shard.items()}

    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {single: None}
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    hint = f"; found {', '.join(pickled)} (pickle checkpoints are not loaded)" if pickled else ""
    raise ModelLoadError(
        f"no safetensors weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}"
    )


def _checkpoint_names(shards: dict[Path, frozenset[str] | None]) -> dict[str, Path]:
    """Every tensor name in the weight files, with the file that holds it."""
    where: dict[str, Path] = {}
    for path, promised in shards.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as reader:
                names = set(reader.keys())
        except (safetensors.SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
        if promised is not None and not promised <= names:
            raise ModelLoadError(
                f"{path} lacks tensor(s) {_names(promised - names)} that {INDEX_FILE} places in it"
            )
        for name in sorted(names):
            if name in where:
                raise ModelLoadError(f"tensor {name} appears in more than one shard (again in {path})")
            where[name] = path
    return where


def _check_unmatched(plan: CheckpointKeyPlan, model: PreTrainedModel, model_dir: Path) -> None:
    unexpected = [name for name in plan.unmatched if not _matches(name, _ignored_unexpected(model))]
    if unexpected:
        raise ModelLoadError(
            f"weights in {model_dir} hold tensor(s) {type(model).__name__} does not have: "
            f"{_names(unexpected)}"
        )


def _kept_names(model: PreTrainedModel, keep: Callable[[str], bool] | None) -> set[str] | None:
    """The model tensor names to fill (None: all): those `keep` names, and every name tied to one."""
    if keep is None:
        return None
    tie_groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tie_groups.setdefault(id(param), []).append(name)
    kept = {name for group in tie_groups.values() if any(map(keep, group)) for name in group}
    param_names = _param_names(tie_groups)
    kept.update(name for name in model.state_dict() if name not in param_names and keep(name))
    return kept


def _only_targets(plan: CheckpointKeyPlan, kept: set[str]) -> CheckpointKeyPlan:
    """The plan, reading only what fills `kept` model tensors (a converted group by its first
    target: transformers groups the tensors of one module, e.g. one layer's experts)."""
    return dataclasses.replace(
        plan,
        renamed={target: name for target, name in plan.renamed.items() if target in kept},
        converted=tuple(group for group in plan.converted if group.first_target in kept),
    )


def _read_tensors(
    where: dict[str, Path],
    plan: CheckpointKeyPlan,
    model: PreTrainedModel,
    device: torch.device,
    layout: TensorParallelLayout | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Model name -> tensor, read from the files (renamed and converted as the plan says), and the
    checkpoint names read. A file none of whose tensors the plan wants is not opened."""
    wanted_by_file: dict[Path, set[str]] = {}
    for name in plan.checkpoint_names_read:
        wanted_by_file.setdefault(where[name], set()).add(name)
    to_convert = plan.checkpoint_names_read - set(plan.renamed.values())
    target_of = {checkpoint: target for target, checkpoint in plan.renamed.items()}

    model_names = model.state_dict().keys()
    tensors: dict[str, torch.Tensor] = {}
    convert_inputs: dict[str, torch.Tensor] = {}
    read: list[str] = []
    for path, wanted in wanted_by_file.items():
        try:
            with safe_open(path, framework="pt", device=str(device)) as reader:
                for name in sorted(wanted):
                    read.append(name)
                    if name in to_convert:
                        # A converter needs whole tensors; the rank's slice is cut from its output.
                        convert_inputs[name] = reader.get_tensor(name)
                    else:
                        tensors[target_of[name]] = _read_tensor(reader, name, target_of[name], layout)
        except (safetensors.SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc

    for group in plan.converted:
        sources = [name for name, _ in group.sources]
        try:
            produced = group.convert(convert_inputs, model)
        except Exception as exc:  # transformers' conversion ops raise whatever torch raises
            raise ModelLoadError(
                f"tensor(s) {_names(sources)} in {where[sources[0]].parent} could not be converted to "
                f"{group.first_target} with transformers' checkpoint conversion: {exc}"
            ) from exc
        for target, value in produced.items():
            if target not in model_names:
                raise ModelLoadError(
                    f"weights in {where[sources[0]].parent} hold tensor(s) {_names(sources)} that convert "
                    f"to {target}, which {type(model).__name__} does not have"
                )
            if target in tensors:
                raise ModelLoadError(
                    f"weights in {where[sources[0]].parent} fill {target} twice (once from {_names(sources)})"
                )
            tensors[target] = _slice_in_memory(value, target, layout)
    return tensors, read


def _read_tensor(reader, name: str, target: str, layout: TensorParallelLayout | None) -> torch.Tensor:
    """Checkpoint tensor `name`, which fills model tensor `target`; only this rank's slice of it."""
    if layout is None:
        return reader.get_tensor(name)
    tensor_slice = reader.get_slice(name)
    full_shape = tuple(tensor_slice.get_shape())
    shard = layout.shard(target, full_shape)
    if shard is None:
        return reader.get_tensor(name)
    # Only the rank's rows (or columns) are read from the file.
    return tensor_slice[shard.index(len(full_shape))]


def _slice_in_memory(value: torch.Tensor, target: str, layout: TensorParallelLayout | None) -> torch.Tensor:
    shard = layout.shard(target, tuple(value.shape)) if layout is not None else None
    return value if shard is None else value[shard.index(value.ndim)].contiguous()


def _fp32_patterns(model: PreTrainedModel, dtype: torch.dtype) -> list[str]:
    # Some architectures name modules that must stay in fp32 when the rest is half precision
    # (transformers honours the same two class attributes).
    patterns: list[str] = []
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return patterns


def _assign_weights(
    model: PreTrainedModel,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    model_dir: Path,
    layout: TensorParallelLayout | None = None,
    kept: set[str] | None = None,
) -> None:
    """Fill the model's tensors (those in `kept`, when given) from `tensors`."""
    # Names that share one Parameter on the freshly built model are tied (lm_head -> embed_tokens).
    tie_groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if kept is None or name in kept:
            tie_groups.setdefault(id(param), []).append(name)
    all_params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    persistent_buffers = [
        name for name in model.state_dict() if name not in all_params and (kept is None or name in kept)
    ]

    missing = [group[0] for group in tie_groups.values() if not any(n in tensors for n in group)]
    missing += [name for name in persistent_buffers if name not in tensors]
    if missing:
        raise ModelLoadError(
            f"weights in {model_dir} are missing tensor(s) the model needs: {_names(missing)}"
        )

    fp32_patterns = _fp32_patterns(model, dtype)
    for group in tie_groups.values():
        present = [n for n in group if n in tensors]
        source = tensors[present[0]]
        for other in present[1:]:
            if not torch.equal(tensors[other], source):
                raise ModelLoadError(
                    f"config.json in {model_dir} ties {_names(group)}, but the weights hold different "
                    f"values for {present[0]} and {other}; set tie_word_embeddings to false"
                )
        meta_param = model.get_parameter(group[0])
        value = _cast(
            source, group[0], _expected_shape(meta_param, group[0], layout), dtype, fp32_patterns, model_dir
        )
        if layout is not None and layout.zero_on_this_rank(group[0]):
            value = torch.zeros_like(value)
        param = torch.nn.Parameter(value, requires_grad=False)
        for name in group:
            _set_parameter(model, name, param)
    for name in persistent_buffers:
        buffer = model.get_buffer(name)
        value = _cast(
            tensors[name], name, _expected_shape(buffer, name, layout), dtype, fp32_patterns, model_dir
        )
        _set_buffer(model, name, value)

    for group in tie_groups.values():
        if len({model.get_parameter(name).data_ptr() for name in group}) != 1:
            raise ModelLoadError(f"tied parameters {_names(group)} of {model_dir} do not share storage")


def _expected_shape(
    meta_tensor: torch.Tensor, name: str, layout: TensorParallelLayout | None
) -> tuple[int, ...]:
    full = tuple(meta_tensor.shape)
    shard = layout.shard(name, full) if layout is not None else None
    return full if shard is None else shard.shape(full)


def _param_names(tie_groups: dict[int, list[str]]) -> set[str]:
    return {name for group in tie_groups.values() for name in group}


def _ignored_unexpected(model: PreTrainedModel) -> tuple[str, ...]:
    declared = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return _ALWAYS_IGNORED_UNEXPECTED + tuple(f"*{pattern}*" for pattern in declared)


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _cast(
    tensor: torch.Tensor,
    name: str,
    expected_shape: tuple[int, ...],
    dtype: torch.dtype,
    fp32_patterns: list[str],
    model_dir: Path,
) -> torch.Tensor:
    if tuple(tensor.shape) != expected_shape:
        raise ModelLoadError(
            f"tensor {name} in {model_dir} has shape {tuple(tensor.shape)}, the model expects "
            f"{expected_shape} (does config.json match the weights?)"
        )
    if not tensor.is_floating_point():
        return tensor
    keep_fp32 = any(
        f".{pattern}." in f".{name}." or fnmatch.fnmatchcase(name, pattern) for pattern in fp32_patterns
    )
    return tensor.to(torch.float32 if keep_fp32 else dtype)


# Both replace the entry itself: copying into a meta tensor is impossible, and for tied names the
# same Parameter object must end up under each of them.
def _set_parameter(model: torch.nn.Module, dotted_name: str, param: torch.nn.Parameter) -> None:
    module_name, _, attr = dotted_name.rpartition(".")
    model.get_submodule(module_name)._parameters[attr] = param


def _set_buffer(model: torch.nn.Module, dotted_name: str, value: torch.Tensor) -> None:
    module_name, _, attr = dotted_name.rpartition(".")
    model.get_submodule(module_name)._buffers[attr] = value


def _check_nothing_on_meta(model: PreTrainedModel, model_dir: Path, kept: set[str] | None = None) -> None:
    on_meta = [name for name, t in model.named_parameters() if t.is_meta]
    on_meta += [name for name, t in model.named_buffers() if t.is_meta]
    if kept is not None:
        on_meta = [name for name in on_meta if name in kept]
    if on_meta:
        raise ModelLoadError(
            f"after loading {model_dir}, tensor(s) {_names(on_meta)} have no data (still on meta)"
        )


# -- tokenizer --------------------------------------------------------------------------------------


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    # Tokenizer construction can fail in many libraries' ways (tokenizers, sentencepiece, json);
    # all mean the same thing to the user: the files in this folder are broken.
    except Exception as exc:
        raise ModelLoadError(f"the tokenizer files in {model_dir} could not be loaded: {exc}") from exc
