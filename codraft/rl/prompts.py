"""Task prompts as token ids, each checked against the positions the policy's context leaves for it."""

from __future__ import annotations

from codraft.config import Config, ConfigError
from codraft.models import Tokenizer, Transformer
from codraft.rl.tasks import IndexedTask, JsonlTask, Problem, build_prompt_ids


class PromptEncoder:
    """`encode(problem)` -> the prompt's token ids; a prompt longer than `context - reserved` tokens (`reserved`:
    the positions a rollout appends after it) is a ConfigError naming its JSONL row.

    No token stands for more characters than the longest vocabulary entry, so a text longer than that many
    times the limit cannot fit and is refused without being tokenised (a 10 MB prompt takes seconds).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: bool, context: int, reserved: int):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.context, self.reserved, self.limit = context, reserved, context - reserved
        self.longest_token = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)))

    def __call__(self, problem: Problem) -> list[int]:
        if len(problem.prompt) > self.limit * self.longest_token:
            self._refuse(problem, f"{len(problem.prompt)} characters, at least "
                                  f"{len(problem.prompt) // self.longest_token} tokens")
        ids = build_prompt_ids(self.tokenizer, problem, self.chat_template)
        if len(ids) > self.limit:
            self._refuse(problem, f"{len(ids)} tokens")
        return ids

    def _refuse(self, problem: Problem, size: str) -> None:
        where = f"task.path {problem.source}" if problem.source else f"task prompt {problem.prompt[:60]!r}"
        raise ConfigError(f"{where}: the prompt is {size}; at most {max(self.limit, 0)} fit (the policy's context "
                          f"of {self.context} positions less {self.reserved} for the response: rl.max_new_tokens, "
                          "speculative tokens, one bonus token)")


def prompt_corpus(task: IndexedTask, encode: PromptEncoder, n: int) -> list[list[int]]:
    """Token ids of the first `n` prompts of the task's stream (the corpus of EAGLE-3's draft vocabulary),
    after checking every row of a JSONL task; each distinct prompt text is tokenised once."""
    sampled = [task.problem(i) for i in range(n)]
    needed = {p.prompt for p in sampled}
    rows = task.problems if isinstance(task, JsonlTask) else []
    seen: set[str] = set()
    ids: dict[str, list[int]] = {}
    for problem in (*rows, *sampled):
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            tokens = encode(problem)
            if problem.prompt in needed:
                ids[problem.prompt] = tokens
    return [ids[p.prompt] for p in sampled]


def prompt_encoder(cfg: Config, policy: Transformer, tokenizer: Tokenizer) -> PromptEncoder:
    """Prompts leave room in the policy's context for what a rollout appends, as the engine counts it."""
    rl = cfg.rl
    speculative = rl.num_speculative_tokens if cfg.draft.family != "none" else 0
    return PromptEncoder(tokenizer, cfg.task.chat_template, policy.args.max_position_embeddings,
                         rl.max_new_tokens + speculative + 1)
