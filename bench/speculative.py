"""Code-completion prompts for the speculative-decoding suite (bench/test_speculative.py).

Held-out stdlib files: the embedded model was trained on the stdlib with every 50th file (sorted)
kept out for validation (scripts/train_default_model.py, the same rule here), so its prompts are
code it has never seen. Each prompt is a window of a file's tokens ending at a line start part-way
into the file (about 60 % first): the model continues real code mid-file, as an editor's
completion would.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# scripts/train_default_model.py's split (that script imports the trainer's dependencies).
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
VALIDATION_EVERY_NTH_FILE = 50
# Where in a file a prompt window ends (fractions of its text), the first one first.
CUT_MARKS = (0.6, 0.4, 0.8, 0.5, 0.7, 0.3, 0.9)


def held_out_stdlib_files(stdlib_dir: Path | None = None) -> list[Path]:
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts))
    return [p for i, p in enumerate(paths) if i % VALIDATION_EVERY_NTH_FILE == VALIDATION_EVERY_NTH_FILE - 1]


def completion_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` prompts of `prompt_tokens` tokens, in a fixed order: each held-out file's window
    ending ~60 % in, then (for larger batches: there are only a few dozen held-out files) windows
    ending at its other marks."""
    files = [p.read_text(encoding="utf-8", errors="replace") for p in held_out_stdlib_files()]
    prompts: list[list[int]] = []
    for mark in CUT_MARKS:
        for text in files:
            cut = text.rfind("\n", 0, int(len(text) * mark)) + 1  # a line start
            ids = tokenizer.encode(text[:cut], add_special_tokens=False)
            if len(ids) >= prompt_tokens:
                prompts.append(ids[-prompt_tokens:])
                if len(prompts) == count:
                    return prompts
    raise RuntimeError(
        f"the held-out stdlib files give only {len(prompts)} prompts of {prompt_tokens} tokens"
    )


def sweep(
    batch_sizes: tuple[int, ...],
    new_tokens: int,
    prompt_tokens: int,
    rounds: int,
    k: int,
    draft: str | None = None,
) -> None:
    """tokens/s without and with n-gram speculation (no batch-size cut-off) per batch size, rounds
    alternating between the two engines in one loop: where the ratio falls below 1 is where
    `disable_by_batch_size` belongs on this machine. `draft`: a draft model's folder, measured
    instead of n-gram (the column keeps its name)."""
    import time

    from compiled_engine import LLM, SamplingParams

    largest = max(batch_sizes)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "disable_by_batch_size": largest,
    }
    if draft is not None:
        spec = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": k,
            "disable_by_batch_size": largest,
        }
    # The default max_num_seqs (256): a bucket's graph returns min(bucket, max_num_seqs) logits rows,
    # and a step with more (k + 1 per speculating request) runs on the dynamic graph instead.
    options = dict(compile_policy="blocking", enable_prefix_caching=False)
    engines = {"none": LLM(**options), "ngram": LLM(speculative_config=spec, **options)}
    prompts = completion_prompts(engines["none"].get_tokenizer(), largest, prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    print(f"batch  none tok/s  ngram tok/s  ratio  acceptance  mean accepted length  (k={k})")
    for batch in batch_sizes:
        requests = [{"prompt_token_ids": p} for p in prompts[:batch]]
        rates: dict[str, list[float]] = {"none": [], "ngram": []}
        for llm in engines.values():
            llm.generate(requests, params, use_tqdm=False)  # warm-up: this batch's buckets
        before = engines["ngram"].stats()
        for _ in range(rounds):
            for name, llm in engines.items():
                started = time.perf_counter()
                llm.generate(requests, params, use_tqdm=False)
                rates[name].append(batch * new_tokens / (time.perf_counter() - started))
        after = engines["ngram"].stats()
        drafts = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
        steps = after.num_spec_steps - before.num_spec_steps
        none, ngram = (sorted(r)[len(r) // 2] for r in rates.values())
        print(
            f"{batch:5d}  {none:11.1f}  {ngram:11.1f}  {ngram / none:5.2f}  "
            f"{accepted / max(drafts, 1):10.2f}  {(accepted + steps) / max(steps, 1):20.2f}"
        )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=sweep.__doc__)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft", default=None, help="a draft model's folder: measure it instead of n-gram")
    args = parser.parse_args()
    sweep(
        tuple(int(b) for b in args.batch_sizes.split(",")),
        args.new_tokens,
        args.prompt_tokens,
        args.rounds,
        args.k,
        args.draft,
    )
