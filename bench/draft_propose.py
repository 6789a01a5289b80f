"""What one draft-model proposal call costs on its own (worker/draft_decoder.py `propose`).

    python -m bench.draft_propose DRAFT_DIR [--k 4] [--max-len 1028] [--context 200] [--calls 200]
                                            [--implementation native compiled]

Loads the draft as the engine does for a target in `--dtype` (default bfloat16, the embedded
model's), builds its proposal call, prefills a `--context`-token context into one slot and times
`propose` (the call that feeds two tokens and makes k greedy proposals, with the proposals read
back), median of `--rounds` rounds of `--calls` calls, for each implementation asked for:
`native`, the C++ loop the engine uses on the CPU (kernels/cpu_draft_decoder.cpp), and
`compiled`, the torch function under Inductor. `--max-len` is the slot's length: the engine's is
max_model_len + k (the default model's max_model_len is 1024). It also times the draft's
prefill of a `--prefill-tokens` prompt (the decoder's eager torch forward, which both
implementations share: what a request's first proposal costs on top), in the dtype the engine's
decoder picks for this CPU (bfloat16 for a bfloat16 draft where the CPU has AVX-512 BF16) and,
interleaved with it, in float32 (what it ran in before). With `--profile` it prints
torch.profiler's table of the ops one call runs. Compare with a plain decode step of the target
(bench/speculative.py's "none" column: 1 / tokens per second) to see what k proposals cost in
target steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compiled_engine.model_loader.loader import load_model
from compiled_engine.worker.draft_decoder import DraftDecoder


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=1028)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--context", type=int, default=200, help="tokens in the slot before the call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument(
        "--implementation", nargs="+", choices=("native", "compiled"), default=("native", "compiled")
    )
    args = parser.parse_args()

    device = torch.device("cpu")
    loaded = load_model(args.draft, dtype=args.dtype, device=device)
    for implementation in args.implementation:
        native = implementation == "native"
        decoder = DraftDecoder(loaded.model, 1, args.max_len, args.k, device, compiled=True, native=native)
        _time(decoder, implementation, args)
    _time_prefill(loaded.model, decoder, args)


def _time_prefill(model, decoder: DraftDecoder, args: argparse.Namespace) -> None:
    """The prefill as the engine's decoder runs it (`decoder.prefill_dtype`, chosen for this CPU)
    and, when that is not float32, in float32 too, calls interleaved."""
    decoders = {str(decoder.prefill_dtype).removeprefix("torch."): decoder}
    if decoder.prefill_dtype != torch.float32:
        decoders["float32"] = DraftDecoder(
            model,
            1,
            args.max_len,
            args.k,
            decoder.device,
            compiled=False,
            native=False,
            prefill_dtype=torch.float32,
        )
    tokens = torch.arange(args.prefill_tokens) % decoder.vocab_size
    for each in decoders.values():
        for _ in range(3):
            each.prefill(0, tokens, 0)
    per_call: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(args.rounds * 4):
        for name, each in decoders.items():
            started = time.perf_counter()
            each.prefill(0, tokens, 0)
            per_call[name].append(time.perf_counter() - started)
    for name, times in per_call.items():
        print(
            f"prefill of {args.prefill_tokens} tokens in {name}: {statistics.median(times) * 1e3:.2f} ms "
            f"(median of {len(times)}; min {min(times) * 1e3:.2f})"
        )


def _time(decoder: DraftDecoder, implementation: str, args: argparse.Namespace) -> None:
    context = args.context
    vocab = decoder.vocab_size
    decoder.prefill(0, torch.arange(context) % vocab, 0)
    last_two = (5 % vocab, 6 % vocab)
    for _ in range(5):  # compile, then settle
        decoder.propose(0, last_two, context + 1, 0.0, None)
    per_call = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.calls):
            decoder.propose(0, last_two, context + 1, 0.0, None)
        per_call.append((time.perf_counter() - started) / args.calls)
    median = statistics.median(per_call)
    print(
        f"draft {args.draft}, {implementation}: k={args.k}, slot length {args.max_len}, "
        f"{torch.get_num_threads()} threads: "
        f"propose {median * 1e3:.3f} ms per call (median of {args.rounds} x {args.calls}; "
        f"min {min(per_call) * 1e3:.3f})"
    )
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(20):
                decoder.propose(0, last_two, context + 1, 0.0, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
