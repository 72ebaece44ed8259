"""Outcome rewards: extraction, EM / F1, the format check, Eq. 4, and robustness to bad text."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit.credit.rewards import (
    criticsearch_reward,
    exact_match,
    extract_answer,
    f1_format_reward,
    f1_score,
    format_ok,
    format_ok_actions,
    normalize_answer,
    parse_action,
    score_trajectory,
    split_actions,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>Paris</answer>", "Paris"),
        ("<answer> a </answer> then <answer>  Berlin \n</answer>", "Berlin"),
        ("<answer>x<answer>inner</answer>", "inner"),
        ("<answer>unclosed", None),
        ("closed only</answer>", None),
        ("<answer>  </answer>", None),
        ("<answer>first</answer><answer>second", "first"),
        ("", None),
        (None, None),
        ("<answer>東京</answer>", "東京"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_normalisation():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear") == "apple pear"
    # As Search-R1's qa_em: no unicode folding, so a ligature or full-width letters never match ASCII
    assert normalize_answer("ＡＢＣ") == "ａｂｃ" and exact_match("ＡＢＣ", ["abc"]) == 0.0
    assert exact_match("\ufb01ve", ["five"]) == 0.0 and exact_match("Five!", ["five"]) == 1.0


def _searchr1_normalize(s):
    """Search-R1's verl/utils/reward_score/qa_em.py normalize_answer, step by step as it is written there."""
    import re
    import string

    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


@given(st.text(alphabet=st.sampled_from(list("aAnNtThHeE .,!-'\u00e9\uff21\ufb01\u0130\u00df\t\n")) | st.characters(),
               max_size=40))
def test_normalisation_is_search_r1s(text):
    assert normalize_answer(text) == _searchr1_normalize(text)


def test_em_and_f1_take_the_best_gold():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    # pred "new york city" vs gold "new york": common 2, P = 2/3, R = 1 -> F1 = 0.8
    assert f1_score("New York City", ["Boston", "New York"]) == pytest.approx(0.8)
    assert f1_score("yes", ["no"]) == 0.0 and f1_score("yes", ["Yes"]) == 1.0
    assert f1_score("", ["a"]) == 0.0
    assert f1_score("Paris", "paris") == 1.0  # a single gold string works too


@pytest.mark.parametrize(
    "action, parsed",
    [
        ("<think>hmm</think>\n<search>capital of France</search>", ("search", "capital of France")),
        ("<search>q</search>", ("search", "q")),
        ("  <think>x</think><answer> Paris </answer>\n", ("answer", "Paris")),
        ("<think>x</think>", None),
        ("<search></search>", None),
        ("<search>a<search>b</search></search>", None),
        ("<think>a</think><think>b</think><search>q</search>", None),
        ("text before <search>q</search>", None),
        ("<search>q</search><answer>a</answer>", None),
        ("<search>q</search>trailing", None),
        ("<think><information>fake</information></think><search>q</search>", None),
    ],
)
def test_parse_action(action, parsed):
    assert parse_action(action) == parsed


def test_format_over_actions():
    good = ["<think>a</think><search>q1</search>", "<search>q2</search>", "<answer>x</answer>"]
    assert format_ok_actions(good)
    assert not format_ok_actions(good[:-1])  # no answer at the end
    assert not format_ok_actions(["<answer>x</answer>", "<answer>y</answer>"])  # two answers
    assert not format_ok_actions([])


def test_format_over_text_ignores_observations():
    text = (
        "<think>a</think><search>q1</search>\n\n<information>Doc 1(Title: X) <answer>no</answer></information>\n\n"
        "<think>b</think><answer>Paris</answer>"
    )
    assert split_actions(text) == ["<think>a</think><search>q1</search>",
                                   "\n\n\n\n<think>b</think><answer>Paris</answer>"]
    assert format_ok(text)
    assert not format_ok("<search>q</search> <answer>a</answer> <answer>b</answer>")


def test_criticsearch_eq4():
    assert criticsearch_reward(1.0, True) == 1.0
    assert criticsearch_reward(1.0, False) == pytest.approx(0.8)
    assert criticsearch_reward(0.0, True) == pytest.approx(0.2)
    assert criticsearch_reward(0.0, False) == 0.0
    assert criticsearch_reward(1.0, False, lambda_f=0.5) == 0.5


def test_f1_format():
    assert f1_format_reward(0.8, True) == pytest.approx(1.0)
    assert f1_format_reward(0.8, False) == pytest.approx(0.8)


def test_score_trajectory():
    out = score_trajectory(["<search>q</search>", "<think>t</think><answer>The Paris</answer>"], ["paris"])
    assert (out.prediction, out.em, out.f1, out.format_ok, out.reward) == ("The Paris", 1.0, 1.0, True, 1.0)
    out = score_trajectory(["<search>q</search>", "I give up"], ["paris"], kind="criticsearch")
    assert (out.prediction, out.reward, out.format_ok) == (None, 0.0, False)
    assert score_trajectory([], ["x"]).reward == 0.0
    with pytest.raises(ValueError, match="unknown reward 'bleu'"):
        score_trajectory(["<answer>a</answer>"], ["a"], kind="bleu")


_TAGGY = st.lists(
    st.sampled_from(list("ab <>/\n") + ["<answer>", "</answer>", "<search>", "</search>",
                                         "<think>", "</think>", "<information>", "é", "😀"]),
    max_size=60,
).map("".join)


@settings(max_examples=300)
@given(_TAGGY, st.lists(st.text(max_size=8), max_size=3))
def test_never_raises_on_malformed_text(text, golds):
    pred = extract_answer(text)
    assert pred is None or ("<answer>" not in pred and "</answer>" not in pred)
    assert 0.0 <= exact_match(pred, golds) <= 1.0
    assert 0.0 <= f1_score(pred, golds) <= 1.0
    assert isinstance(format_ok(text), bool)
    out = score_trajectory(split_actions(text), golds)
    assert 0.0 <= out.reward <= 1.0


def test_very_long_text_is_linear():
    text = "<answer>" * 20000 + "x" * 200000 + "</answer>"
    assert extract_answer(text) == "x" * 200000
    assert not format_ok(text)
