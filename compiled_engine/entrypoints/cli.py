"""`compiled-engine` command line: `generate --model DIR "prompt" ...`, `warmup --model DIR ...` and
`serve --model DIR` (OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from compiled_engine.engine_args import EngineArgs, ServerArgs


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation for each prompt")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    # Not `seed`: that name is the engine's option (EngineArgs.seed, `--engine-seed`).
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        dest="sampling_seed",
        metavar="SEED",
        help="per-request sampling seed",
    )
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument(
        "--logprobs", type=int, default=None, help="also print each token's logprob and the N likeliest"
    )
    EngineArgs.add_cli_args(gen)
    _add_verbose(gen)
    warm = sub.add_parser(
        "warmup",
        help="compile every bucket into the compile cache, so later starts with these options are warm",
    )
    # Warm-up fills the compile cache: an eager engine has nothing to compile, and it builds every
    # graph itself, in this process (no background compiler).
    EngineArgs.add_cli_args(warm, skip={"enforce_eager", "compile_policy"})
    _add_verbose(warm)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    ServerArgs.add_cli_args(serve)
    _add_verbose(serve)
    return parser


def _warmup(args: argparse.Namespace) -> int:
    from compiled_engine.entrypoints.llm import LLM
    from compiled_engine.entrypoints.warmup import format_table, warm_up_buckets

    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), compile_policy="blocking")
    llm = LLM.from_engine_args(engine_args)
    engine = llm.generation_engine("warmup")
    runner = engine.model_runner
    config = engine.config
    weights = config.quantization.label if config.quantization else str(config.dtype).removeprefix("torch.")
    rows = warm_up_buckets(runner.step_graph, kv_cache_dtype=config.kv_cache_dtype, weights=weights)
    cache_entry = runner.step_graph.cache_entry
    if cache_entry is None:  # only an eager engine has none, and warm-up builds a compiled one
        raise RuntimeError("warm-up built an engine without a compile cache entry")
    print(f"compile cache entry: {cache_entry.dir}")
    print(format_table(rows))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from compiled_engine.entrypoints.llm import LLM
    from compiled_engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sampling_seed,
        n=args.n,
        logprobs=args.logprobs,
    )
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        assert out.prompt is not None  # the prompts are command-line strings, never token ids
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

    return run_server(ServerArgs.from_cli_args(args))


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
