"""The training step's credit-accuracy metrics: gold labels from what each search retrieved, a judge's labels
where the questions have no gold hops, nothing without either (fastcredit.trainer.credit_labels)."""
import math
from types import SimpleNamespace

import pytest
import torch

from fastcredit.credit import CreditResult
from fastcredit.data.toyqa import new_hop_turns
from fastcredit.rollout.trajectory import Turn, from_turns
from fastcredit.trainer.credit_labels import credit_accuracy, gold_turn_labels, turn_labels

# A two-hop question: hop 1 stated by passage p1, hop 2 by p2 or p2b.
QUESTION = {"golden_answers": ["x"], "metadata": {"hops": [{"passage_ids": ["p1"]}, {"passage_ids": ["p2", "p2b"]}]}}
PLAIN = {"golden_answers": ["x"], "metadata": {}}  # a real dataset's question: no gold hops
# Per trajectory, each turn's (kind, retrieved passage ids).
EPISODES = [
    [("search", ["p1", "q"]), ("search", ["p1"]), ("search", ["p2b"]), ("answer", [])],  # G W G; succeeds
    [("search", ["q"]), ("search", ["p2"]), ("answer", [])],  # W G; fails
]


def _rollout():
    episodes = [SimpleNamespace(steps=[SimpleNamespace(retrieved_ids=ids) for _, ids in e]) for e in EPISODES]
    batch = from_turns([[Turn([5], kind, [9] if kind == "search" else []) for kind, _ in e] for e in EPISODES],
                       group_id=[0, 0], em=[1.0, 0.0])
    return episodes, batch


def accuracy(batch, reward, episodes, examples, extras, credit) -> dict:
    """The step's two halves: labels where the episodes are, accuracy where the advantages are."""
    return credit_accuracy(batch, reward, extras, credit, turn_labels(batch, reward, episodes, examples, extras))


def test_a_search_is_good_when_it_finds_a_hop_no_earlier_turn_found():
    assert new_hop_turns(QUESTION, [["p1", "q"], ["p1"], ["p2b"], []]) == [True, False, True, False]
    assert new_hop_turns(QUESTION, [["q"], ["p2"]]) == [False, True]
    episodes, _ = _rollout()
    assert gold_turn_labels(episodes, [QUESTION, QUESTION]).tolist() == [1, 0, 1, 0, 0, 1, 0]
    assert gold_turn_labels(episodes, [QUESTION, PLAIN]) is None  # gold on every question, or not at all


def test_the_step_logs_gold_metrics_for_an_estimator_without_a_judge():
    episodes, batch = _rollout()
    # turn advantages: success 0.5 on every turn (GRPO-like); failure: W −0.3, G 0.2, answer −1
    credit = CreditResult(adv_S=torch.tensor([0.5, 0.5, 0.5, 0.5, -0.3, 0.2, -1.0]))
    m = accuracy(batch, torch.tensor([1.0, 0.0]), episodes, [QUESTION, QUESTION], {}, credit)
    # good {0.5, 0.5, 0.2} vs wasted {0.5, −0.3}: 0.5 ties 0.5 and beats −0.3 (1.5, twice); 0.2 beats −0.3 (1):
    # 4 of 6 pairs. Within: trajectory 0 all ties, 0.5; trajectory 1, 1.
    assert m == {"credit/turn_auc": pytest.approx(4 / 6), "credit/turn_auc_within": pytest.approx(0.75),
                 "credit/miscredit_frac/wasted_in_success": 1.0, "credit/miscredit_frac/good_in_failure": 0.0}


def test_without_gold_hops_the_judge_labels_are_used_and_named():
    episodes, batch = _rollout()
    credit = CreditResult(adv_S=torch.tensor([0.5, 0.5, 0.5, 0.5, -0.3, 0.2, -1.0]))
    reward = torch.tensor([1.0, 0.0])
    # the critic calls every search of the success Good (s1 included) and both of the failure's Bad (s5 included)
    critic = torch.tensor([1.0, 1.0, 1.0, math.nan, 0.0, 0.0, math.nan])
    m = accuracy(batch, reward, episodes, [PLAIN, PLAIN], {"critic_label_S": critic}, credit)
    # good {0.5 ×3} beat wasted {−0.3, 0.2}: AUC 1; no trajectory holds both; no wasted search in the success,
    # no good one in the failure
    assert m == {"credit/turn_auc/critic": 1.0}
    assert accuracy(batch, reward, episodes, [PLAIN, PLAIN], {}, credit) == {}  # no labels: no metric
    # gold labels win over the judge's on the toy world
    assert "credit/turn_auc" in accuracy(batch, reward, episodes, [QUESTION, QUESTION], {"critic_label_S": critic},
                                         credit)


def test_episodes_that_do_not_match_the_batch_are_an_error():
    episodes, batch = _rollout()
    with pytest.raises(ValueError, match="must align"):
        turn_labels(batch, torch.tensor([1.0, 0.0]), episodes[:1], [QUESTION], {})


def test_the_steps_searches_are_counted_by_their_gold_label():
    from fastcredit.rollout.trajectory import TurnKind
    from fastcredit.trainer.credit_labels import search_label_metrics

    decoyed = {"golden_answers": ["x"], "metadata": {"hops": [{"passage_ids": ["p1"], "decoy_ids": ["d1"]},
                                                              {"passage_ids": ["p2"], "decoy_ids": ["d2"]}]}}
    turns = [[("search", ["p1"]), ("search", ["d2"]), ("search", ["p1"]), ("answer", [])],  # good harmful wasted
             [("search", ["d1"]), ("search", ["p2"]), ("truncated", ["p1"])]]  # harmful good; a cut turn not counted
    kinds = {"search": TurnKind.SEARCH, "answer": TurnKind.ANSWER, "truncated": TurnKind.TRUNCATED}
    episodes = [SimpleNamespace(steps=[SimpleNamespace(kind=kinds[k], retrieved_ids=ids) for k, ids in e])
                for e in turns]
    assert search_label_metrics(episodes, [decoyed, decoyed]) == {
        "searches/good_per_traj": 1.0, "searches/wasted_per_traj": 0.5, "searches/harmful_per_traj": 1.0}
    assert search_label_metrics(episodes, [decoyed, PLAIN]) == {}  # a real dataset's question: no gold labels
