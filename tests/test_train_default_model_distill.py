"""scripts/train_default_model.py's distillation loss (`--distill-from`, the draft recipe): forward
KL from the teacher's next-token distribution, checked against the formula written out by hand,
zero against itself, and a loss that moves a student toward its teacher; the agreement metric."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_default_model.py"


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def tiny(seed: int, hidden: int = 32) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        # Untied: a random tied model's argmax is mostly its input token (the embedding's dot
        # product with itself), so two random tied models would agree by construction.
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))


def test_the_loss_is_forward_kl_from_the_teacher(trainer, windows):
    student, teacher = tiny(0, 16), tiny(1)
    loss = trainer.windows_loss(student, windows, bf16=False, teacher=teacher)
    with torch.no_grad():
        p = F.softmax(teacher(input_ids=windows[:, :-1]).logits.reshape(-1, 64), dim=-1)
        log_q = F.log_softmax(student(input_ids=windows[:, :-1]).logits.reshape(-1, 64), dim=-1)
    by_hand = (p * (p.log() - log_q)).sum(-1).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert loss.item() > 0
    assert trainer.windows_loss(teacher, windows, bf16=False, teacher=teacher).abs().item() < 1e-6
    # Without a teacher: cross-entropy against the text's next tokens, as before.
    ce = trainer.windows_loss(student, windows, bf16=False)
    logits = student(input_ids=windows[:, :-1]).logits.reshape(-1, 64)
    assert ce.item() == pytest.approx(F.cross_entropy(logits, windows[:, 1:].reshape(-1)).item(), rel=1e-5)


def test_minimising_it_moves_the_student_to_the_teachers_choices(trainer, windows):
    student, teacher = tiny(0, 16).train(), tiny(1)
    before = trainer.teacher_agreement(student, teacher, windows, batch=2, bf16=False)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = trainer.windows_loss(student, windows, bf16=False, teacher=teacher)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = trainer.teacher_agreement(student, teacher, windows, batch=2, bf16=False)
    assert loss.item() < 0.5 * first
    assert after > before and after > 0.5


def test_agreement_is_one_with_itself_and_a_fraction_with_another_model(trainer, windows):
    teacher = tiny(1)
    assert trainer.teacher_agreement(teacher, teacher, windows, batch=2, bf16=False) == 1.0
    assert trainer.teacher_agreement(tiny(2), teacher, windows, batch=2, bf16=False) < 0.5
