"""Search-R1's turns (``rollout.stop_at_tags: false``): a turn decoded to the token cap is cut and classified as
Search-R1 does (``search_r1/llm_agent/generation.py``): kept up to the first ``</search>`` anywhere, else the first
``</answer>``, else whole; its kind is the first complete ``<search>…</search>`` or ``<answer>…</answer>`` pair of the
kept text. Checked against a reference written here from Search-R1's two functions, on its cases."""
import re

import pytest

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.rollout.actions import INVALID_OBSERVATION, classify_action, classify_searchr1
from fastcredit.rollout.agent import CORRECTIVE, AgentLimits, Episode
from fastcredit.rollout.engines.base import GenOutput, SamplingParams
from fastcredit.rollout.trajectory import TurnKind

KIND = {"search": TurnKind.SEARCH, "answer": TurnKind.ANSWER, None: TurnKind.INVALID}
CASES = [
    # the two: an answer there, which a rule reading how the kept text ends took for a search / an invalid turn
    "<answer>Paris</answer> x <search>where was Ada born</search>",
    "<think>so</think><answer>Paris</answer> and then </search> more",
    # no opening tag anywhere: invalid, even though it ends with a closing one
    "Paris</answer> and then </search>",
    "<think>so</think> Paris </answer>",
    # the first pair wins, of either kind
    "<search>city of Ada</search><search>where was Ada born</search>",
    "<think>x</think><search> a b </search> tail <answer>Paris</answer>",
    "<answer>a <search>b</search> c</answer>",
    "<search>a <answer>b</answer></search>",
    # unclosed or mismatched pairs
    "<answer>Paris",
    "<search>where was Ada born</answer>",
    "<search>where\nwas Ada\nborn</search>",
    # an empty search is a search for the empty string there
    "<search></search>",
    "<search>   </search> x",
    "I think so. Fake <information>x",
]


def searchr1(text: str) -> tuple[str, str, str]:
    """(kept text, action or None, content): _postprocess_responses' cut, then postprocess_predictions' regex."""
    if "</search>" in text:
        kept = text.split("</search>")[0] + "</search>"
    elif "</answer>" in text:
        kept = text.split("</answer>")[0] + "</answer>"
    else:
        kept = text
    m = re.search(r"<(search|answer)>(.*?)</\1>", kept, re.DOTALL)
    return kept, (m.group(1) if m else None), (m.group(2).strip() if m else "")


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(CASES * 20 + [INVALID_OBSERVATION], vocab_size=400)


@pytest.mark.parametrize("text", CASES)
def test_the_kind_query_and_kept_tokens_are_search_r1s(tok, text):
    kept, action, content = searchr1(text)
    assert classify_searchr1(kept) == (KIND[action], content if action == "search" else None)
    e = Episode([1, 2], tok, AgentLimits(max_turns=4, stop_at_tags=False), SamplingParams(max_tokens=200), [3])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    nxt = e.on_action(GenOutput(ids, [-0.5] * len(ids), "length", None))
    assert nxt == {"search": content, "answer": None, None: CORRECTIVE}[action]
    if nxt is not None:
        e.on_observation([5])  # the search's (or the corrective message's) observation finishes the turn
    step = e.steps[-1]
    assert step.kind == KIND[action] and step.action_text == kept
    assert tok.decode(e.turns[-1].action_ids, skip_special_tokens=False) == kept


def test_the_stopped_at_tags_rule_is_unchanged():
    """With stop strings the engine stops at the tag, and the kind follows how the turn ends, as before."""
    stop = GenOutput([], None, "stop", "</search>")
    assert classify_action("<answer>P</answer> x <search>q</search>", stop) == (TurnKind.SEARCH, "q")
    assert classify_action("<search>   </search>", stop) == (TurnKind.INVALID, None)
