"""The training prompt (Search-R1's ``make_prefix``, CriticSearch's Prompt 1) and chat wrapping.

    text = apply_chat_template(tokenizer, build_prompt("who wrote hamlet"), enabled="auto")
    ids = prompt_ids(tokenizer, ["who wrote hamlet"], "searchr1", chat_template=False)

Base models get the raw prompt; instruct models get it as one user message followed by
the generation prompt, as Search-R1's veRL dataset does when the tokenizer has a chat
template.
"""
from __future__ import annotations

from typing import Sequence, Union

# NOTE: verbatim from Search-R1's scripts/data_process/nq_search.py (template_type "base"),
# typo "as your want" and the trailing newline included: the released datasets and
# checkpoints were made with this exact text. CriticSearch's Prompt 1 is the same prompt;
# the paper's rendering adds backticks around the tags and drops a comma, the code does not.
SEARCHR1_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between "
    "<information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)
TEMPLATES = {"searchr1": SEARCHR1_TEMPLATE}


def normalize_question(question: str) -> str:
    """Search-R1's question clean-up: strip white space and end with '?'."""
    question = question.strip()
    if not question:
        raise ValueError("cannot build a prompt for an empty question")
    return question if question.endswith("?") else question + "?"


def build_prompt(question: str, template: str = "searchr1") -> str:
    """The raw training prompt for ``question`` (the user message's text)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[template].format(question=normalize_question(question))


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` (or None) carries a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer, prompt: str, enabled: Union[bool, str] = "auto") -> str:
    """The text the policy sees for ``prompt``.

    ``enabled``: ``True`` wraps it as one user message plus the generation prompt (an
    error if the tokenizer has no chat template), ``False`` returns it unchanged (base
    models), ``"auto"`` wraps exactly when the tokenizer has a template.
    """
    if enabled not in (True, False, "auto"):
        raise ValueError(f"enabled must be True, False or 'auto', got {enabled!r}")
    if enabled == "auto":
        enabled = has_chat_template(tokenizer)
    if not enabled:
        return prompt
    if not has_chat_template(tokenizer):
        what = "no tokenizer was given" if tokenizer is None else f"{type(tokenizer).__name__} has no chat template"
        raise ValueError(f"chat wrapping was requested (model.chat_template=true) but {what}; "
                         "set model.chat_template=false for base models")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def row_prompt_text(tokenizer, chat, enabled: Union[bool, str], where: str) -> str:
    """The text of a file's own chat prompt (a Search-R1 parquet row's ``prompt``), as Search-R1's veRL dataset
    makes it: the tokenizer's chat template over the whole list when chat wrapping is on, else the first
    message's content. ``where`` names the row in errors."""
    if chat is None:
        raise ValueError(f"{where}: no 'prompt' field, which data.prompt_source=parquet reads "
                         "(use data.prompt_source=template to build prompts from the question)")
    if not isinstance(chat, list) or not chat or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in chat):
        raise ValueError(f"{where}: field 'prompt' must be a non-empty list of {{\"role\": str, \"content\": str}} "
                         f"messages, got {chat!r:.80}")
    if enabled not in (True, False, "auto"):
        raise ValueError(f"enabled must be True, False or 'auto', got {enabled!r}")
    if enabled is True and not has_chat_template(tokenizer):
        apply_chat_template(tokenizer, "", True)  # raises the error that names the missing template
    if enabled is True or (enabled == "auto" and has_chat_template(tokenizer)):
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return chat[0]["content"]


def example_prompt_ids(tokenizer, examples: Sequence, source: str = "template", template: str = "searchr1",
                       chat_template: Union[bool, str] = False) -> list[list[int]]:
    """The policy's input ids for each QA example: from its question (``source="template"``) or from its file's own
    chat prompt (``source="parquet"``, :func:`row_prompt_text`)."""
    if source == "template":
        return prompt_ids(tokenizer, [ex.question for ex in examples], template, chat_template)
    if source != "parquet":
        raise ValueError(f"unknown data.prompt_source {source!r}; valid: template, parquet")
    texts = [row_prompt_text(tokenizer, ex.prompt, chat_template,
                             f"example {ex.id!r} ({ex.data_source or 'no source'})")
             for ex in examples]
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def prompt_ids(tokenizer, questions: Sequence[str], template: str = "searchr1",
               chat_template: Union[bool, str] = False) -> list[list[int]]:
    """The policy's input ids for each question: ``template``'s prompt, chat-wrapped when configured."""
    out = []
    for q in questions:
        text = apply_chat_template(tokenizer, build_prompt(q, template), enabled=chat_template)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out
