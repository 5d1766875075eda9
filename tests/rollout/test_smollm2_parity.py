"""Greedy output on the real SmolLM2-135M equals transformers' greedy generate, plain and speculative, and with
bf16 rollout matmuls a row's greedy tokens do not depend on its batch or its forward's shape."""

import pytest
import torch

from codraft.commands.common import encode_prompt
from codraft.models import load_model
from codraft.models.cpu_kernels import cpu_kernels
from codraft.models.linear import amx
from codraft.rollout import generate
from codraft.rollout.drafters import NgramDrafter

PROMPTS = ["What is 12 + 7? Answer with the number only.", "List three colors.", "Say hello in French."]


@pytest.mark.integration
def test_greedy_matches_transformers_generate_on_smollm2(smollm2_transformers):
    hf = smollm2_transformers
    model, tokenizer = load_model("smollm2-135m")
    prompts = [encode_prompt(tokenizer, p, chat_template=True) for p in PROMPTS]
    n = 20
    plain = generate(model, prompts, temperature=0, max_new_tokens=n, stop_token_ids=[])
    spec = generate(model, prompts, drafter=NgramDrafter(), num_speculative_tokens=4, temperature=0,
                    max_new_tokens=n, stop_token_ids=[])
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        expected = ref[0, len(prompt) :].tolist()
        assert plain.tokens[i] == expected
        assert spec.tokens[i] == expected


@pytest.mark.integration
def test_bf16_rollouts_on_codraft_s_kernel_give_a_row_its_tokens_whatever_its_batch_or_forward_shape():
    """bf16 weights on codraft's kernel (activations stay fp32): a row's greedy tokens are the same alone, in a
    batch and under speculation. oneDNN's bf16 without AMX gave other tokens in 1-2 of 8-32 rows (models/linear.py)."""
    if cpu_kernels() is None or amx():
        pytest.skip("bf16 copies run on oneDNN here (no codraft kernel, or AMX)")
    model, tokenizer = load_model("smollm2-135m")
    model.inference_dtype = torch.bfloat16
    prompts = [encode_prompt(tokenizer, f"What is {a} + {b}? Think step by step.", chat_template=True)
               for a, b in [(12, 7), (48, 95), (3, 88), (150, 26), (71, 9), (64, 64), (5, 230), (19, 17)]]
    kw = dict(temperature=0, max_new_tokens=24, stop_token_ids=[])
    batch = generate(model, prompts, **kw)
    assert model.layers["0"].mlp.down_proj.packed.native
    assert batch.tokens == [generate(model, [p], **kw).tokens[0] for p in prompts]
    assert generate(model, prompts, drafter=NgramDrafter(), num_speculative_tokens=4, **kw).tokens == batch.tokens
