"""A draft model's k proposals in one C++ call (kernels/cpu_draft_decoder.cpp), on the CPU.

Why: the draft of speculative decoding's `draft_model` method pays only when its k steps cost a
small part of one target step. As a compiled torch graph (worker/draft_decoder.py's `propose`)
a call cost more than a plain step of the embedded model on this machine (docs/performance.md):
launching its ~100 small kernels, gathering the slot's KV row and attending over all of it. The
.cpp runs the same maths as plain float32 loops on one OpenMP team (torch's thread count), over
the positions written only, reading the weight matrices in bfloat16 where the draft runs in it
(half the bytes, widened exactly).

`NativeDraftModel` points the kernel at a `DraftDecoder`'s tensors: its weights, rotary tables
and KV buffers (prefill stays the decoder's torch forward, which writes the same buffers). It
holds references to every tensor it points into, so none is freed under it. The library is built
at first use (kernels/cpu_attention_build.py, keyed by source, compiler and CPU).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from compiled_engine.kernels import cpu_attention_build
from compiled_engine.kernels.cpu_attention_build import CpuKernelBuildError
from compiled_engine.kernels.source_version import files_version, module_file

SOURCE = Path(__file__).with_name("cpu_draft_decoder.cpp")
CPU_DRAFT_DECODER_VERSION = files_version(
    module_file(__name__), module_file(cpu_attention_build.__name__), SOURCE
)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# The kernel's codes for its weight matrices' dtype (`weight_dtype` in the .cpp).
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MATRICES = frozenset({"qkv", "o", "gate_up", "down"})


class _Layer(ctypes.Structure):  # `Layer` in the .cpp
    _fields_ = [
        (name, _P)
        for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")
    ]


class _Model(ctypes.Structure):  # `CeDraftModel` in the .cpp
    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "hidden", "num_heads", "num_kv_heads", "head_dim", "ffn", "vocab", "num_layers", "max_len",
                "num_slots",
            )
        ],
        ("eps", ctypes.c_float),
        ("weight_dtype", _I64),
        *[(name, _P) for name in ("embed", "final_norm", "lm_head", "cos", "sin", "k_cache", "v_cache")],
        ("layers", ctypes.POINTER(_Layer)),
    ]  # fmt: skip


def _declare(library: ctypes.CDLL) -> None:
    function = library.ce_draft_propose
    function.argtypes = [
        ctypes.POINTER(_Model), _I64, _P, _I64, _I64, _I64, ctypes.c_float, _P, _P, _P, ctypes.c_int,
    ]  # fmt: skip
    function.restype = ctypes.c_int


def load(directory: Path | None = None) -> ctypes.CDLL:
    """The loaded library (built first if needed); the same handle for the whole process."""
    return cpu_attention_build.load_library(SOURCE, _declare, directory)


def available() -> bool:
    """Whether the kernel builds and loads here."""
    try:
        load()
    except CpuKernelBuildError:
        return False
    return True


def pack_matrix(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [out, in] in the kernel's layout [out / 64 rounded up, in, 64]: for each
    block of 64 outputs, each input's 64 weights side by side (zeros past `out`); a copy.

    bfloat16 blocks hold their outputs in the order 0, 16, 1, 17, ..., 15, 31, then 32, 48, ...:
    the kernel widens each 32-bit word's two halves into outputs j and j + 16 (`load_block` in
    the .cpp)."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // 64)
    padded = weight.new_zeros(blocks * 64, in_features)
    padded[:out_features] = weight
    packed = padded.view(blocks, 64, in_features).transpose(1, 2)  # [blocks, in, 64]
    if weight.dtype == torch.bfloat16:
        # [.., half of the block, 16 j, 2 (j, j + 16)]: the little-endian word's low half first.
        packed = packed.reshape(blocks, in_features, 2, 2, 16).transpose(3, 4)
    return packed.contiguous().view(blocks, in_features, 64)


class NativeDraftModel:
    """The kernel's view of one draft: pointers into tensors it keeps alive.

    Every tensor must be contiguous and on the CPU. The weight matrices (embed, lm_head and each
    layer's qkv, o, gate_up, down: [out, in], packed here) share one dtype of `WEIGHT_DTYPES`; the
    rest is float32. The caches are [layers, slots, max_len, kv heads, head_dim], the rotary
    tables [max_len, head_dim].
    """

    def __init__(
        self,
        *,
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        layers: Sequence[dict[str, torch.Tensor | None]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        eps: float,
        ffn: int,
    ) -> None:
        self._library = load()
        kept: list[torch.Tensor] = []
        weight_dtype = embed.dtype
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"the native draft decoder reads float32 or bfloat16 weights, got {weight_dtype}"
            )

        def pointer(
            tensor: torch.Tensor | None, dtype: torch.dtype = torch.float32, packed: bool = False
        ) -> int | None:
            if tensor is None:
                return None
            if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(
                    f"the native draft decoder reads contiguous {dtype} CPU tensors here, got "
                    f"{tensor.dtype} on {tensor.device} (contiguous: {tensor.is_contiguous()})"
                )
            if packed:
                tensor = pack_matrix(tensor)
            kept.append(tensor)
            return tensor.data_ptr()

        num_layers, num_slots, max_len, num_kv_heads, head_dim = k_cache.shape
        if v_cache.shape != k_cache.shape or len(layers) != num_layers:
            raise ValueError("the draft's caches and layers disagree in shape")
        vocab, hidden = embed.shape
        layer_array = (_Layer * num_layers)(
            *[
                _Layer(
                    **{
                        name: pointer(t, weight_dtype, packed=True) if name in _MATRICES else pointer(t)
                        for name, t in layer.items()
                    }
                )
                for layer in layers
            ]
        )
        self._model = _Model(
            hidden=hidden,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            ffn=ffn,
            vocab=vocab,
            num_layers=num_layers,
            max_len=max_len,
            num_slots=num_slots,
            eps=eps,
            weight_dtype=WEIGHT_DTYPES[weight_dtype],
            embed=pointer(embed, weight_dtype),
            final_norm=pointer(final_norm),
            lm_head=pointer(lm_head, weight_dtype, packed=True),
            cos=pointer(cos),
            sin=pointer(sin),
            k_cache=pointer(k_cache),
            v_cache=pointer(v_cache),
            layers=layer_array,
        )
        self._layer_array = layer_array
        self._kept: list[Any] = kept
        self.weight_dtype = weight_dtype
        self.vocab_size = vocab
        self.max_len = max_len
        self.num_slots = num_slots

    def propose(
        self,
        slot: int,
        tokens: Sequence[int],
        first_position: int,
        num_proposals: int,
        temperature: float,
        noise: torch.Tensor | None,
        want_probs: bool,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Feed `tokens` at positions first_position.. of `slot`, then make `num_proposals`
        proposals: argmaxes for temperature 0, else the race against `noise` ([num_proposals,
        vocab] Exp(1) draws, float32). With `want_probs`, also each step's q = softmax(logits / T)
        (T = 1 for argmaxes) as [num_proposals, vocab]."""
        sampled = temperature > 0
        if sampled:
            if noise is None or noise.dtype != torch.float32 or not noise.is_contiguous():
                raise ValueError("sampled proposals need contiguous float32 noise")
            if noise.numel() != num_proposals * self.vocab_size:
                raise ValueError(
                    f"noise holds {noise.numel()} draws, not {num_proposals} x {self.vocab_size}"
                )
        token_array = (ctypes.c_int64 * len(tokens))(*tokens)
        proposals = (ctypes.c_int64 * num_proposals)()
        probs = torch.empty(num_proposals, self.vocab_size) if want_probs else None
        status = self._library.ce_draft_propose(
            ctypes.byref(self._model),
            slot,
            token_array,
            len(tokens),
            first_position,
            num_proposals,
            float(temperature) if sampled else 0.0,
            noise.data_ptr() if sampled and noise is not None else None,
            proposals,
            probs.data_ptr() if probs is not None else None,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"draft proposal arguments out of range: slot {slot} of {self.num_slots}, "
                f"{len(tokens)} token(s) from position {first_position}, {num_proposals} proposal(s), "
                f"slot length {self.max_len}, vocabulary {self.vocab_size}"
            )
        return list(proposals), probs
