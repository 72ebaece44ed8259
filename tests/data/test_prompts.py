"""The Search-R1 / CriticSearch training prompt, and chat-template wrapping."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastcredit.data.prompts import apply_chat_template, build_prompt, has_chat_template

# Typed out by hand from Search-R1's make_prefix (scripts/data_process/nq_search.py), not
# imported from the module, so a drift in either shows up here.
EXPECTED_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: "
)
CHAT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_exact_searchr1_text():
    assert build_prompt("who wrote hamlet") == EXPECTED_PREFIX + "who wrote hamlet?\n"
    assert build_prompt("who wrote hamlet", template="searchr1") == EXPECTED_PREFIX + "who wrote hamlet?\n"


def test_tags_are_plain_not_backticked():
    prompt = build_prompt("q")
    assert "`" not in prompt
    for tag in ("think", "search", "information", "answer"):
        assert f"<{tag}>" in prompt and f"</{tag}>" in prompt


@pytest.mark.parametrize("question, inserted", [
    ("Where was Varo Keltan born?", "Where was Varo Keltan born?"),
    ("  who wrote hamlet \n", "who wrote hamlet?"),  # Search-R1 strips, then adds a missing '?'
    ("Is {x} a {placeholder}", "Is {x} a {placeholder}?"),  # braces in a question are text, not fields
])
def test_question_insertion(question, inserted):
    assert build_prompt(question) == EXPECTED_PREFIX + inserted + "\n"


@given(st.text(min_size=1).filter(lambda s: s.strip()))
def test_any_question_ends_the_prompt_once(question):
    prompt = build_prompt(question)
    tail = prompt[len(EXPECTED_PREFIX):]
    assert prompt.startswith(EXPECTED_PREFIX) and tail.endswith("?\n")
    assert tail[:-1].rstrip("?") == question.strip().rstrip("?")


def test_prompt_errors():
    with pytest.raises(ValueError, match="unknown prompt template 'r1'; valid: searchr1"):
        build_prompt("q", "r1")
    with pytest.raises(ValueError, match="empty question"):
        build_prompt(" \n ")


def _tokenizer(chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    return fast


def test_chat_wrapping_for_instruct_models():
    prompt = build_prompt("q")
    tok = _tokenizer(CHAT)
    assert has_chat_template(tok)
    wrapped = f"<|user|>{prompt}<|end|><|assistant|>"
    assert apply_chat_template(tok, prompt, True) == wrapped
    assert apply_chat_template(tok, prompt, "auto") == wrapped
    assert apply_chat_template(tok, prompt, False) == prompt


def test_base_models_get_the_raw_prompt():
    prompt = build_prompt("q")
    tok = _tokenizer(None)
    assert not has_chat_template(tok) and not has_chat_template(None)
    assert apply_chat_template(tok, prompt, False) == prompt
    assert apply_chat_template(tok, prompt, "auto") == prompt
    assert apply_chat_template(None, prompt, "auto") == prompt


def test_chat_wrapping_without_a_template_is_an_error():
    with pytest.raises(ValueError, match="has no chat template; set model.chat_template=false"):
        apply_chat_template(_tokenizer(None), "p", True)
    with pytest.raises(ValueError, match="no tokenizer was given"):
        apply_chat_template(None, "p", True)
    with pytest.raises(ValueError, match="enabled must be True, False or 'auto'"):
        apply_chat_template(_tokenizer(CHAT), "p", "yes")


def test_the_rows_own_prompt_as_searchr1s_dataset_reads_it(tmp_path):
    """data.prompt_source=parquet: the row's chat list through the chat template when wrapping is on, else its first
    message's text (Search-R1's veRL RLHFDataset); the question column is not used to rebuild it."""
    from fastcredit.data.loaders import QAExample, load_qa, write_searchr1_parquet
    from fastcredit.data.prompts import example_prompt_ids, row_prompt_text

    path = str(tmp_path / "train.parquet")
    write_searchr1_parquet([QAExample("0", "q", ["a"], "nq")], path, prompt_fn=lambda q: "hi hi custom " + q)
    (ex,) = load_qa(path)
    assert ex.prompt == [{"role": "user", "content": "hi hi custom q"}]
    plain, chat = _tokenizer(None), _tokenizer(CHAT)
    assert row_prompt_text(plain, ex.prompt, "auto", "row 0") == "hi hi custom q"
    assert row_prompt_text(chat, ex.prompt, "auto", "row 0") == "<|user|>hi hi custom q<|end|><|assistant|>"
    assert row_prompt_text(chat, ex.prompt, False, "row 0") == "hi hi custom q"
    two = [{"role": "system", "content": "hi"}, {"role": "user", "content": "hi hi"}]
    assert row_prompt_text(plain, two, False, "row 0") == "hi"  # the first message, as Search-R1 takes it
    ids = example_prompt_ids(plain, [ex], "parquet", chat_template=False)
    assert ids == [plain("hi hi custom q", add_special_tokens=False)["input_ids"]]
    assert example_prompt_ids(plain, [ex], "template") != ids  # the built-in template ignores the row's prompt
    with pytest.raises(ValueError, match=r"example '7' \(toyworld\): no 'prompt' field.*data.prompt_source=template"):
        example_prompt_ids(plain, [QAExample("7", "q", ["a"], "toyworld")], "parquet")
    with pytest.raises(ValueError, match="row 3: field 'prompt' must be a non-empty list"):
        row_prompt_text(plain, [{"role": "user"}], False, "row 3")
    with pytest.raises(ValueError, match="has no chat template"):
        row_prompt_text(plain, ex.prompt, True, "row 0")


def test_prompt_source_parquet_refuses_data_without_prompts_before_training(tmp_path):
    from fastcredit.data.build import load_data
    from fastcredit.config import load_config
    import json

    from fastcredit.data.loaders import DataError, QAExample

    path = str(tmp_path / "train.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(QAExample("a1", "q", ["a"], "nq").to_record()) + "\n")
    cfg = load_config(None, ["data.source=flashrag", f"data.train_path={path}", "data.prompt_source=parquet"])
    with pytest.raises(DataError, match=r"train\.jsonl: train example 'a1' has no 'prompt' field"):
        load_data(cfg)
