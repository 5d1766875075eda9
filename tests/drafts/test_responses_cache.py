"""distill/responses.py: the policy's distillation answers are generated once per policy, prompts and
generation settings, chunk by chunk, then read from the cache; more prompts generate only the chunks they add,
an interrupted generation keeps its finished chunks, a damaged or foreign file is regenerated with one warning."""

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
    calls = []  # the start of each chunk generated
    real = responses.generate_chunk

    def counting(policy, prompts, dt, seed, start):
        calls.append(start)
        return real(policy, prompts, dt, seed, start)

    monkeypatch.setattr(responses, "generate_chunk", counting)
    return calls


def test_a_second_call_reads_the_cache_and_other_settings_miss_it(cache):
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    first = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert len(first) == 3 and cache == [0, 2]  # two chunks of at most 2 prompts
    assert responses.policy_responses(policy, PROMPTS, dt, seed=0) == first and len(cache) == 2
    responses.policy_responses(policy, PROMPTS, DraftTrainConfig(max_new_tokens=6, generate_batch_size=2,
                                                                  temperature=0.0), seed=0)
    assert len(cache) == 4
    responses.policy_responses(policy, PROMPTS, dt, seed=1)
    assert len(cache) == 6
    responses.policy_responses(policy, [[3, 4, 5], [6, 7, 8]], dt, seed=0)  # another first chunk
    assert len(cache) == 7
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)  # another policy (an RL step moved it)
    responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert len(cache) == 9
    policy.inference_dtype = torch.bfloat16  # its answers come from bf16 matmuls (model.inference_dtype)
    responses.policy_responses(policy, PROMPTS, dt, seed=0)
    policy.inference_dtype = None
    assert len(cache) == 11
    responses.policy_responses(policy, PROMPTS, DraftTrainConfig(max_new_tokens=6, generate_batch_size=2,
                                                                  cache_responses=False), seed=0)
    assert len(cache) == 13


def test_more_prompts_generate_only_the_chunks_they_add_and_the_same_answers(cache):
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    more = [*PROMPTS, [12, 13], [14, 15, 16]]
    fresh = responses.policy_responses(policy, more, DraftTrainConfig(max_new_tokens=6, generate_batch_size=2,
                                                                      cache_responses=False), seed=0)
    cache.clear()
    first = responses.policy_responses(policy, more[:4], dt, seed=0)
    assert cache == [0, 2] and first == fresh[:4]
    assert responses.policy_responses(policy, more, dt, seed=0) == fresh and cache == [0, 2, 4]


def test_an_interrupted_generation_keeps_its_finished_chunks(cache, monkeypatch):
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=1)
    counting = responses.generate_chunk

    def interrupted(policy, prompts, dt, seed, start):
        if start == 2:
            raise KeyboardInterrupt
        return counting(policy, prompts, dt, seed, start)

    monkeypatch.setattr(responses, "generate_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert cache == [0, 1]
    monkeypatch.setattr(responses, "generate_chunk", counting)
    whole = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert cache == [0, 1, 2] and len(whole) == 3


@pytest.mark.parametrize("damage", ["truncate", "other_key", "wrong_count"])
def test_a_damaged_or_foreign_file_is_regenerated_with_one_warning(cache, caplog, damage):
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    first = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    key = responses.chunk_key(responses.policy_key(policy, dt, 0), PROMPTS[:2], 0)
    path = responses.cache_file(key)
    saved = json.loads(path.read_text())
    if damage == "truncate":
        path.write_text(path.read_text()[:20])
    elif damage == "other_key":
        path.write_text(json.dumps({**saved, "key": {**saved["key"], "format": -1}}))
    else:
        path.write_text(json.dumps({**saved, "responses": saved["responses"][:1]}))
    with caplog.at_level(logging.WARNING):
        again = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert again == first and cache == [0, 2, 0]  # the damaged chunk only
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "generating them again" in warnings[0].getMessage()
    assert responses.policy_responses(policy, PROMPTS, dt, seed=0) == first and len(cache) == 3  # rewritten


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_answers(cache, caplog, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(responses, "write_cached", full_disk)
    policy = tiny_policy(dtype=torch.float32)
    dt = DraftTrainConfig(max_new_tokens=6, generate_batch_size=2)
    with caplog.at_level(logging.WARNING):
        answers = responses.policy_responses(policy, PROMPTS, dt, seed=0)
    assert len(answers) == len(PROMPTS) and cache == [0, 2]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "could not cache" in warning and "No space left" in warning
