"""distill/responses.py: the policy's distillation answers are generated once per policy, prompts and
generation settings, then read from the cache; a damaged or foreign file is regenerated with one warning."""

import json
import logging

import pytest
import torch

from codraft.config import DraftTrainConfig
from codraft.distill import responses
from tests.drafts.blocks import tiny_policy

PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    calls = []
    real = responses.generate_responses

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(responses, "generate_responses", counting)
    return calls


def test_a_second_call_reads_the_cache_and_other_settings_miss_it(cache):
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    first = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert responses.policy_responses(policy, PROMPTS, dt, seed=0) == first and len(cache) == 1
    responses.policy_responses(policy, PROMPTS, DraftTrainConfig(max_new_tokens=6, generate_batch_size=2,
                                                                  temperature=0.0), seed=0)
    responses.policy_responses(policy, PROMPTS[:2], dt, seed=0)
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)  # another policy (an RL step moved it)
    responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert len(cache) == 4
    policy.inference_dtype = torch.bfloat16  # its answers come from bf16 matmuls (model.inference_dtype)
    responses.policy_responses(policy, PROMPTS, dt, seed=0)
    policy.inference_dtype = None
    assert len(cache) == 5
    responses.policy_responses(policy, PROMPTS, DraftTrainConfig(max_new_tokens=6, generate_batch_size=2,
                                                                  cache_responses=False), seed=0)
    assert len(cache) == 6


@pytest.mark.parametrize("damage", ["truncate", "other_key", "wrong_count"])
def test_a_damaged_or_foreign_file_is_regenerated_with_one_warning(cache, caplog, damage):
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    first = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    path = responses.cache_file(responses.responses_key(policy, PROMPTS, dt, 0))
    saved = json.loads(path.read_text())
    if damage == "truncate":
        path.write_text(path.read_text()[:20])
    elif damage == "other_key":
        path.write_text(json.dumps({**saved, "key": {**saved["key"], "format": -1}}))
    else:
        path.write_text(json.dumps({**saved, "responses": saved["responses"][:1]}))
    with caplog.at_level(logging.WARNING):
        again = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert again == first and len(cache) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "generating them again" in warnings[0].getMessage()
    assert responses.policy_responses(policy, PROMPTS, dt, seed=0) == first and len(cache) == 2  # rewritten


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_answers(cache, caplog, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(responses, "write_cached", full_disk)
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    with caplog.at_level(logging.WARNING):
        answers = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert len(answers) == len(PROMPTS) and len(cache) == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "could not cache" in warning and "No space left" in warning
