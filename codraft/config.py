"""Typed config: a tree of dataclasses with defaults, loaded from YAML and overridden by ``key.sub=value``.

Adding a section is adding a dataclass field to ``Config``. Every leaf is type-checked from its
annotation (int, float, bool, str, ``Literal[...]``, ``X | None``, ``list[X]``) and each section
may define ``validate()`` for range checks. User errors are one-line ``ConfigError``s that name
the dotted key and what would be valid.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml


class ConfigError(ValueError):
    """A user error in the config: one line, naming the key and what is valid."""


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    """Range check for ``validate()`` hooks: ``config key 'k' must be <rule> (got v)``."""
    if not ok:
        raise ConfigError(f"config key '{key}' must be {rule} (got {value!r})")


@dataclass
class RunConfig:
    dir: str | None = None  # None: runs/<command>-<timestamp>, resolved by prepare_run_dir
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tensorboard: bool = True
    # keep: freed host memory stays in the process for reuse, so a step's large tensors do not fault their pages
    # in anew; release: handed back to the OS after each train or draft-train step (a distillation's steps, of
    # varying shapes, grew resident memory 30-40 MB a step; 10 under release), resident memory is what is in use
    host_memory: Literal["keep", "release"] = "keep"


# the draft families (drafts/: one module each, registered for export under these names): the one list that
# every config key, command and message naming a family reads
DRAFT_FAMILIES = ("eagle3", "dflash", "dspark")
DraftLoss = Literal["soft_ce", "hard_ce", "tv"]
# how a sampled call judges a chain of drafts (rollout/verify.py): each prefix as a whole, or each draft on its own
Verification = Literal["block", "token"]

# the names of models/presets.py (the one place they are built), here so the config can check them at load
# without importing the model package
MODEL_PRESETS = ("smollm2-135m", "tiny-llama", "tiny-qwen3")


@dataclass
class ModelConfig:
    path: str = "smollm2-135m"  # a preset name, an HF checkpoint dir or a .gguf file
    ref_path: str | None = None  # rl.beta > 0: the frozen reference (same forms as path); None = the initial policy
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # the dtype of the policy's rollout matmuls on CPU (packed copies; weights, training, attention and the logits
    # stay in model.dtype): auto = bfloat16 where bf16 copies give a row the same logits whatever the forward's shape:
    # with AMX (oneDNN, bf16 activations; decode steps ~0.7x fp32's time) or on codraft's AVX-512 kernels (with
    # AVX-512 BF16 bf16 activations, else bf16 weights over fp32 activations; attention on the kernel too), else
    # float32: oneDNN on AVX-512 BF16 without AMX
    # rounds a row by its forward's shape and greedy speculation then differs from plain decoding at near-ties
    # (models/linear.py); bfloat16 = bf16 anyway
    inference_dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def validate(self) -> None:
        _check_model_path("model.path", self.path)
        if self.ref_path is not None:
            _check_model_path("model.ref_path", self.ref_path)


def _check_model_path(key: str, value: str) -> None:
    path = Path(value).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"{key}: '{value}' is a directory without config.json, not a Hugging Face "
                          "checkpoint directory")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"{key}: '{value}' is a file but not a .gguf model")
    if path.exists():
        return
    if value not in MODEL_PRESETS:
        raise ConfigError(f"{key}: {value!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
                          "nor an existing file or directory")


@dataclass
class GenerateConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    num_speculative_tokens: int = 4
    drafter: Literal[("none", "ngram", *DRAFT_FAMILIES)] = "none"
    adaptive: bool = True  # adapt the number of speculative tokens to the acceptance rate
    verification: Verification = "block"  # sampled calls; both rules are lossless (rollout/verify.py)
    batch_size: int = 8
    chat_template: bool = True
    prompt: str | None = None  # one prompt; or
    prompts_file: str | None = None  # JSONL with a "prompt" field per line
    draft_path: str | None = None  # exported draft directory, for learned drafters

    def validate(self) -> None:
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ConfigError(f"generate.prompts_file: '{self.prompts_file}' is not a file")
        if self.drafter in ("eagle3", "dflash", "dspark") and self.draft_path is None:
            raise ConfigError(
                f"generate.draft_path is required for generate.drafter={self.drafter} "
                "(an exported draft directory, e.g. from `codraft draft-train`)"
            )
        require(self.max_new_tokens >= 1, "generate.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.temperature >= 0, "generate.temperature", ">= 0", self.temperature)
        require(0 < self.top_p <= 1, "generate.top_p", "in (0, 1]", self.top_p)
        require(self.top_k >= 0, "generate.top_k", ">= 0 (0 = off)", self.top_k)
        require(
            self.num_speculative_tokens >= 0, "generate.num_speculative_tokens", ">= 0", self.num_speculative_tokens
        )
        require(self.batch_size >= 1, "generate.batch_size", ">= 1", self.batch_size)


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    pp_schedule: Literal["1F1B", "GPipe"] = "1F1B"
    pp_microbatches: int = 0  # groups of whole sequences per pipeline step; 0 = 2 * pp
    tap_transport: Literal["auto", "shm", "pg", "host_staging"] = "auto"  # TapChannel; host_staging: blocking baseline
    timeout_s: float = 120.0  # bound of every wait on another rank (group setup, collectives, TapChannel)

    def validate(self) -> None:
        for name in ("dp", "pp", "cp"):
            require(getattr(self, name) >= 1, f"parallel.{name}", ">= 1", getattr(self, name))
        require(self.pp_microbatches >= 0, "parallel.pp_microbatches", ">= 0 (0 = 2 * pp)", self.pp_microbatches)
        require(self.timeout_s > 0, "parallel.timeout_s", "> 0 (seconds)", self.timeout_s)



@dataclass
class DraftConfig:
    family: Literal[(*DRAFT_FAMILIES, "none")] = "eagle3"
    loss: DraftLoss = "soft_ce"  # DSpark mixes ce_weight * CE(loss) + tv_weight * TV
    tap_layers: list[int] | None = None  # None = the family's default placement
    # EAGLE-3
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    draft_vocab_size: int = 8192  # most frequent tokens (0 = all): EAGLE-3's head, DFlash/DSpark's drafted ones
    head_from_policy: bool = False  # a fresh draft's norm + head start as the policy's (its draft-vocab rows)
    # fc then passes the highest tap through and the layer's attention reads it as the policy layer would (the
    # embedding's half starts at zero): with the highest tap + 1 the draft starts as the policy's next layer
    layer_from_policy: int | None = None  # EAGLE-3: a fresh draft's layer starts as this policy layer; None: random
    # the dtype of the draft's matmuls in rollouts on CPU (its weights and training stay in model.dtype): auto =
    # int8 where torch has the x86/fbgemm quantized engine (per-channel weights, per-call activations: a quarter of
    # fp32's bytes, 0.75-0.82x a bf16 draft step's time, acceptance within noise: models/linear.py), else bfloat16
    # where the CPU has bf16 arithmetic (AVX-512 BF16 / AMX: half the bytes, ~0.7x fp32's time), else float32
    inference_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    # DFlash / DSpark
    num_layers: int = 2
    block_size: int = 8
    num_anchors: int = 16  # per sequence, sampled in the response
    gamma: float = 8.0  # slot weight exp(-(k-1)/gamma)
    mask_token_id: int | None = None  # None = a spare id chosen from the vocab
    # DSpark
    markov_rank: int = 64
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_head: bool = False

    def validate(self, num_policy_layers: int | None = None, policy_vocab_size: int | None = None) -> None:
        """The section's own rules; with the policy's layer count and vocabulary, those that need them too."""
        require(self.ttt_steps >= 1, "draft.ttt_steps", ">= 1", self.ttt_steps)
        require(self.block_size >= 2, "draft.block_size", ">= 2", self.block_size)
        require(self.num_layers >= 1, "draft.num_layers", ">= 1", self.num_layers)
        require(self.num_anchors >= 1, "draft.num_anchors", ">= 1", self.num_anchors)
        require(self.draft_vocab_size >= 0, "draft.draft_vocab_size", ">= 0", self.draft_vocab_size)
        require(self.markov_rank >= 1, "draft.markov_rank", ">= 1", self.markov_rank)
        if self.tap_layers is not None:
            require(all(a < b for a, b in zip(self.tap_layers, self.tap_layers[1:], strict=False)), "draft.tap_layers",
                    "strictly ascending: SGLang and vLLM concatenate the captured layers in ascending order, so "
                    "any other order exports a draft that serves wrong", self.tap_layers)
        if self.tap_layers is not None and num_policy_layers is not None:
            bad = [i for i in self.tap_layers if not 0 <= i < num_policy_layers]
            require(not bad, "draft.tap_layers", f"layers of the policy, in [0, {num_policy_layers - 1}]", bad)
        if self.layer_from_policy is not None:
            require(self.family == "eagle3", "draft.layer_from_policy",
                    "unset unless draft.family is eagle3 (DFlash's and DSpark's layers read blocks, not a policy "
                    "layer's input)", self.layer_from_policy)
        if self.layer_from_policy is not None and num_policy_layers is not None:
            require(0 <= self.layer_from_policy < num_policy_layers, "draft.layer_from_policy",
                    f"a layer of the policy, in [0, {num_policy_layers - 1}], or unset", self.layer_from_policy)
        if self.mask_token_id is not None and policy_vocab_size is not None:
            require(0 <= self.mask_token_id < policy_vocab_size, "draft.mask_token_id",
                    f"an id of the policy's vocabulary, in [0, {policy_vocab_size - 1}] (or unset: a spare id)",
                    self.mask_token_id)


# the reward task.reward=auto picks for each task.kind
TASK_REWARDS = {"arithmetic": "correctness", "jsonl": "correctness", "chain": "chain_steps", "lists": "list_match"}


@dataclass
class TaskConfig:
    kind: Literal["arithmetic", "jsonl", "chain", "lists"] = "lists"  # chain, lists: long answers (rl/tasks.py)
    path: str | None = None  # JSONL {"prompt", "answer"} rows, for kind=jsonl
    min_operand: int = 0
    max_operand: int = 20
    num_terms: int = 2
    operators: str = "+"  # kind=chain: + and - only
    chain_min_terms: int = 4  # kind=chain: terms per problem, log-uniform in [chain_min_terms, chain_max_terms]
    chain_max_terms: int = 24  # kind=chain: the long tail (answers reach ~250 tokens: raise rl.max_new_tokens)
    list_min_length: int = 5  # kind=lists: numbers per list, log-uniform in [list_min_length, list_max_length]
    list_max_length: int = 24  # kind=lists: a list of 24 two-digit numbers takes ~70 tokens
    list_max_number: int = 99  # kind=lists: the numbers lie in [1, list_max_number]
    reward: str = "auto"  # auto: the kind's own (TASK_REWARDS); or a built-in name, or "package.module:function"
    chat_template: bool = True

    @property
    def reward_spec(self) -> str:
        """task.reward with auto resolved to the task's own reward."""
        return TASK_REWARDS[self.kind] if self.reward == "auto" else self.reward

    def validate(self) -> None:
        if self.kind == "jsonl" and (self.path is None or not Path(self.path).is_file()):
            raise ConfigError(f"task.path must name a JSONL file for task.kind=jsonl (got {self.path!r})")
        require(self.min_operand <= self.max_operand, "task.max_operand", ">= task.min_operand", self.max_operand)
        require(self.num_terms >= 2, "task.num_terms", ">= 2", self.num_terms)
        require(bool(self.operators) and set(self.operators) <= set("+-*"), "task.operators", "made of + - *",
                self.operators)
        require(self.reward != "chain_steps" or self.kind == "chain", "task.reward",
                f"a reward for task.kind={self.kind} (chain_steps needs task.kind=chain, whose problems carry "
                "their steps)", self.reward)
        if self.kind == "lists":
            require(self.list_min_length >= 1, "task.list_min_length", ">= 1", self.list_min_length)
            require(self.list_max_length >= self.list_min_length, "task.list_max_length", ">= task.list_min_length",
                    self.list_max_length)
            require(self.list_max_number >= self.list_max_length, "task.list_max_number",
                    ">= task.list_max_length (a count of that many numbers from 1 must fit)", self.list_max_number)
        if self.kind == "chain":
            require(set(self.operators) <= set("+-"), "task.operators", "made of + - for task.kind=chain",
                    self.operators)
            require(self.chain_min_terms >= 2, "task.chain_min_terms", ">= 2", self.chain_min_terms)
            require(self.chain_max_terms >= self.chain_min_terms, "task.chain_max_terms", ">= task.chain_min_terms",
                    self.chain_max_terms)


@dataclass
class RLConfig:
    # The defaults are the default run's (README, "The default run"): one prompt x 4 answers of the lists task a step,
    # long enough and few enough that speculation pays on a 2-core CPU, which decodes 4 rows in about the time of 1
    # and verifies a few tokens per row for little more; the reward rises within the 50 steps at optim.lr 2e-5.
    steps: int = 50
    prompts_per_step: int = 1
    group_size: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.7  # drafts accept more of a cooler policy's tokens (chain rollouts 1.79x vs T=1's 1.55x)
    top_p: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher
    beta: float = 0.0  # KL to a frozen reference; 0 keeps no reference model
    aggregation: Literal["token-mean", "sequence-mean", "dr-grpo"] = "token-mean"
    scale_by_std: bool = True
    filter_zero_variance: bool = False
    optimizer_steps_per_batch: int = 1
    is_correction: Literal["none", "tis", "token-clip"] = "tis"
    is_cap: float = 2.0
    draft_weight: float = 0.1  # lambda in L = L_RL + lambda * L_draft
    # in co-training (autocast; the policy, weights, optimizer state, losses and attention stay fp32; the e2e
    # workload's draft training took 0.63x its fp32 time). CP/PP shards then round differently from one process
    draft_matmul_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # draft's matmuls; auto: bf16 where native
    # the policy's training forward (its head stays at the weights' precision): 0.71-0.74x the update's time on this
    # project's AMX CPU; float32 (default) keeps its gradients, and layouts' match with one process, exact
    policy_matmul_dtype: Literal["auto", "float32", "bfloat16"] = "float32"  # policy's training matmuls, head excepted
    # the policy's training forward runs each group's prompt once, its answers attending to it (pp = 1, cp = 1;
    # models/shared_prefix.py): the same losses and gradients to rounding, fewer tokens through the layers
    share_prompts: bool = True
    num_speculative_tokens: int = 4
    adaptive: bool = True  # timing-driven k: faster, but runs are then not bitwise reproducible
    verification: Verification = "block"  # how rollouts judge a chain of drafts; both lossless (rollout/verify.py)
    max_dropped_share: float = 0.5  # a step "trains nothing" when more than this share of samples has no reward
    max_dropped_steps: int = 3  # that many such steps in a row stop the run with the reward's error; 0 = never
    drift_every: int = 5  # steps between drift/kl_step0, KL(current || step-0 policy) per token (rl/drift.py); 0 = off
    drift_prompts: int = 8  # held-out prompts whose greedy step-0 answers drift/kl_step0 is measured on
    # after the step's speculative rollout, plain decoding of its prompts to its row lengths is timed, outside
    # time/step_s (rollout/speedup.py); the cost: one plain rollout per measurement
    measure_speedup_every: int = 5  # steps between rollout/speedup_measured (steps N, 2N, ...); 0 = off
    # the run's initial draft, never updated, scored beside the trained one on the step's batch (frozen_draft/*
    # metrics, same tokens and policy; with a draft and rl.draft_weight > 0); the cost: a draft loss without backward
    frozen_draft_every: int = 0  # steps between frozen_draft/*, the initial draft's loss metrics (N, 2N, ...); 0 = off

    def validate(self) -> None:
        require(self.steps >= 1, "rl.steps", ">= 1", self.steps)
        require(self.drift_every >= 0, "rl.drift_every", ">= 0 (0 = off)", self.drift_every)
        require(self.measure_speedup_every >= 0, "rl.measure_speedup_every", ">= 0 (0 = off)",
                self.measure_speedup_every)
        require(self.frozen_draft_every >= 0, "rl.frozen_draft_every", ">= 0 (0 = off)", self.frozen_draft_every)
        # the logged pass of K > 1 comes after K - 1 updates of the trained draft on the batch it is scored on
        require(not self.frozen_draft_every or self.optimizer_steps_per_batch == 1, "rl.frozen_draft_every",
                "0 when rl.optimizer_steps_per_batch > 1 (the pair must be scored on a batch the trained draft has "
                "not trained on)", self.frozen_draft_every)
        require(self.drift_prompts >= 1, "rl.drift_prompts", ">= 1", self.drift_prompts)
        require(self.prompts_per_step >= 1, "rl.prompts_per_step", ">= 1", self.prompts_per_step)
        require(self.group_size >= 2, "rl.group_size", ">= 2 (advantages are relative to the group)", self.group_size)
        require(self.max_new_tokens >= 1, "rl.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.temperature > 0, "rl.temperature", "> 0 (RL samples)", self.temperature)
        require(0 < self.top_p <= 1, "rl.top_p", "in (0, 1]", self.top_p)
        require(self.eps_low >= 0 and self.eps_high >= 0, "rl.eps_low/eps_high", ">= 0", (self.eps_low, self.eps_high))
        require(self.beta >= 0, "rl.beta", ">= 0", self.beta)
        require(self.optimizer_steps_per_batch >= 1, "rl.optimizer_steps_per_batch", ">= 1",
                self.optimizer_steps_per_batch)
        require(self.is_cap >= 1, "rl.is_cap", ">= 1", self.is_cap)
        require(self.draft_weight >= 0, "rl.draft_weight", ">= 0", self.draft_weight)
        require(self.num_speculative_tokens >= 0, "rl.num_speculative_tokens", ">= 0", self.num_speculative_tokens)
        require(0 <= self.max_dropped_share <= 1, "rl.max_dropped_share", "in [0, 1]", self.max_dropped_share)
        require(self.max_dropped_steps >= 0, "rl.max_dropped_steps", ">= 0 (0 = never stop)", self.max_dropped_steps)


@dataclass
class OptimConfig:
    lr: float = 2e-5  # the default run's: 4 answers a step; at 5e-5 the chain task's answers collapsed (stop 53)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    # half the final lr of the warm start's distillation: a fresh Adam at 1e-3 undid a warm EAGLE-3's (README)
    draft_lr: float = 1e-4  # for the warm draft of checkpoint.draft_init=auto; a fresh draft learns faster at 1e-3
    draft_weight_decay: float = 0.0
    draft_grad_clip: float = 1.0
    draft_warmup_steps: int = 5  # 0 suits a fresh draft

    def validate(self) -> None:
        for name in ("lr", "draft_lr"):
            require(getattr(self, name) > 0, f"optim.{name}", "> 0", getattr(self, name))
        for name in ("weight_decay", "draft_weight_decay", "grad_clip", "draft_grad_clip", "warmup_steps",
                     "draft_warmup_steps"):
            require(getattr(self, name) >= 0, f"optim.{name}", ">= 0", getattr(self, name))


@dataclass
class CheckpointConfig:
    every: int = 10  # steps between checkpoints (and one at the end, or on SIGINT/SIGTERM); 0 = only then
    keep: int = 2  # newest checkpoints kept
    resume: str | None = None  # a run directory to continue (`codraft train --resume DIR`)
    # auto: distilled for this policy and config once (draft_train.*), then cached under $CODRAFT_CACHE/drafts
    # (distill/warm_start.py)
    draft_init: str | None = "auto"  # the draft to start from: auto, a draft dir (codraft draft-train), none = fresh

    def validate(self) -> None:
        require(self.every >= 0, "checkpoint.every", ">= 0", self.every)
        require(self.keep >= 1, "checkpoint.keep", ">= 1", self.keep)
        if self.resume is not None and not (Path(self.resume) / "checkpoints").is_dir():
            raise ConfigError(f"checkpoint.resume: '{self.resume}' is not a run directory with checkpoints/")
        if self.draft_init == "none":
            self.draft_init = None
        if self.draft_init not in (None, "auto") and not (Path(self.draft_init) / "config.json").is_file():
            raise ConfigError(f"checkpoint.draft_init: '{self.draft_init}' is not an exported draft directory "
                              "(nor auto or none)")


@dataclass
class BenchConfig:
    benchmark: Literal["rollout", "attention", "draft", "e2e", "tapchannel", "soak"] = "rollout"
    out_dir: str = "results"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_new_tokens: int = 48
    repeats: int = 3  # interleaved repeats; medians are reported
    num_speculative_tokens: int = 4
    seq_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096])  # bench attention
    draft_path: str | None = None  # bench draft: an exported draft dir; None trains one (draft_train.*)
    draft_prompts: int = 16  # bench draft: held-out task prompts, after the ones the draft was distilled on
    stop_tokens: bool = False  # bench draft speed runs: rows end at EOS as in RL rollouts (else all emit max tokens)
    verification: Verification = "block"  # bench draft: how its sampled runs and acceptance judge drafts
    soak_steps: int = 300  # bench soak: steps of the run killed and resumed once, and of the uninterrupted one
    e2e_families: list[str] = field(default_factory=lambda: list(DRAFT_FAMILIES))  # bench e2e: co-trained runs
    e2e_frozen: str = "best"  # bench e2e: the frozen control's family; best: highest last-10 tau; none: no control
    e2e_eval_prompts: int = 32  # bench e2e: held-out prompts for the drafts at fixed k vs the final policies; 0: none
    e2e_eval_max_new_tokens: int = 96  # bench e2e: tokens per prompt in that measurement

    def validate(self) -> None:
        bad = [f for f in self.e2e_families if f not in DRAFT_FAMILIES]
        require(not bad, "bench.e2e_families", f"draft families among {', '.join(DRAFT_FAMILIES)}", bad)
        require(len(set(self.e2e_families)) == len(self.e2e_families), "bench.e2e_families", "without repeats",
                self.e2e_families)
        frozen = ("best", "none", *self.e2e_families)
        require(self.e2e_frozen in frozen, "bench.e2e_frozen", f"one of {', '.join(frozen)}", self.e2e_frozen)
        if self.draft_path is not None and not (Path(self.draft_path) / "config.json").is_file():
            raise ConfigError(f"bench.draft_path: '{self.draft_path}' is not an exported draft directory")
        require(self.draft_prompts >= 1, "bench.draft_prompts", ">= 1", self.draft_prompts)
        require(self.e2e_eval_prompts >= 0, "bench.e2e_eval_prompts", ">= 0", self.e2e_eval_prompts)
        require(self.e2e_eval_max_new_tokens >= 1, "bench.e2e_eval_max_new_tokens", ">= 1",
                self.e2e_eval_max_new_tokens)
        require(all(b >= 1 for b in self.batch_sizes), "bench.batch_sizes", "all >= 1", self.batch_sizes)
        require(self.repeats >= 1, "bench.repeats", ">= 1", self.repeats)
        require(self.max_new_tokens >= 2, "bench.max_new_tokens", ">= 2", self.max_new_tokens)


@dataclass
class DraftTrainConfig:
    """`codraft draft-train`: distil a draft on responses the policy generates, before RL."""

    # defaults sized for the warm start of the default `codraft train` (SmolLM2-135M, the lists task, answers of ~70
    # tokens at the rollouts' temperature): about 6 CPU minutes without the eval (answers 2, caching 1, steps 3)
    num_prompts: int = 256  # training prompts from task.*, each answered once by the policy
    held_out_prompts: int = 32  # the next prompts of the task stream, for the acceptance eval only
    steps: int = 250
    batch_size: int = 8  # sequences per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # after warm-up the lr follows a cosine from lr down to min_lr_ratio * lr
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0 = off
    warmup_steps: int = 5
    temperature: float = 0.7  # of the policy's responses, as rl.temperature (the eval runs at 0 and 1 regardless)
    max_new_tokens: int = 128
    generate_batch_size: int = 32  # also the batch of the policy forwards that fill the cache
    # compute the frozen policy's taps and, of its rows predicting response tokens, what the draft's loss reads once
    # per response, not once per epoch: EAGLE-3's draft-vocabulary log-probs (fp16), DFlash/DSpark's last hidden
    # states (the head runs again per batch); (taps + 1) x hidden x 4 (+ (N + 1) x 2 for EAGLE-3) bytes per token
    cache_policy_outputs: bool = True
    # keep the policy's generated responses under $CODRAFT_CACHE/responses, one file per generate_batch_size prompts,
    # keyed by the policy, the chunk's prompts and the generation settings: other families, warm starts and ablations
    # on them skip the generation, more prompts of the same task generate only the chunks they add, and an
    # interrupted generation resumes at its first unfinished chunk
    cache_responses: bool = True
    # the dtype of the draft's matmuls in distillation (autocast; weights, optimizer state, losses and attention
    # stay fp32): auto = bfloat16 where the device has bf16 arithmetic (a chain-task step 0.69x, loss equal to 1e-4)
    matmul_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    save_every: int = 0  # steps between exported drafts; 0 = only at the end
    eval_k: int = 7  # speculative tokens in the eval (EAGLE-3; DFlash/DSpark use draft.block_size - 1)
    eval_max_new_tokens: int = 32
    # one draft's T=1 tau read 2.29-2.61 across three seeds (README), more than most warm-start levers moved it
    eval_seeds: int = 3  # sampling seeds of the T=1 eval, from run.seed (eval.json: their mean and each)

    def validate(self) -> None:
        for name in ("num_prompts", "held_out_prompts", "steps", "batch_size", "max_new_tokens",
                     "generate_batch_size", "eval_k", "eval_max_new_tokens", "eval_seeds"):
            require(getattr(self, name) >= 1, f"draft_train.{name}", ">= 1", getattr(self, name))
        require(self.lr > 0, "draft_train.lr", "> 0", self.lr)
        require(0 <= self.min_lr_ratio <= 1, "draft_train.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        for name in ("weight_decay", "grad_clip", "warmup_steps", "save_every"):
            require(getattr(self, name) >= 0, f"draft_train.{name}", ">= 0", getattr(self, name))
        require(self.temperature >= 0, "draft_train.temperature", ">= 0 (0 = greedy)", self.temperature)


@dataclass
class ExportConfig:
    """`codraft export-draft`: a `codraft train` run dir, a `codraft draft-train` run dir or a draft dir."""

    source: str | None = None
    out_dir: str | None = None  # None: <source>/export (required when the source is a draft dir)
    family: Literal[("any", *DRAFT_FAMILIES)] = "any"  # the family the source must hold

    def validate(self) -> None:
        if self.source is not None and not Path(self.source).is_dir():
            raise ConfigError(f"export.source: '{self.source}' is not a directory")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    draft_train: DraftTrainConfig = field(default_factory=DraftTrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


    def validate(self) -> None:
        """The rules that span sections, checked once at load (the sections' own rules ran before)."""
        p, rl, d = self.parallel, self.rl, self.draft
        if p.dp > 1 and rl.filter_zero_variance:
            # a replica whose groups were all filtered out would skip the update its peers wait in
            raise ConfigError(f"rl.filter_zero_variance=true needs parallel.dp=1 (got parallel.dp={p.dp}): "
                              "set rl.filter_zero_variance=false")
        if p.pp_microbatches and p.pp_microbatches < p.pp:
            raise ConfigError(f"parallel.pp_microbatches={p.pp_microbatches} cannot fill parallel.pp={p.pp} "
                              "pipeline stages: use >= parallel.pp, or 0 (= 2 * parallel.pp)")
        if p.pp_microbatches and p.pp == 1:
            raise ConfigError(f"parallel.pp_microbatches={p.pp_microbatches} applies to parallel.pp > 1 only "
                              "(got parallel.pp=1): leave it at 0")
        if self.model.ref_path is not None and rl.beta == 0:
            raise ConfigError(f"model.ref_path={self.model.ref_path} is the reference of the KL term, which "
                              "rl.beta=0 turns off: set rl.beta > 0 or leave model.ref_path unset")
        if d.family == "dspark" and d.loss == "tv":
            raise ConfigError("draft.loss=tv with draft.family=dspark: DSpark adds its TV term itself "
                              "(draft.tv_weight); draft.loss picks its CE term: soft_ce or hard_ce")
        if d.family == "none" and self.checkpoint.draft_init not in (None, "auto"):  # auto: nothing to start
            raise ConfigError(f"checkpoint.draft_init={self.checkpoint.draft_init} with draft.family=none: "
                              f"name the draft's family (one of {', '.join(DRAFT_FAMILIES)})")

    def check_policy(self, num_layers: int, vocab_size: int) -> None:
        """The rules that need the policy's shape: checked where the policy is loaded (models.load_policy,
        models.policy_args before a multi-process launch), before any run directory is written."""
        p, d = self.parallel, self.draft
        require(p.pp <= num_layers, "parallel.pp", f"at most the policy's {num_layers} layers (a stage holds one "
                "at least)", p.pp)
        if d.family == "none":
            return
        d.validate(num_layers, vocab_size)
        if d.family == "eagle3" and d.tap_layers is not None and num_layers >= 3:
            require(len(d.tap_layers) == 3, "draft.tap_layers", "3 layers for draft.family=eagle3 (SpecForge, "
                    "SGLang and vLLM build its fc for exactly 3 taps), or unset for the default 3", d.tap_layers)


# --- loading -------------------------------------------------------------------------------

C = TypeVar("C")


def load_config(yaml_path: str | Path | None, overrides: list[str], cls: type[C] = Config) -> C:
    """Defaults of ``cls``, then the YAML file, then ``key.sub=value`` overrides; checked and validated."""
    cfg = cls()
    if yaml_path is not None:
        try:
            data = yaml.safe_load(Path(yaml_path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file '{yaml_path}': {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{yaml_path}' is not valid YAML: {' '.join(str(e).split())}") from None
        _merge(cfg, data or {}, "")
    _apply(cfg, overrides)
    _check(cfg, "")
    return cfg


def with_overrides(cfg: C, overrides: list[str]) -> C:
    """A copy of the loaded ``cfg`` with ``key.sub=value`` overrides applied, checked and validated as
    ``load_config`` does (``cfg`` itself is left as it was)."""
    out = copy.deepcopy(cfg)
    _apply(out, overrides)
    _check(out, "")
    return out


def _apply(cfg: Any, overrides: list[str]) -> None:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. generate.temperature=0.7)")
        _set(cfg, key.strip(), value)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML; ``load_config`` reads it back to an equal config."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _lookup(section: Any, name: str, key: str, prefix: str) -> Any:
    """The annotation of field ``name`` of ``section``; unknown names list the valid ones."""
    hints = _hints(type(section))
    if name not in hints:
        where = f"in '{prefix}'" if prefix else "at top level"
        hint = difflib.get_close_matches(name, hints, n=1)
        did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"unknown config key '{key}'; valid keys {where}: {', '.join(hints)}{did_you_mean}")
    return hints[name]


def _merge(section: Any, data: Any, prefix: str) -> None:
    """Copy a YAML mapping into ``section``; leaves are type-checked later by ``_check``."""
    if not isinstance(data, dict):
        where = f"section '{prefix}'" if prefix else "file"
        raise ConfigError(f"config {where} must be a mapping of keys, got {data!r}")
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        tp = _lookup(section, str(name), key, prefix)
        if _is_section(tp):
            _merge(getattr(section, name), value or {}, key)  # an empty section in YAML is null
        else:
            setattr(section, name, value)


def _set(cfg: Any, key: str, value: str) -> None:
    section, prefix = cfg, ""
    *path, leaf = key.split(".")
    for name in path:
        tp = _lookup(section, name, key, prefix)
        prefix = f"{prefix}.{name}" if prefix else name
        if not _is_section(tp):
            raise ConfigError(f"config key '{prefix}' is a value, not a section; cannot set '{key}'")
        section = getattr(section, name)
    tp = _lookup(section, leaf, key, prefix)
    if _is_section(tp):
        raise ConfigError(f"config key '{key}' is a section; set one of its keys: {', '.join(_hints(tp))}")
    setattr(section, leaf, value)


def _check(section: Any, prefix: str) -> None:
    """Coerce every leaf to its annotation, then run the section's ``validate()`` hook."""
    for name, tp in _hints(type(section)).items():
        key = f"{prefix}.{name}" if prefix else name
        if _is_section(tp):
            _check(getattr(section, name), key)
        else:
            setattr(section, name, _coerce(getattr(section, name), tp, key))
    if hasattr(section, "validate"):
        section.validate()


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as type ``tp``: typed values (defaults, YAML) pass through, strings (overrides) are parsed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        raise ConfigError(f"config key '{key}' must be one of: {', '.join(map(str, args))} (got {value!r})")
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is supported
        if value is None or (isinstance(value, str) and value.lower() in ("null", "~")):
            return None
        return _coerce(value, inner, key)
    if origin is list:
        if isinstance(value, str):
            with contextlib.suppress(yaml.YAMLError):  # unparsable text is reported below as a type error
                value = yaml.safe_load(value)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' expects {_type_name(tp)} (e.g. [1, 2]), got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # also YAML 1.1's unparsed '1e-3'
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"config key '{key}' has an unsupported annotation {tp!r}")
    raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")
