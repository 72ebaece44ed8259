"""The Search-R1 / CriticSearch training prompt and chat-template wrapping."""
import pytest

from fastcredit.data.prompts import apply_chat_template, build_prompt


def test_exact_searchr1_text():
    assert build_prompt("who wrote hamlet") == (
        "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
        "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
        "<search> query </search> and it will return the top searched results between <information> and "
        "</information>. You can search as many times as your want. If you find no further external knowledge "
        "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
        "For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n"
    )
    assert build_prompt("  Why?  ").endswith("Question: Why?\n")
    with pytest.raises(ValueError, match="unknown prompt template 'r1'"):
        build_prompt("q", "r1")


def _tokenizer(chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    return fast


def test_chat_wrapping():
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    prompt = build_prompt("q")
    assert apply_chat_template(_tokenizer(template), prompt, True) == f"<|user|>{prompt}<|end|><|assistant|>"
    assert apply_chat_template(_tokenizer(None), prompt, False) == prompt
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(_tokenizer(None), prompt, True)
