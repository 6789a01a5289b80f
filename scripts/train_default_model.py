"""Train the small Llama that ships inside the package as its default model.

Everything is read offline from this machine: the corpus is the Python standard library's own `.py`
source (PSF licence), the tokenizer is a byte-level BPE trained on it with `tokenizers`, and the model
is a transformers `LlamaForCausalLM`, so the result is an ordinary Hugging Face folder that both our
engine and `AutoModelForCausalLM` load.

The run is seeded end to end (file order, validation split, batch offsets, initial weights), so the
documented command in docs/default-model.md reproduces the shipped weights' loss within noise.

    python scripts/train_default_model.py --steps 1200 --batch 16 --lr 3e-3 --warmup 50 --eval-every 100

Its draft for speculative decoding (docs/speculative_decoding.md) is a model a quarter of the size
with the shipped model's own tokenizer (`--tokenizer-from`: loaded, not retrained, so the two agree
on every id), trained on the shipped model's next-token distributions (`--distill-from`: forward KL
to the teacher's softmax on the same windows, instead of cross-entropy against the text): a draft
is worth what the target accepts, so it should predict the target, not the data. The validation
line then also reports top-1 agreement with the teacher on the held-out windows, a proxy for
greedy acceptance. 2,000 steps took 16 minutes on the 2-core Zen 4 machine (0.48 s a step with
bfloat16 autocast; `--fp32` was slower there, 1.04 s against 0.64 s a step in a 30-step probe):

    python scripts/train_default_model.py --tokenizer-from compiled_engine/default_model \
        --distill-from compiled_engine/default_model --out DRAFT_DIR \
        --plot docs/default-model-draft-loss.png --hidden 128 --ffn 352 --layers 2 --heads 2 \
        --kv-heads 1 --steps 2000 --batch 16 --lr 4e-3 --eval-every 250 \
        --checkpoint DRAFT_DIR.pt --max-minutes 11

`--checkpoint PATH --max-minutes M` splits a long run into chunks: a chunk saves model, optimizer
and batch-sampler state to PATH when its time is up, and rerunning the same command resumes there
(the command above ran as two chunks). Without `--distill-from` a draft learns from the text
alone: the first draft recipe (hidden 64, cross-entropy) reached a validation loss of 4.22 and an
acceptance of 0.06 in a 400-step run.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "compiled_engine" / "default_model"
DEFAULT_PLOT = REPO_ROOT / "docs" / "default-model-loss.png"

END_OF_TEXT = "<|endoftext|>"
ROLE_START = "<|im_start|>"
ROLE_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, ROLE_START, ROLE_END]  # ids 0, 1, 2 in this order

# ChatML-style: the role markers are single special tokens, so a chat turn costs few tokens and
# `<|im_end|>` can stop generation (it is listed in generation_config.json's eos ids).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Directories of the stdlib that are not ordinary library code: test suites (huge, repetitive),
# IDLE's GUI and installed third-party packages.
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
VALIDATION_EVERY_NTH_FILE = 50  # every 50th file (in sorted order) is held out: ~2 % of the corpus


@dataclass(frozen=True)
class Corpus:
    train_files: list[Path]
    val_files: list[Path]
    train_text: list[str]
    val_text: list[str]


def collect_corpus(stdlib_dir: Path) -> Corpus:
    paths = sorted(
        p for p in stdlib_dir.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(stdlib_dir).parts)
    )
    if not paths:
        raise SystemExit(f"no .py files found under {stdlib_dir}")
    train_files, val_files = [], []
    for index, path in enumerate(paths):
        held_out = index % VALIDATION_EVERY_NTH_FILE == VALIDATION_EVERY_NTH_FILE - 1
        (val_files if held_out else train_files).append(path)

    def read(files: list[Path]) -> list[str]:
        return [p.read_text(encoding="utf-8", errors="replace") for p in files]

    return Corpus(train_files, val_files, read(train_files), read(val_files))


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    # Every training document follows an <|endoftext|>, so prompts get one too: the model then sees
    # the start of a prompt exactly as it saw the start of a file.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{END_OF_TEXT} $A",
        pair=f"{END_OF_TEXT} $A {END_OF_TEXT} $B",
        special_tokens=[(END_OF_TEXT, backend.token_to_id(END_OF_TEXT))],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[ROLE_START, ROLE_END],
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, each preceded by <|endoftext|> (the document separator)."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=True)
    ids = [i for enc in encodings for i in enc.ids]
    return torch.tensor(ids, dtype=torch.long)


def build_model(
    vocab_size: int, tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace
) -> LlamaForCausalLM:
    eos = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def windows_loss(
    model: LlamaForCausalLM,
    windows: torch.Tensor,
    bf16: bool = True,
    teacher: LlamaForCausalLM | None = None,
) -> torch.Tensor:
    """Cross-entropy against the text's next tokens, or (with a teacher) forward KL from the
    teacher's next-token distribution at every position: KL(p_teacher || p_model)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=windows[:, :-1]).logits
    logits = logits.float().reshape(-1, logits.shape[-1])
    if teacher is None:
        return F.cross_entropy(logits, windows[:, 1:].reshape(-1))
    target = teacher_log_probs(teacher, windows, bf16)
    return F.kl_div(F.log_softmax(logits, dim=-1), target, log_target=True, reduction="batchmean")


@torch.no_grad()
def teacher_log_probs(teacher: LlamaForCausalLM, windows: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = teacher(input_ids=windows[:, :-1]).logits
    return F.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)


@torch.no_grad()
def teacher_agreement(
    model: LlamaForCausalLM, teacher: LlamaForCausalLM, val_windows: torch.Tensor, batch: int, bf16: bool
) -> float:
    """How often the model's argmax equals the teacher's on the validation windows: what a greedy
    draft's proposals would be accepted at, one position at a time."""
    model.eval()
    same = total = 0
    for i in range(0, len(val_windows), batch):
        inputs = val_windows[i : i + batch, :-1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ours = model(input_ids=inputs).logits.argmax(-1)
            theirs = teacher(input_ids=inputs).logits.argmax(-1)
        same += int((ours == theirs).sum())
        total += ours.numel()
    model.train()
    return same / total


@torch.no_grad()
def validation_loss(
    model: LlamaForCausalLM, val_windows: torch.Tensor, batch: int, bf16: bool = True
) -> float:
    model.eval()
    losses = [
        windows_loss(model, val_windows[i : i + batch], bf16).item()
        for i in range(0, len(val_windows), batch)
    ]
    model.train()
    return sum(losses) / len(losses)


def save_loss_plot(history: dict, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    train_label = "train, KL to the teacher (per step)" if args.distill_from else "train (per step)"
    ax.plot(history["train_steps"], history["train_loss"], lw=0.8, alpha=0.6, label=train_label)
    ax.plot(history["val_steps"], history["val_loss"], "o-", lw=1.5, label="validation (held-out files)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"{args.layers}-layer Llama (hidden {args.hidden}) on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Hugging Face folder to write")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="loss-curve PNG to write")
    parser.add_argument("--log-json", type=Path, default=None, help="optional JSON file for the loss history")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256, help="training window length in tokens")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="a model folder whose tokenizer to use instead of training one (a draft model's target)",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--distill-from",
        type=Path,
        default=None,
        help="a model folder to distil: train on its next-token distributions (a draft's target)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a file to save the run's state to when --max-minutes is up, and to resume from",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="with --checkpoint: stop after this many minutes of training and save the state",
    )
    parser.add_argument(
        "--fp32",
        action="store_true",
        help="train in float32 instead of bfloat16 autocast (CPUs without native bf16 matmuls: faster)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    corpus = collect_corpus(args.stdlib)
    if args.tokenizer_from is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_from)
    else:
        tokenizer = train_tokenizer(corpus.train_text, args.vocab)
    train_ids = token_stream(tokenizer, corpus.train_text)
    val_ids = token_stream(tokenizer, corpus.val_text)
    span = args.context + 1  # inputs plus the shifted targets
    val_windows = val_ids[: len(val_ids) // span * span].view(-1, span)
    print(
        f"corpus: {len(corpus.train_files)} train files / {len(corpus.val_files)} val files, "
        f"{sum(map(len, corpus.train_text)):,} / {sum(map(len, corpus.val_text)):,} chars, "
        f"{len(train_ids):,} / {len(val_ids):,} tokens, {len(val_windows)} val windows; "
        f"tokenizer ready after {time.perf_counter() - started:.1f} s",
        flush=True,
    )

    model = build_model(len(tokenizer), tokenizer, args)
    print(f"model: {model.num_parameters():,} parameters (tied embeddings)", flush=True)
    teacher = None
    if args.distill_from is not None:
        teacher = LlamaForCausalLM.from_pretrained(args.distill_from, dtype=torch.float32).eval()
        teacher.requires_grad_(False)
        if teacher.config.vocab_size != len(tokenizer):
            raise SystemExit(
                f"--distill-from {args.distill_from}: its vocabulary ({teacher.config.vocab_size}) is "
                f"not the tokenizer's ({len(tokenizer)}); pass its folder as --tokenizer-from too"
            )
        print(f"teacher: {args.distill_from}, {teacher.num_parameters():,} parameters", flush=True)
    if args.max_minutes is not None and args.checkpoint is None:
        raise SystemExit("--max-minutes needs --checkpoint (where the stopped run's state goes)")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    batch_rng = torch.Generator().manual_seed(args.seed)
    history: dict[str, list] = {"train_steps": [], "train_loss": [], "val_steps": [], "val_loss": []}
    if teacher is not None:
        history["val_agreement"] = []
    first_step, trained_before = 0, 0.0
    if args.checkpoint is not None and args.checkpoint.is_file():
        state = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batch_rng.set_state(state["batch_rng"])
        history, first_step, trained_before = state["history"], state["step"], state["train_seconds"]
        print(f"resumed from {args.checkpoint} at step {first_step}", flush=True)

    train_started = time.perf_counter() - trained_before
    chunk_started = time.perf_counter()
    model.train()
    for step in range(first_step, args.steps):
        if args.max_minutes is not None and time.perf_counter() - chunk_started > args.max_minutes * 60:
            assert args.checkpoint is not None
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "batch_rng": batch_rng.get_state(),
                "history": history,
                "step": step,
                "train_seconds": time.perf_counter() - train_started,
            }
            torch.save(state, args.checkpoint)
            print(
                f"stopped at step {step}/{args.steps}: state in {args.checkpoint}; rerun to resume",
                flush=True,
            )
            return
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train_ids) - span, (args.batch,), generator=batch_rng)
        windows = torch.stack([train_ids[s : s + span] for s in starts.tolist()])
        loss = windows_loss(model, windows, not args.fp32, teacher)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history["train_steps"].append(step + 1)
        history["train_loss"].append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = validation_loss(model, val_windows, args.batch, not args.fp32)
            history["val_steps"].append(step + 1)
            history["val_loss"].append(val)
            agreement = ""
            if teacher is not None:
                history["val_agreement"].append(
                    teacher_agreement(model, teacher, val_windows, args.batch, not args.fp32)
                )
                agreement = f"  agreement {history['val_agreement'][-1]:.3f}"
            elapsed = time.perf_counter() - train_started
            print(
                f"step {step + 1}/{args.steps}  train {loss.item():.3f}  val {val:.3f}{agreement}  "
                f"lr {lr_at(step, args):.2e}  {elapsed / (step + 1):.2f} s/step  {elapsed / 60:.1f} min",
                flush=True,
            )

    train_seconds = time.perf_counter() - train_started
    last = history["train_loss"][-50:]
    summary = {
        "final_train_loss_last50_mean": sum(last) / len(last),
        "final_val_loss": history["val_loss"][-1],
        **({"final_val_agreement": history["val_agreement"][-1]} if teacher is not None else {}),
        "train_seconds": train_seconds,
        "seconds_per_step": train_seconds / args.steps,
        "parameters": model.num_parameters(),
    }
    print("summary: " + json.dumps(summary), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    eos, role_end = tokenizer.convert_tokens_to_ids([END_OF_TEXT, ROLE_END])
    generation = GenerationConfig(bos_token_id=eos, eos_token_id=[eos, role_end], pad_token_id=eos)
    generation.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    save_loss_plot(history, args.plot, args)
    if args.log_json is not None:
        run_args = {k: str(v) for k, v in vars(args).items()}
        args.log_json.write_text(json.dumps({"args": run_args, **summary, **history}))
    total_minutes = (time.perf_counter() - started) / 60
    print(f"wrote {args.out} and {args.plot} after {total_minutes:.1f} min total", flush=True)


if __name__ == "__main__":
    main()
