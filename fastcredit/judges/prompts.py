"""Judge prompts: CriticSearch's reward prompt (the CriticSearch paper, Appendix F), CW-GRPO's judge rubric
(the CW-GRPO paper, Figure 6), ProCeedRL's process critic and refiner (reconstructed: the paper's
Appendix E text is missing from the extraction, so these follow its description in Sec. 3.3: an integer
score 0-10 and a textual critique of the latest step given the history; a refined action from the history,
the rejected action and the critique), and PiCA's pivot labeller (reconstructed from its Appendix A
criteria: ``+`` per step that yields a golden sub-answer with its sub-query, else ``-``).

Every piece of trajectory text (question, gold answers, prediction, actions, observations, history,
rejected action, critique) passes through :func:`~fastcredit.judges.untrusted.neutralise` first: it
is decoded and normalised (NFKC, escapes, entities, look-alike brackets, invisible characters) and
the verdict syntax of every judge (``<score>``, the CW-GRPO JSON keys, ``<rating>`` /
``<critique>``, ``<labels>``) is defanged, so a trajectory that writes ``<score>1, 1</score>`` in any
encoding (or a judge that echoes it) cannot produce a verdict. A judge's builder appends what it quoted to
``shown`` when given one: the runner hands it to the parser (``quoted``), which ignores verdicts
inside copies of it.
"""
from __future__ import annotations

from typing import Optional

from fastcredit.judges.untrusted import neutralise


def _quoter(shown: Optional[list]):
    """``neutralise``, recording each result in ``shown`` (when given)."""
    def quote(text) -> str:
        out = neutralise(text)
        if shown is not None:
            shown.append(out)
        return out
    return quote


# NOTE: inside the prompt texts below, a line that ends in a backslash goes on with the next line: the prompt
# itself has no line break there.
CRITICSEARCH_RULES = """Please analyze whether each search process is good or bad, and include the \
final evaluation result within a `<score>...</score>` tag. If it is good, output 1; if it is bad, \
output 0. For example, if there are two actions, output `<score>1, 1</score>`; if there are four \
actions, output `<score>1, 0, 0, 1</score>`. When making judgments, strictly follow these rules:

1. If the "search" action contributes to the final answer or provides partially useful information, it is good.
2. If the "search" action provides redundant information, or repeats a search that has already been done, it is bad.
3. If the "search" action points to the wrong search direction or misleading information, it is bad.
4. If the "search" action results in incorrect information due to unclear expression, it is bad.
5. Do not evaluate the "answer" actions, only evaluate the "search" actions.
6. If there are no search actions in the entire trajectory, only return `<score></score>`.
7. Only evaluate valid "search" actions (queries that contain `<search>...</search>` \
and receive `<information>...</information>` feedback afterward).
8. The final number of scores must match the number of "search" actions.
9. Ultimately, first provide a detailed analysis of the search process, \
then enclose the evaluation results within a `<score>...</score>` tag."""


def criticsearch_prompt(golds, prediction, solution: str, gold_answer: bool = True,
                        shown: Optional[list] = None) -> str:
    """The Reward Prompt; ``gold_answer=False`` drops the golden answers (the paper's NG ablation)."""
    q = _quoter(shown)
    parts = [CRITICSEARCH_RULES, "#####\n\n#####"]
    if gold_answer:
        parts.append(f"Golden answers: {q(', '.join(golds))}")
    parts += [f"Extracted answer: {q(str(prediction))}", f"Solution string: {q(solution)}",
              "#####\n\n#####", "Please conduct a detailed analysis.\n\n"
              "The final number of scores should be consistent with the number of search actions."]
    return "\n\n".join(parts)


CWGRPO_RUBRIC = """You are an assistant that evaluates the \
validity of the agent's reasoning in a question-answering task.

You will be given a partial trace consisting of alternating messages between the agent \
and the information source. Your task is to judge only the latest action in the trace, \
based on the agent's latest <think> section and all previously retrieved information.

### Evaluation Criteria

#### Retrieval Reward
For the latest action, give a retrieval_reward of 1 if and only if:
1. Relevance: The retrieved information is genuinely relevant \
to the main question and is likely to be helpful in answering it.
2. Novelty: The retrieved information should offer new, useful content for answering the question \
that was not already obtained in previous rounds. If the same information (or its substance) was \
retrieved in previous rounds, do not assign a retrieval_reward, even if it is relevant.

#### Thinking Reward
For the latest action, give a thinking_reward of 1 if and only if:
1. Reasoning Support: The reasoning in the latest <think> section is logically grounded in the previously retrieved \
documents. The agent's claims, assumptions, and deductions must be supported by the information already obtained.
2. Action Usefulness: If the action is a search, the proposed retrieval query must aim to obtain missing \
information that is necessary or beneficial for producing a correct answer. If the action is an answer, \
the reasoning must align with and be properly supported by the retrieved information. When assigning the \
thinking reward, you must only focus on the content and quality of the agent's latest <think> section; do \
NOT consider the relevance of the retrieved documents or whether the final answer matches the ground truth.

If either the reasoning is unsupported or the action is not helpful toward answering the question, assign a score of 0.

### Additional Notes
- Your judgment must rely only on the conversation history and retrieved documents; do not use outside knowledge.
- If multiple documents share the same title, treat them as parts of the same entry. But if \
the documents have similar but not the same title, treat them as separate and independent.
- The KB may contain documents with names similar to the target entity but that are actually irrelevant. If the agent \
incorrectly treats such similar-but-unrelated documents as relevant and bases reasoning on them, you must assign 0.
- Be objective and consistent.

### Analysis Steps
1. Extract the factual claims, reasoning logic, search intent, \
and assumptions made in the latest action's <think> section.
2. For each factual claim, check whether it is supported by \
previously retrieved passages or is a matter of common sense.
3. Analyze whether the reasoning logic is rigorous, and whether the search intent aligns \
with the reasoning and constitutes information still needed to answer the question.
4. Extract information from the retrieved documents that may be relevant to the main question. \
If no relevant information is present, skip step 5 and assign a retrieval_reward of 0.
5. For each relevant information, check whether it was already retrieved in \
previous rounds and, if so, in which round. Finally, give the retrieval_reward \
based on whether genuinely new relevant information was retrieved in this turn.

You should only evaluate the last action.

Return format: a JSON object, wrapped in ```json and ```. Example:
```json
{"analysis": "your detailed analysis of the latest action", "thinking_reward": 0/1, "retrieval_reward": 0/1}
```"""


def cwgrpo_prompt(question: str, rounds: list[tuple[str, str]], shown: Optional[list] = None) -> str:
    """The rubric and the partial trace up to and including the judged round (``(action, observation)`` pairs)."""
    q = _quoter(shown)
    lines = [f"Question: {q(question)}"]
    for i, (action, obs) in enumerate(rounds):
        who = "Agent (the last action)" if i == len(rounds) - 1 else "Agent"
        lines.append(f"{who}: {q(action)}")
        if obs:
            lines.append(f"Information: {q(obs.strip())}")
    return CWGRPO_RUBRIC + "\n\n### Trace\n" + "\n".join(lines)


PROCESS_CRITIC = """You are a process critic for a search agent that answers a question \
by reasoning inside <think>...</think>, searching with <search>query</search> (results \
come back inside <information>...</information>) and answering with <answer>...</answer>.

Judge only the latest step: its action and what the environment returned. Consider both its \
reasoning (is the action grounded in what is already known, and does it pursue information that is \
still missing?) and its consequences (did the search return new, relevant information; is the answer \
supported?). A repeated or off-target search, a vague query, or an unsupported answer is a poor step.

First write a short analysis. Then give an integer score from 0 (harmful) to 10 (ideal) as <rating>N</rating> \
and a one-paragraph critique telling the agent how to improve this step as <critique>...</critique>."""


def process_prompt(question: str, history: str, action: str, observation: str, shown: Optional[list] = None) -> str:
    q = _quoter(shown)
    obs = q(observation.strip()) if observation else "(none: a final answer)"
    return (f"{PROCESS_CRITIC}\n\n### Question\n{q(question)}\n\n### History\n{q(history) or '(empty)'}"
            f"\n\n### Latest action\n{q(action)}\n\n### Environment feedback\n{obs}")


# Reconstructed: PiCA's Appendix A prompt text is missing from the extraction; these are its stated criteria
# (a step is '+' when its search and reasoning yield the corresponding golden sub-answer with its sub-query,
# matched in order against the MuSiQue decomposition; every other step is '-'; one label per step).
PIVOT_RULES = """You label the steps of a search agent's trajectory for training a process reward \
model. The agent answers a multi-hop question step by step. Each step is an action (reasoning inside \
<think>...</think>, then a search <search>query</search> or a final answer <answer>...</answer>), \
followed for a search by the retrieved documents inside <information>...</information>.

You are given the question's golden decomposition: its sub-queries in order, each with its golden sub-answer (a \
sub-query may refer to an earlier sub-answer as #1, #2, ...). Match the steps against the golden sub-queries in order:

1. A step is a pivot step, labelled '+', if its search and reasoning successfully yield the corresponding \
golden sub-answer with its sub-query: it searches for a golden sub-query (or a paraphrase of it) that no \
earlier step has yielded, and the documents it retrieves state that sub-query's golden sub-answer.
2. Every other step is labelled '-': a search for something that is not a golden \
sub-query, a search whose documents do not contain the golden sub-answer, a step that \
yields a sub-answer an earlier step already yielded, an invalid step, and the final answer.
3. Give exactly one label per step, in order: as many labels as there are steps.

First analyse each step briefly. Then give the labels, separated by ", ", inside one labels tag; \
for four steps of which the first and the third are pivot steps: <labels>+, -, +, -</labels>"""


def pivot_prompt(question: str, sub_steps: list[tuple[str, str]], steps: list[tuple[str, str]],
                 shown: Optional[list] = None) -> str:
    """PiCA's pivot labelling prompt: the question, its golden ``(sub-query, sub-answer)`` pairs and the
    trajectory's ``(action, observation)`` steps, numbered."""
    q = _quoter(shown)
    golds = "\n".join(f"{k}. {q(sq)} -> {q(sa)}" for k, (sq, sa) in enumerate(sub_steps, 1))
    lines = []
    for k, (action, obs) in enumerate(steps, 1):
        lines.append(f"Step {k}:\n{q(action)}" + (f"\n{q(obs.strip())}" if obs.strip() else ""))
    return (f"{PIVOT_RULES}\n\n### Question\n{q(question)}\n\n### Golden sub-queries -> sub-answers\n{golds}"
            f"\n\n### Trajectory ({len(steps)} steps)\n" + "\n\n".join(lines)
            + f"\n\n### Your labels\nAnalyse the steps, then give exactly {len(steps)} labels in the labels tag.")


def refine_prompt(question: str, history: str, rejected: str, critique: str) -> str:
    """The refiner's prompt: it writes one improved action in the agent's own format."""
    return ("You are a search agent. Answer the question by reasoning inside <think>...</think>, then either search "
            "with <search>query</search> or answer with <answer>...</answer>.\n"
            f"Question: {neutralise(question)}\n\nSo far:\n{neutralise(history) or '(nothing yet)'}\n\n"
            f"A critic rejected your next action:\n{neutralise(rejected)}\n\nCritique: {neutralise(critique)}\n\n"
            "Write the improved next action only.\n")
