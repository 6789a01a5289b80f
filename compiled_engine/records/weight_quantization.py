"""`WeightQuantization`: how the engine's linears hold their weights, resolved once from the options
(`EngineArgs.quantization`, `quantization_group_size`) or from a checkpoint's `quantization_config`.

A record, not code: the options module, the config, the loader and the graph passes all read it,
and it imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight-only schemes: int8 with one scale per output feature, int4 with a scale and a zero point
# per `group_size` input features of each output feature (docs/quantization.md).
WEIGHT_QUANTIZATION_SCHEMES = ("int8", "int4")
# Input features per int4 scale the kernels run (torch's int4 CPU kernel takes these four).
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 32
# Non-persistent buffers on a linear whose checkpoint holds it quantized (compressed-tensors, read by
# model_loader/quantized_checkpoint.py): its parts in the engine's layout (kernels/weight_quantization.py).
QUANTIZED_BUFFERS = {"qweight": "ce_qweight", "scales": "ce_scales", "zeros": "ce_zeros"}


@dataclass(frozen=True)
class WeightQuantization:
    """One scheme for the model's linears; the input embedding (a gather) keeps the model dtype.

    `group_size`: int4's input features per scale (None for int8). `symmetric`: whether the zero
    point is fixed at the middle of the range (compressed-tensors checkpoints); the engine's own
    int4 quantization is asymmetric (min/max per group). `source`: "engine" (quantized at load
    from the checkpoint's float weights) or "compressed-tensors" (read quantized from the folder).
    `lm_head`: whether the engine's own scheme quantizes the LM head too (EngineArgs'
    `quantize_lm_head`; one-request decode streams it every token, and llama.cpp's Q8_0 / Q4_0
    quantize it as well); a checkpoint's LM head is quantized exactly when the checkpoint holds it
    quantized (compressed-tensors' `ignore` list), whatever this says.
    """

    scheme: str
    group_size: int | None = None
    symmetric: bool = False
    source: str = "engine"
    lm_head: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in WEIGHT_QUANTIZATION_SCHEMES:
            raise ValueError(
                f"unknown weight quantization scheme {self.scheme!r}: choose one of "
                f"{', '.join(WEIGHT_QUANTIZATION_SCHEMES)}"
            )
        if self.scheme == "int8" and self.group_size is not None:
            raise ValueError("int8 weight quantization is per output channel: it takes no group size")
        if self.scheme == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (input features "
                f"per scale), got {self.group_size!r}"
            )

    @property
    def label(self) -> str:
        """Short and unique per layout: "int8", "int4-g32" (compile-cache keys, warmup rows, recipes)."""
        base = self.scheme if self.group_size is None else f"{self.scheme}-g{self.group_size}"
        base += "-sym" if self.symmetric and self.scheme == "int4" else ""
        return base + ("-float-head" if self.source == "engine" and not self.lm_head else "")

    def quantizes_lm_head(self) -> bool:
        """Whether the quantization pass takes the LM head too (a checkpoint: when it holds it quantized)."""
        return self.lm_head or self.source != "engine"
