"""Greedy output on the real SmolLM2-135M equals transformers' greedy generate, plain and speculative."""

import pytest
import torch

from codraft.commands.common import encode_prompt
from codraft.models import load_model
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
