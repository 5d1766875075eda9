"""Tokenizer parity with transformers: GGUF-built and HF-dir tokenizers, special tokens, chat templates."""

import gguf
import jinja2
import pytest

from codraft.models.gguf_checkpoint import gguf_metadata
from codraft.models.presets import byte_tokenizer, smollm2_gguf_path
from codraft.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  two leading spaces and trailing  ",
    "numbers 12345 and 3.14159, 2024-01-01, 1 22 333",
    "tabs\tand\nnewlines\n\n\n  indented",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "unicode: héllo wörld 你好 🤖 Ünïcödé ﷽",
    "code: def f(x):\n    return x**2  # square\r\n",
    "I'm sure you're right, we've done it",
    "<|endoftext|><repo_name>x<file_sep>y",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye 👋"},
    ],
]
# exercises what real templates (Qwen3, Llama 3) use: namespace, loop controls, tojson, kwargs, generation tags
FEATURE_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
{% if m.role == 'system' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m | tojson }}{% endif %}
{% if loop.last and enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endfor %}
{{ ns.n }}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"""


@pytest.fixture(scope="module")
def gguf_pair():
    """(ours, transformers') tokenizer of the SmolLM2 GGUF."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    ours = Tokenizer.from_gguf_metadata(gguf_metadata(gguf.GGUFReader(path)))
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_gguf_tokenizer_matches_transformers(gguf_pair):
    ours, theirs = gguf_pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.vocab_size == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (
        theirs.bos_token_id,
        [theirs.eos_token_id],
        theirs.pad_token_id,
    )


def test_special_tokens_are_single_ids(gguf_pair):
    ours, _ = gguf_pair
    assert ours.encode("<|im_start|>assistant<|im_end|>") == [1, *ours.encode("assistant"), 2]
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(gguf_pair, add_generation_prompt):
    ours, theirs = gguf_pair
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_template_features_match_transformers(gguf_pair):
    ours, theirs = gguf_pair
    custom = Tokenizer(ours.backend, chat_template=FEATURE_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>")
    messages = CONVERSATIONS[1]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = theirs.apply_chat_template(
            messages, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert custom.apply_chat_template(messages, **kwargs) == expected
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_runs_sandboxed():
    escape = Tokenizer(byte_tokenizer().backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.apply_chat_template([])


def test_hf_dir_tokenizer_matches_transformers(gguf_pair, tmp_path):
    from transformers import AutoTokenizer

    _, theirs = gguf_pair
    theirs.save_pretrained(tmp_path)
    ours, reloaded = Tokenizer.from_hf_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == reloaded.encode(text), text
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == reloaded.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert ours.eos_token_ids == [reloaded.eos_token_id] and ours.bos_token_id == reloaded.bos_token_id


def test_saved_tokenizer_reloads_identically(gguf_pair, tmp_path):
    ours, _ = gguf_pair
    ours.save(tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert again.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])
    assert (again.eos_token_ids, again.bos_token_id, again.pad_token_id) == (
        ours.eos_token_ids,
        ours.bos_token_id,
        ours.pad_token_id,
    )


def test_byte_tokenizer_round_trips_and_keeps_specials_whole():
    tok = byte_tokenizer()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hé") == [ord("h"), 0xC3, 0xA9]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == 257 and 258 in tok.encode(prompt)
    assert tok.eos_token_ids == [258, 256] and tok.pad_token_id == 256 and tok.vocab_size == 259


def test_unknown_gguf_pre_tokenizer_is_refused():
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "mystery",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.merges": [],
    }
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='mystery'"):
        Tokenizer.from_gguf_metadata(meta)
