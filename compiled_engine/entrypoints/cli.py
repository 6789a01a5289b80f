"""`compiled-engine` command line: `compiled-engine generate --model DIR "prompt" ...`."""

from __future__ import annotations

import argparse
import logging
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation for each prompt")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: the embedded code model)"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument(
        "--enforce-eager", action="store_true", help="skip Inductor: run the lowered graph eagerly"
    )
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from compiled_engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        device=args.device,
        enforce_eager=args.enforce_eager,
    )
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        print(out.prompt + out.outputs[0].text)
        if len(args.prompts) > 1:
            print("-" * 40)
    return 0


def main(argv: list[str] | None = None) -> int:
    from compiled_engine.errors import UnsupportedModelError

    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    try:
        return _generate(args)
    except (ValueError, UnsupportedModelError) as exc:
        # Errors users can fix (bad folder, bad parameter) print one clear line, no traceback.
        print(f"compiled-engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
