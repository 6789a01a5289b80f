"""`compiled-engine` command line: `generate --model DIR "prompt" ...`, `warmup --model DIR ...` and
`serve --model DIR` (OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import logging
import sys

from compiled_engine.entrypoints.openai.serve_args import add_serve_args


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options that pick the model and shape the engine (and so its compiled graphs)."""
    parser.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: the embedded code model)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--buckets",
        type=_int_list,
        default=None,
        help="comma-separated token-count buckets to compile (default: the engine's own list)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="compile cache (default: $COMPILED_ENGINE_CACHE_DIR, else ~/.cache/compiled_engine)",
    )
    parser.add_argument(
        "--no-fuse-linears", action="store_true", help="keep q/k/v and gate/up as separate GEMMs"
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full (default: reuse cached KV blocks of shared prefixes)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "triton", "flashinfer"],
        help="paged-attention kernels (default auto: triton on CUDA when installed, else torch; "
        "on CPU the cpu kernel when a C++ compiler builds it, else torch)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over this many ranks (this process plus worker processes)",
    )
    parser.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default="auto",
        help="prepare the next step while the current one runs (auto: on for CUDA, off for CPU)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation for each prompt")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument(
        "--logprobs", type=int, default=None, help="also print each token's logprob and the N likeliest"
    )
    gen.add_argument(
        "--enforce-eager", action="store_true", help="skip Inductor: run the lowered graph eagerly"
    )
    _add_engine_args(gen)
    warm = sub.add_parser(
        "warmup",
        help="compile every bucket into the compile cache, so later starts with these options are warm",
    )
    _add_engine_args(warm)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_serve_args(serve)
    _add_engine_args(serve)
    return parser


def _llm(args: argparse.Namespace, **extra):
    from compiled_engine import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        device=args.device,
        compile_buckets=args.buckets,
        cache_dir=args.cache_dir,
        fuse_linears=not args.no_fuse_linears,
        attention_backend=args.attention_backend,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        **extra,
    )


def _warmup(args: argparse.Namespace) -> int:
    from compiled_engine.entrypoints.warmup import format_table, warm_up_buckets

    llm = _llm(args)
    runner = llm.engine.core.runner
    rows = warm_up_buckets(runner.step_graph)
    print(f"compile cache entry: {runner.step_graph.cache_entry.dir}")
    print(format_table(rows))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from compiled_engine import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        n=args.n,
        logprobs=args.logprobs,
    )
    llm = _llm(args, enforce_eager=args.enforce_eager)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        for completion in out.outputs:
            print(out.prompt + completion.text)
            for token_id, entry in zip(completion.token_ids, completion.logprobs or (), strict=False):
                alternatives = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for lp in entry.values())
                print(f"  {entry[token_id].decoded_token!r}: {entry[token_id].logprob:.3f}  [{alternatives}]")
            if len(args.prompts) > 1 or len(out.outputs) > 1:
                print("-" * 40)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from compiled_engine.entrypoints.openai.api_server import run_server

    return run_server(args, build_engine=lambda: _llm(args, enforce_eager=args.enforce_eager).engine)


def main(argv: list[str] | None = None) -> int:
    from compiled_engine.errors import UnsupportedModelError
    from compiled_engine.kernels.backends import AttentionBackendUnavailableError

    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    try:
        return {"generate": _generate, "warmup": _warmup, "serve": _serve}[args.command](args)
    except (ValueError, UnsupportedModelError, AttentionBackendUnavailableError) as exc:
        # Errors users can fix (bad folder, bad parameter) print one clear line, no traceback.
        print(f"compiled-engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
