"""The draft model's own tight decode loop (speculative decoding's `draft_model` method).

A draft is worth running only when k of its steps cost a small fraction of one target step. A
draft step through a `ModelRunner` (scheduler records, staging, paged KV, the graph wrapper)
costs nearly a target step when the target is small and its step overhead-bound (the embedded
model on a CPU). So the draft runs here instead, as plain tensor math on its weights:

- a contiguous KV buffer of its own, one row ("slot") per request, `max_len` positions long;
- `prefill`: an eager forward over a catch-up chunk (the prompt, the first time), writing k/v
  (in bfloat16 for a bfloat16 draft where the CPU multiplies it natively);
- `propose`: ONE call that feeds a request's last two tokens and then runs k one-token steps
  back to back, choosing each proposal inside it: the argmax (greedy) or a draw from
  q = softmax(logits / temperature) by the exponential race (argmax of q / E with E ~ Exp(1), the
  noise passed in), and returns the steps' q for sampled proposals: the verifier's min(1, p/q)
  rule needs it (worker/spec_verifier.py). On the CPU that call is C++
  (kernels/cpu_draft_decoder.cpp: plain loops over the positions written, no kernel launches)
  wherever its library builds; elsewhere, or with `native=False`, it is the torch function
  `_propose_eager`, compiled by Inductor (fixed shapes) unless `compiled=False`.

Llama-family only (Llama, Mistral, Qwen2's q/k/v biases, Qwen3's q/k norms): `supports` says
whether a loaded model is one; engine/draft_model.py falls back to the runner-driven proposer
for others. Rotary tables come from the model's own rotary module (any static rope scaling).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from compiled_engine.kernels import cpu_draft_decoder, cpu_gemv

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def supports(model: PreTrainedModel, max_len: int) -> bool:
    """Whether this decoder can run `model` for sequences of up to `max_len` tokens."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    windowed = (
        window is not None and window > 0 and getattr(config, "use_sliding_window", True) and window < max_len
    )
    return (
        config.model_type in SUPPORTED_MODEL_TYPES
        and getattr(config, "hidden_act", "silu") == "silu"
        and not windowed
    )


class _Layer(NamedTuple):
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


class _LayerWeights(NamedTuple):
    """What the decoder layers read besides the caches, in the dtype they compute in (the
    decoder's own for its forward; `prefill_dtype` for a prefill)."""

    embed: torch.Tensor
    layers: list[_Layer]
    cos: torch.Tensor
    sin: torch.Tensor


class DraftDecoder:
    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        max_len: int,
        num_proposals: int,
        device: torch.device,
        compiled: bool,
        native: bool | None = None,
        prefill_dtype: torch.dtype | None = None,
    ) -> None:
        """`native`: propose with the C++ loop (True), the torch function (False), or the C++
        loop wherever it runs (None: a CPU device and a library that builds). `prefill_dtype`:
        what `prefill` computes in; None: bfloat16 for a bfloat16 draft on a CPU that multiplies
        it natively (AVX-512 BF16), else the decoder's own dtype."""
        config = model.config
        # float32 on the CPU (the draft is small; its one-token steps are float32 loops in the
        # C++ call, and only a prefill's matmuls gain from bfloat16, below); the model's dtype on
        # accelerators.
        dtype = torch.float32 if device.type == "cpu" else next(model.parameters()).dtype
        self.device, self.dtype = device, dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.num_proposals = num_proposals
        self.max_len = max_len

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        body = model.model
        self.embed = w(body.embed_tokens.weight)
        self.norm = w(body.norm.weight)
        self.lm_head = w(model.lm_head.weight)
        self.layers: list[_Layer] = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            self.layers.append(
                _Layer(
                    input_norm=w(layer.input_layernorm.weight),
                    qkv=w(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                    qkv_bias=w(torch.cat(biases)) if all(b is not None for b in biases) else None,
                    q_norm=w(attn.q_norm.weight) if hasattr(attn, "q_norm") else None,
                    k_norm=w(attn.k_norm.weight) if hasattr(attn, "k_norm") else None,
                    o=w(attn.o_proj.weight),
                    post_norm=w(layer.post_attention_layernorm.weight),
                    gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    down=w(mlp.down_proj.weight),
                )
            )
        # cos/sin for every position, from the model's own rotary module.
        positions = torch.arange(max_len, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = body.rotary_emb.to(device)(probe, positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)  # [max_len, head_dim]
        shape = (len(self.layers), num_slots, max_len, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self._greedy_noise = torch.ones(1, num_proposals, self.embed.shape[0], device=device)
        model_dtype = next(model.parameters()).dtype
        if prefill_dtype is None:
            # A bfloat16 draft's prefill (a whole prompt: its rows' matmuls and attention) in
            # bfloat16 where the CPU multiplies it natively (bench/draft_propose.py times both;
            # docs/speculative_decoding.md). Its k/v land in the caches the one-token steps
            # read, in their dtype; the proposals' maths is unchanged.
            native_bf16 = device.type == "cpu" and cpu_gemv.best_isa() >= cpu_gemv.ISA_AVX512_BF16
            prefill_dtype = torch.bfloat16 if model_dtype == torch.bfloat16 and native_bf16 else dtype
        self.prefill_dtype = prefill_dtype
        self._prefill_weights = _LayerWeights(
            self.embed.to(prefill_dtype),
            [_Layer._make(t if t is None else t.to(prefill_dtype) for t in layer) for layer in self.layers],
            self.cos.to(prefill_dtype),
            self.sin.to(prefill_dtype),
        )
        if native is None:
            native = device.type == "cpu" and cpu_draft_decoder.available()
        # The C++ loop reads the matrices in bfloat16 when the model is in it: the float32 copies
        # above hold exactly its values, in twice the bytes.
        self.native = (
            self._native_model(model_dtype if model_dtype == torch.bfloat16 else torch.float32)
            if native
            else None
        )
        self._propose = (
            torch.compile(self._propose_eager, fullgraph=True, dynamic=False)
            if compiled and self.native is None
            else self._propose_eager
        )

    def _native_model(self, weight_dtype: torch.dtype) -> cpu_draft_decoder.NativeDraftModel:
        """The C++ loop's view of this decoder's weights (the matrices in `weight_dtype`) and
        buffers (CPU only)."""
        if self.device.type != "cpu":
            raise ValueError(f"the native draft decoder runs on the CPU, not {self.device}")

        def matrix(t: torch.Tensor) -> torch.Tensor:
            return t.to(weight_dtype).contiguous()

        layers = [
            {
                **layer._asdict(),
                "qkv": matrix(layer.qkv),
                "o": matrix(layer.o),
                "gate_up": matrix(layer.gate_up),
                "down": matrix(layer.down),
            }
            for layer in self.layers
        ]
        return cpu_draft_decoder.NativeDraftModel(
            embed=matrix(self.embed),
            final_norm=self.norm,
            lm_head=matrix(self.lm_head),
            layers=layers,
            cos=self.cos.contiguous(),
            sin=self.sin.contiguous(),
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            num_heads=self.num_heads,
            eps=self.eps,
            ffn=self.layers[0].gate_up.shape[0] // 2,
        )

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    # --- the two entry points ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: torch.Tensor, start: int) -> None:
        """Write k/v of `token_ids` (1-D) at positions start.. of `slot` (eager: a catch-up chunk)."""
        tokens = token_ids.to(self.device)[None]
        positions = torch.arange(start, start + len(token_ids), device=self.device)[None]
        slots = torch.tensor([slot], device=self.device)
        # Eager: attend over the positions up to the chunk's last only, not the whole slot. No
        # logits: the proposal call feeds the last tokens again.
        self._layers(
            tokens,
            positions,
            slots,
            self.k_cache,
            self.v_cache,
            self._prefill_weights,
            start + len(token_ids),
        )

    @torch.inference_mode()
    def propose(
        self,
        slot: int,
        last_two: tuple[int, int],
        position: int,
        temperature: float,
        noise: torch.Tensor | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Feed `last_two` (the sequence's last two tokens; the second at `position`; twice the
        only one at position 0 for a one-token sequence), then k one-token steps. Returns the k
        proposals and, for T > 0, the distribution each was drawn from [k, vocab]
        (softmax(logits / T)); for T = 0 the proposals are the argmaxes and no q is returned."""
        first = max(position - 1, 0)
        if self.native is not None:
            fed = last_two if position > 0 else last_two[1:]
            sampled = temperature > 0
            return self.native.propose(
                slot,
                fed,
                first,
                self.num_proposals,
                temperature,
                noise[0] if sampled and noise is not None else None,
                want_probs=sampled,
            )
        tokens = torch.tensor([last_two], device=self.device)
        positions = torch.tensor([[first, position]], device=self.device)
        slots = torch.tensor([slot], device=self.device)
        temp = torch.tensor([temperature], device=self.device, dtype=torch.float32)
        drafts, probs = self._propose(
            tokens,
            positions,
            slots,
            temp,
            self._greedy_noise if noise is None else noise,
            self.k_cache,
            self.v_cache,
        )
        return drafts[0].tolist(), probs[0] if temperature > 0 else None

    # --- the math ----------------------------------------------------------------------------------

    def _propose_eager(
        self,
        tokens: torch.Tensor,  # [B, 2]
        positions: torch.Tensor,  # [B, 2]
        slots: torch.Tensor,  # [B]
        temperature: torch.Tensor,  # [B] float32; 0: greedy
        noise: torch.Tensor,  # [B, k, vocab] Exp(1) draws (ones for greedy rows)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._forward(tokens, positions, slots, k_cache, v_cache)
        position = positions[:, -1]
        sampled = temperature > 0
        scale = torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]
        drafts, dists = [], []
        for i in range(self.num_proposals):
            q = torch.softmax(logits.float() / scale, dim=-1)
            token = torch.where(sampled, (q / noise[:, i]).argmax(-1), logits.argmax(-1))
            drafts.append(token)
            dists.append(q)
            if i + 1 < self.num_proposals:  # the last proposal is never fed: no k/v to write
                logits = self._forward(token[:, None], (position + 1 + i)[:, None], slots, k_cache, v_cache)
        return torch.stack(drafts, dim=1), torch.stack(dists, dim=1)

    def _forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        slots: torch.Tensor,  # [B]
        k_cache: torch.Tensor,  # [layers, slots, max_len, kv heads, head_dim]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The draft's forward over T new tokens per row, writing their k/v; the last position's
        logits [B, vocab]. Attention reads all of each slot (the compiled call's fixed shape)."""
        weights = _LayerWeights(self.embed, self.layers, self.cos, self.sin)
        x = self._layers(tokens, positions, slots, k_cache, v_cache, weights)
        last = _rms_norm(x[:, -1], self.norm, self.eps)
        return F.linear(last, self.lm_head)

    def _layers(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        slots: torch.Tensor,  # [B]
        k_cache: torch.Tensor,  # [layers, slots, max_len, kv heads, head_dim]
        v_cache: torch.Tensor,
        weights: _LayerWeights,
        num_keys: int | None = None,
    ) -> torch.Tensor:
        """The decoder layers over T new tokens per row, in `weights`' dtype, writing their k/v
        into the caches (in theirs); the hidden states [B, T, hidden]. Attention reads a slot's
        first `num_keys` positions (all of it when None); none of them may be past it."""
        b, t = tokens.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(tokens, weights.embed)  # [B, T, H]
        cos, sin = weights.cos[positions][:, :, None], weights.sin[positions][:, :, None]  # [B, T, 1, hd]
        rows = slots[:, None].expand(b, t)
        # Key j is visible to the query at position p when j <= p (the row's own earlier tokens).
        num_keys = num_keys or self.max_len
        # A chunk from position 0 (a new prompt's prefill) sees exactly its own earlier tokens:
        # its own k/v through SDPA's causal mode, which skips the masked half, instead of the
        # cache's copy under a mask it must read for every score.
        causal = num_keys == t
        mask = None
        if not causal:
            visible = torch.arange(num_keys, device=tokens.device) <= positions[:, :, None]  # [B, T, M]
            mask = visible[:, None]  # [B, 1, T, M]
        for index, layer in enumerate(weights.layers):
            h = _rms_norm(x, layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k, v = q.view(b, t, nh, hd), k.view(b, t, nkv, hd), v.view(b, t, nkv, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = _rms_norm(q, layer.q_norm, self.eps), _rms_norm(k, layer.k_norm, self.eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k_cache[index].index_put_((rows, positions), k.to(k_cache.dtype))
            v_cache[index].index_put_((rows, positions), v.to(v_cache.dtype))
            if causal:
                keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, nkv, T, hd]
            else:
                keys = k_cache[index][slots, :num_keys].transpose(1, 2).to(q.dtype)  # [B, nkv, M, hd]
                values = v_cache[index][slots, :num_keys].transpose(1, 2).to(q.dtype)
            # GQA: query head h reads kv head h // (nh // nkv).
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            attn = attn.transpose(1, 2).reshape(b, t, nh * hd)
            x = x + F.linear(attn, layer.o)
            h = _rms_norm(x, layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
