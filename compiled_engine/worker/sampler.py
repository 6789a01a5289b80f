"""Turns the last-position logits of the sampling rows into next tokens, on the logits' device.

Order (vLLM's; docs/sampling.md):
  1. logit_bias added;
  2. min_tokens: stop tokens (stop_token_ids, and EOS unless ignore_eos) set to -inf while the
     request has generated fewer than min_tokens tokens;
  3. penalties: repetition (prompt and output tokens: positive logits divided by it, negative
     ones multiplied), then frequency (x count) and presence (x seen) over output tokens;
  4. greedy rows take the argmax of these logits;
  5. temperature, then min_p (drop tokens less likely than min_p x the best), top-k, top-p;
  6. a draw by inverting each row's cumulative distribution at one uniform number: token i
     when cdf[i-1] <= u * total < cdf[i], which happens with probability probs[i]. One draw per
     row (not one per vocabulary entry, as the exponential race argmax(probs / E) needs: torch's
     CPU generators make ~10x more work of a 256 x vocab Exp(1) draw than the cumsum here) lets
     a seeded request take its number from its own generator — so its tokens depend only on its
     seed and its logits, never on which other requests share the batch — while the maths
     stays one vectorised pass.
Every step is vectorised over the batch; steps 1–3 and min_p run only when some row uses them
(host-side flags, or None fields), so a plain batch pays nothing for them. Nothing is modified in
place: the caller's logits stay the raw ones, which is what logprobs are computed from.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from compiled_engine.kernels import cpu_sampler
from compiled_engine.kernels.cpu_sampler import greedy_pick, temperature_draw
from compiled_engine.sampling_params import SamplingParams

# Goes into the compile-cache key of anything that captures the sampler.
SAMPLER_VERSION = "sampler-2"


@dataclass(frozen=True, eq=False)  # eq on tensor fields would be elementwise, not a bool
class PenaltyTensors:
    """The rows with presence/frequency/repetition penalties, and every token each of them has seen."""

    rows: torch.Tensor  # [P] int64: which logits rows are penalised
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    # One entry per token occurrence: count row r < P is a prompt token of penalised row r,
    # count row P + r an output token of it.
    count_rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64


@dataclass(frozen=True, eq=False)
class TokenEntries:
    """(row, token id) pairs, with a value each for logit_bias; without, tokens to ban (min_tokens)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor | None = None  # [N] float32


@dataclass(frozen=True, eq=False)
class SamplingTensors:
    """Per-row sampling settings as device tensors, plus host-side flags that pick fast paths."""

    temperature: torch.Tensor  # [K] float32; 1.0 on greedy rows so dividing by it is harmless
    top_k: torch.Tensor  # [K] int64; -1 = no limit
    top_p: torch.Tensor  # [K] float32; 1.0 = no limit
    greedy: torch.Tensor  # [K] bool
    # Per row: the generator a seeded row draws its noise from, else None.
    generators: tuple[torch.Generator | None, ...]
    # Unseeded rows share one draw from this (None: torch's global generator).
    default_generator: torch.Generator | None
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    # The optional stages: None when no row of the step uses them.
    min_p: torch.Tensor | None = None  # [K] float32; 0.0 = no limit
    penalties: PenaltyTensors | None = None
    logit_bias: TokenEntries | None = None
    min_tokens_banned: TokenEntries | None = None

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    def select_rows(
        self, rows: torch.Tensor, generators: tuple[torch.Generator | None, ...]
    ) -> SamplingTensors:
        """These settings for other rows: row i takes row `rows[i]`'s temperature, min_p, top-k and
        top-p and the generator `generators[i]` (speculative decoding's proposal rows). Bias,
        min_tokens and penalties are not carried over: rows with them never have proposals."""
        return SamplingTensors(
            temperature=self.temperature.index_select(0, rows),
            top_k=self.top_k.index_select(0, rows),
            top_p=self.top_p.index_select(0, rows),
            greedy=self.greedy.index_select(0, rows),
            generators=generators,
            default_generator=self.default_generator,
            all_greedy=self.all_greedy,
            needs_top_k=self.needs_top_k,
            needs_top_p=self.needs_top_p,
            min_p=None if self.min_p is None else self.min_p.index_select(0, rows),
        )

    @property
    def changes_logits(self) -> bool:
        """Whether bias, min_tokens or penalties change the logits (so even greedy rows need them)."""
        return self.penalties is not None or self.logit_bias is not None or self.min_tokens_banned is not None

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        *,
        default_generator: torch.Generator | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Collection[int] = (),
    ) -> SamplingTensors:
        """From per-row params (and, for penalties and min_tokens, each row's prompt and output
        tokens so far): for tests and callers outside the runner's staged path."""
        if len(generators) != len(params_list):
            raise ValueError(
                f"need one generator (or None) per row: got {len(params_list)} params "
                f"and {len(generators)} generators"
            )
        device = torch.device(device)
        for gen in [*generators, default_generator]:
            if gen is not None and gen.device.type != device.type:
                raise ValueError(f"generator on {gen.device} cannot draw noise for logits on {device}")
        num_rows = len(params_list)
        prompts = prompt_token_ids if prompt_token_ids is not None else [()] * num_rows
        outputs = output_token_ids if output_token_ids is not None else [()] * num_rows
        rows = [
            SamplingRow(p, len(out), prompt, out, frozenset(eos_token_ids))
            for p, prompt, out in zip(params_list, prompts, outputs, strict=True)
        ]
        host = HostSamplingArrays.build(rows)

        def dev(array: np.ndarray) -> torch.Tensor:
            # Built on the host and copied once per field.
            return torch.from_numpy(array).to(device, non_blocking=True)

        penalties = None
        if host.penalty_rows.size:
            penalties = PenaltyTensors(
                rows=dev(host.penalty_rows),
                presence=dev(host.presence),
                frequency=dev(host.frequency),
                repetition=dev(host.repetition),
                count_rows=dev(host.penalty_count_rows),
                token_ids=dev(host.penalty_token_ids),
            )
        return cls(
            temperature=dev(host.temperature),
            top_k=dev(host.top_k),
            top_p=dev(host.top_p),
            greedy=dev(host.greedy),
            generators=tuple(None if g else gen for g, gen in zip(host.greedy, generators, strict=True)),
            default_generator=default_generator,
            all_greedy=host.all_greedy,
            needs_top_k=host.needs_top_k,
            needs_top_p=host.needs_top_p,
            min_p=dev(host.min_p) if host.needs_min_p else None,
            penalties=penalties,
            logit_bias=(
                TokenEntries(dev(host.bias_rows), dev(host.bias_token_ids), dev(host.bias_values))
                if host.bias_rows.size
                else None
            ),
            min_tokens_banned=(
                TokenEntries(dev(host.banned_rows), dev(host.banned_token_ids))
                if host.banned_rows.size
                else None
            ),
        )


class SamplingRow(NamedTuple):
    """What the host knows about one sampling row of a step."""

    params: SamplingParams
    # Tokens the request generated before this step, pending ones included (min_tokens).
    num_output_tokens: int = 0
    # Penalties only: the prompt, and the outputs the host knows (an output still being sampled
    # on the device is added there by the caller).
    prompt_token_ids: Sequence[int] | np.ndarray = ()  # an array: the history's cached prompt_array
    output_token_ids: Sequence[int] = ()
    # min_tokens only: the model's EOS ids, banned too unless ignore_eos.
    eos_token_ids: frozenset[int] = frozenset()


def min_tokens_stop_ids(params: SamplingParams, eos_token_ids: Collection[int]) -> tuple[int, ...]:
    """The tokens min_tokens keeps from being sampled: every token that would end the request."""
    stop = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop.update(eos_token_ids)
    return tuple(sorted(stop))


@dataclass(frozen=True, eq=False)
class HostSamplingArrays:
    """One step's sampling settings as numpy arrays, before they are copied to the device."""

    temperature: np.ndarray  # [K] float32
    top_k: np.ndarray  # [K] int64
    top_p: np.ndarray  # [K] float32
    min_p: np.ndarray  # [K] float32
    greedy: np.ndarray  # [K] bool
    penalty_rows: np.ndarray  # [P] int64
    presence: np.ndarray  # [P] float32
    frequency: np.ndarray  # [P] float32
    repetition: np.ndarray  # [P] float32
    penalty_count_rows: np.ndarray  # [N] int64 (see PenaltyTensors)
    penalty_token_ids: np.ndarray  # [N] int64
    bias_rows: np.ndarray  # [B] int64
    bias_token_ids: np.ndarray  # [B] int64
    bias_values: np.ndarray  # [B] float32
    banned_rows: np.ndarray  # [M] int64
    banned_token_ids: np.ndarray  # [M] int64
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool

    @classmethod
    def build(cls, rows: Sequence[SamplingRow]) -> HostSamplingArrays:
        params = [r.params for r in rows]
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=len(params))
        sampled = ~greedy
        # Greedy rows keep temperature 1 (dividing by it is harmless) and never force the
        # temperature-side stages (min_p, top-k, top-p), which cannot change an argmax.
        temperature = np.array([1.0 if p.greedy else p.temperature for p in params], dtype=np.float32)
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_p = np.array([p.top_p for p in params], dtype=np.float32)
        min_p = np.array([p.min_p for p in params], dtype=np.float32)

        penalty_rows = [i for i, p in enumerate(params) if p.has_penalties]
        num_penalised = len(penalty_rows)
        count_rows: list[np.ndarray] = []
        count_tokens: list[np.ndarray] = []
        for local, i in enumerate(penalty_rows):
            prompt = np.asarray(rows[i].prompt_token_ids, dtype=np.int64)
            outputs = np.asarray(rows[i].output_token_ids, dtype=np.int64)
            count_rows += [np.full(len(prompt), local), np.full(len(outputs), num_penalised + local)]
            count_tokens += [prompt, outputs]

        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, (row, p) in enumerate(zip(rows, params, strict=True)):
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_tokens += list(p.logit_bias)
                bias_values += list(p.logit_bias.values())
            if row.num_output_tokens < p.min_tokens:
                stop = min_tokens_stop_ids(p, row.eos_token_ids)
                banned_rows += [i] * len(stop)
                banned_tokens += stop

        def ints(values) -> np.ndarray:
            return np.asarray(values, dtype=np.int64).reshape(-1)

        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            greedy=greedy,
            penalty_rows=ints(penalty_rows),
            presence=np.array([params[i].presence_penalty for i in penalty_rows], dtype=np.float32),
            frequency=np.array([params[i].frequency_penalty for i in penalty_rows], dtype=np.float32),
            repetition=np.array([params[i].repetition_penalty for i in penalty_rows], dtype=np.float32),
            penalty_count_rows=ints(np.concatenate(count_rows) if count_rows else []),
            penalty_token_ids=ints(np.concatenate(count_tokens) if count_tokens else []),
            bias_rows=ints(bias_rows),
            bias_token_ids=ints(bias_tokens),
            bias_values=np.asarray(bias_values, dtype=np.float32),
            banned_rows=ints(banned_rows),
            banned_token_ids=ints(banned_tokens),
            all_greedy=bool(greedy.all()),
            needs_top_k=bool((sampled & (top_k != -1)).any()),
            needs_top_p=bool((sampled & (top_p < 1.0)).any()),
            needs_min_p=bool((sampled & (min_p > 0.0)).any()),
        )


class Sampler:
    """Stateless: every per-request setting and generator arrives in SamplingTensors."""

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != params.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows but sampling params have {params.num_rows}")
        if params.all_greedy and not params.changes_logits:
            return greedy_tokens_of(logits)

        if params.changes_logits:
            logits = process_logits(logits.float(), params)
        greedy_tokens = greedy_tokens_of(logits)
        if params.all_greedy:
            return greedy_tokens
        if draws_in_cpp(logits, params):
            # target_probs and categorical_draw in one C++ pass a row (kernels/cpu_sampler.py):
            # the same uniform numbers, the same distribution.
            uniform = uniform_noise(len(logits), logits.device, params)
            sampled_tokens = temperature_draw(logits, params.temperature, uniform)
        else:
            sampled_tokens = categorical_draw(target_probs(logits.float(), params), params)
        return torch.where(params.greedy, greedy_tokens, sampled_tokens)


def draws_in_cpp(logits: torch.Tensor, params: SamplingTensors) -> bool:
    """Whether the C++ temperature draw serves this step: CPU logits of a dtype it takes, and no
    row needing min-p, top-k or top-p (which stay torch's ops). A multi-step run asks it too
    (worker/model_runner.py `_run_on`): those runs go on in C++ only where it does."""
    plain = params.min_p is None and not params.needs_top_k and not params.needs_top_p
    return plain and cpu_sampler.serves(logits)


def greedy_tokens_of(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: the first index of each row's largest value (of its first NaN).

    On the CPU through kernels/cpu_sampler.py's C++ pick where it builds, else through
    `max(dim=-1).indices`; both return argmax's indices (ties and NaN included;
    tests/test_sampler.py, tests/test_cpu_sampler.py), in a fraction of torch's CPU argmax's time
    over bf16 logits, the kernel in a fraction of max's (bench/test_sampling.py,
    docs/performance.md).
    """
    if cpu_sampler.serves(logits):
        return greedy_pick(logits)
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def target_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Stage 5: the distribution a sampled row draws from — float32 logits (after stages 1–3)
    through temperature, min_p, top-k and top-p. Speculative decoding's verifier
    (worker/spec_verifier.py) accepts proposals against the same distribution."""
    # Subtract the row max before dividing: (x - max) / t stays <= 0, so a tiny temperature
    # sends the losers to -inf instead of overflowing to inf - inf = NaN.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature[:, None]
    if params.min_p is not None:
        # prob_i >= min_p * prob_max  <=>  scaled_i >= log(min_p), as scaled_max == 0.
        # (min_p = 0 gives log 0 = -inf: nothing is dropped.)
        scaled = scaled.masked_fill(scaled < params.min_p.log()[:, None], float("-inf"))
    if params.needs_top_k or params.needs_top_p:
        scaled = _apply_top_k_top_p(scaled, params)
    return scaled.softmax(dim=-1)


def process_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Stages 1–3 (logit_bias, min_tokens, penalties) on float32 logits, out of place."""
    if params.logit_bias is not None:
        bias = params.logit_bias
        assert bias.values is not None, "logit_bias entries carry a value each"
        logits = logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if params.min_tokens_banned is not None:
        banned = params.min_tokens_banned
        # torch.full, not new_tensor: a fill on the device, no host-to-device copy inside the step.
        minus_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
        logits = logits.index_put((banned.rows, banned.token_ids), minus_inf)
    if params.penalties is not None:
        logits = _apply_penalties(logits, params.penalties)
    return logits


def _apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """vLLM's penalties on the penalised rows only: counts are [2P, vocab], not [K, vocab]."""
    num_penalised = penalties.rows.shape[0]
    rows = logits.index_select(0, penalties.rows)
    counts = rows.new_zeros(2 * num_penalised, rows.shape[1])
    # Counts of small integers: exact in float32 whatever order the additions happen in.
    counts.index_put_(
        (penalties.count_rows, penalties.token_ids), counts.new_ones(()).expand_as(penalties.token_ids), True
    )
    output_counts = counts[num_penalised:]
    seen = (counts[:num_penalised] > 0) | (output_counts > 0)
    repetition = penalties.repetition[:, None]
    # transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the
    # penalty when positive and multiplied by it otherwise (so > 1 always makes it less likely).
    repeated = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(seen, repeated, rows)
    rows = rows - penalties.frequency[:, None] * output_counts
    rows = rows - penalties.presence[:, None] * (output_counts > 0).float()
    return logits.index_copy(0, penalties.rows, rows)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of logits rows [R, vocab]: for each row its `num_top` most likely tokens
    (ids [R, num_top], logprobs [R, num_top]), and the logprob [R] and rank [R] of `token_ids`
    (rank as vLLM counts it: tokens at least as likely, itself included, so the best is 1)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    rank = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(num_top, dim=-1)
    return top.indices, top.values, chosen.squeeze(1), rank


def _apply_top_k_top_p(scaled: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Mask everything outside each row's top-k and then its nucleus to -inf (one sort, all rows)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if params.needs_top_k:
        k = torch.where(params.top_k < 0, vocab, params.top_k.clamp(max=vocab))
        rank = torch.arange(vocab, device=scaled.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    if params.needs_top_p:
        # Nucleus over what top-k left: keep a token while the mass strictly before it is below
        # top_p. The best token has zero mass before it, so every row keeps at least one.
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # top_p == 1 rows are left alone: rounding in the cumsum could otherwise drop their tail.
        outside = (mass_before >= params.top_p[:, None]) & (params.top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def categorical_draw(weights: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Per row of `weights` [rows, vocab] (>= 0, not necessarily summing to 1), token i with
    probability weights[i] / sum, from one uniform number per row (`uniform_noise`)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = uniform_noise(len(weights), weights.device, params)[:, None] * total
    # The first entry whose cdf exceeds the target: its weight is > 0, as the cdf rose there.
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total itself: no entry exceeds it, so take the likeliest (argmax,
    # through greedy_tokens_of: on the CPU torch's argmax took most of the draw's time).
    return torch.where(tokens < weights.shape[-1], tokens, greedy_tokens_of(weights))


def uniform_noise(num_rows: int, device: torch.device, params: SamplingTensors) -> torch.Tensor:
    """One U[0, 1) draw per row, from the row's own generator where it has one."""
    noise = torch.rand(num_rows, device=device, generator=params.default_generator)
    for row, gen in enumerate(params.generators):
        if gen is not None:
            noise[row] = torch.rand((), device=device, generator=gen)
    return noise
