"""The training prompt (Search-R1's ``make_prefix``; CriticSearch's Prompt 1) and chat wrapping."""
from __future__ import annotations

# NOTE: kept verbatim, including Search-R1's "as many times as your want": the released
# checkpoints and datasets were made with this exact text.
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


def build_prompt(question: str, template: str = "searchr1") -> str:
    """The raw training prompt for ``question`` (Search-R1 adds a '?' when missing)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {', '.join(TEMPLATES)}")
    question = question.strip()
    if question and question[-1] != "?":
        question += "?"
    return TEMPLATES[template].format(question=question)


def apply_chat_template(tokenizer, prompt: str, enabled: bool) -> str:
    """Wrap ``prompt`` as one user turn with the generation prompt (instruct models), or return it as is."""
    if not enabled:
        return prompt
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("model.chat_template=true but the tokenizer has no chat template; set it to false for base models")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
