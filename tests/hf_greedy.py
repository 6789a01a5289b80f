"""Hugging Face's own greedy tokens for a few fixed prompts: the reference for backend engine tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 12], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
MAX_TOKENS = 6


def hf_greedy_tokens(model_dir: str) -> list[list[int]]:
    """MAX_TOKENS greedy tokens per prompt from transformers' `generate`, fp32, one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
