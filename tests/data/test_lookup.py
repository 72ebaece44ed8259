"""The lookup world (fastcredit.data.lookup): disjoint held-out entities, decoys, the answer format, the turn budget,
the labels of hand-built trajectories, and the settings it refuses."""
import json

import pytest

from fastcredit.config import ConfigError, ToyWorldConfig, load_config
from fastcredit.config.toy import LookupWorldConfig, check_toy_world
from fastcredit.credit.rewards import exact_match
from fastcredit.data import toyworld
from fastcredit.data.lookup import (GOOD, HARMFUL, WASTED, gold_query, search_labels, surname_query,
                                    turn_budget)
from fastcredit.data.toyqa import question_hops


def small(**lookup) -> ToyWorldConfig:
    settings = dict(entities=60, test_entities=20, min_k=1, max_k=4, slack=1)
    return ToyWorldConfig(kind="lookup", seed=3, num_questions=110, test_fraction=0.1,
                          lookup=LookupWorldConfig(**{**settings, **lookup}))


@pytest.fixture(scope="module")
def world():
    return toyworld.generate_world(small())


def asked(examples) -> set:
    return {h["subject"] for ex in examples for h in question_hops(ex)}


def test_held_out_entities_are_disjoint_from_the_training_ones(world):
    train, test = asked(world.train), asked(world.test)
    assert train and test and not train & test
    # every name, decoys included, belongs to one split: no training passage names a held-out entity
    for name in test:
        assert world.entities[name]["split"] == "test"
        decoy = world.entities[name].get("decoy")
        assert decoy is None or world.entities[decoy]["split"] == "test"
    assert len(world.test) == 11 and len(world.train) == 99


def test_each_entity_states_its_code_in_a_passage_of_its_own(world):
    for ex in world.train + world.test:
        for h in question_hops(ex):
            (pid,) = h["passage_ids"]
            passage = world.passage(pid)
            assert passage.title == h["subject"] and passage.text == f"{h['subject']} has the code {h['answer']}."
            assert len(h["answer"]) == 3 and h["answer"].isdigit()
            assert h["query"] == gold_query(h["subject"]) == f"{h['subject']} code"


def test_a_decoy_shares_the_surname_and_first_syllable_and_has_another_code(world):
    decoys = [(h["subject"], h["decoy"], h) for ex in world.train + world.test for h in question_hops(ex)]
    assert decoys and all(d is not None for _, d, _ in decoys)  # decoy_fraction 1
    for name, decoy, h in decoys:
        first, last = name.split(" ")
        d_first, d_last = decoy.split(" ")
        assert d_last == last and d_first != first and d_first[:2].lower() == first[:2].lower()
        assert world.entities[decoy]["relations"]["code"] != h["answer"]
        assert surname_query(name) == surname_query(decoy) == f"{last} code"
        # the decoys a careless query can find: every other entity of the surname, the near-identical one included
        namesakes = {n for n in world.entities if n.split(" ")[1] == last and n != name}
        assert {world.passage(pid).title for pid in h["decoy_ids"]} == namesakes and decoy in namesakes


def test_held_out_names_are_new_pairs_of_words_training_names_use(world):
    train_names = [n for n, e in world.entities.items() if e["split"] == "train"]
    train_words = {w for n in train_names for w in n.split(" ")}
    held_out = asked(world.test)
    assert all(set(n.split(" ")) <= train_words for n in held_out)  # no word a training name never shows
    assert not held_out & set(train_names)


def test_the_answer_is_every_code_in_the_questions_order_and_em_checks_it(world):
    ex = next(e for e in world.test if len(question_hops(e)) >= 3)
    codes = [h["answer"] for h in question_hops(ex)]
    assert ex.golden_answers == [", ".join(codes)]
    assert all(h["subject"] in ex.question for h in question_hops(ex))
    assert exact_match(" ".join(codes), ex.golden_answers) == 1.0  # commas do not matter
    assert exact_match(", ".join(reversed(codes)), ex.golden_answers) == 0.0
    assert exact_match(", ".join(codes[:-1]), ex.golden_answers) == 0.0


def test_k_and_the_turn_budget(world):
    ks = {len(question_hops(ex)) for ex in world.train}
    assert ks == {1, 2, 3, 4}
    for ex in world.train + world.test:
        assert turn_budget(ex) == len(question_hops(ex)) + 1 + 1  # K searches, the slack and the answer
        assert ex.metadata["kind"] == "lookup" and ex.metadata["num_hops"] == len(question_hops(ex))


def test_the_same_config_writes_the_same_files_and_reads_them_back(tmp_path, world):
    a, b = tmp_path / "a", tmp_path / "b"
    toyworld.write_world(world, str(a))
    toyworld.write_world(toyworld.generate_world(small()), str(b))
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl", "world.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    back = toyworld.load_world(str(a))
    assert back.config == small() and back.test[0].metadata == world.test[0].metadata
    summary = json.loads((a / "summary.json").read_text())
    assert summary["kind"] == "lookup" and summary["entities"] == {"train": 60, "test": 20}


def test_the_chain_worlds_files_keep_their_config_keys(tmp_path):
    cfg = ToyWorldConfig(num_people=40, num_cities=20, num_countries=6, num_universities=10, num_companies=10,
                         num_bands=10, num_questions=20)
    toyworld.write_world(toyworld.generate_world(cfg), str(tmp_path))
    saved = json.loads((tmp_path / "world.json").read_text())["config"]
    assert "kind" not in saved and "lookup" not in saved  # worlds written before the lookup kind are the same files
    assert toyworld.load_world(str(tmp_path)).config == cfg


def hand_labels(world, ex, turns) -> list:
    """``turns``: per search, the passage ids it retrieved."""
    return search_labels(ex, turns)


def test_labels_of_hand_built_trajectories(world):
    ex = next(e for e in world.test if len(question_hops(e)) >= 2)
    h0, h1 = question_hops(ex)[:2]
    other = next(h for e in world.test for h in question_hops(e) if h["subject"] not in ex.question)
    turns = [h0["passage_ids"],   # finds the first entity
             h0["passage_ids"],   # repeats it
             other["passage_ids"],  # an entity the question does not name
             h1["decoy_ids"],     # the second entity's decoy
             h1["passage_ids"] + h1["decoy_ids"],  # both: the entity is found, so it is good
             h1["decoy_ids"],     # the decoy again, the entity found already: still misleading
             []]                  # an answer turn retrieves nothing
    assert hand_labels(world, ex, turns) == [GOOD, WASTED, WASTED, HARMFUL, GOOD, HARMFUL, WASTED]


def test_a_chain_question_has_no_harmful_turns():
    cfg = ToyWorldConfig(num_people=40, num_cities=20, num_countries=6, num_universities=10, num_companies=10,
                         num_bands=10, num_questions=20, min_hops=2, max_hops=2)
    ex = toyworld.generate_world(cfg).train[0]
    hops = question_hops(ex)
    assert search_labels(ex, [hops[0]["passage_ids"], ["999999"], hops[1]["passage_ids"]]) == [GOOD, WASTED, GOOD]


BAD = [
    (dict(max_k=9), r"lookup.max_k must lie in \[1, 8\], got 9"),
    (dict(min_k=0), r"lookup.min_k must lie in \[1, 8\] \(at most data.toy.lookup.max_k\), got 0"),
    (dict(min_k=4, max_k=3), r"lookup.min_k must be in \[1, lookup.max_k = 3\], got 4"),
    (dict(entities=3, max_k=4), r"lookup.max_k \(4\) is more than the training entities a question can name "
                                r"\(lookup.entities = 3\)"),
    (dict(test_entities=2, max_k=4), r"lookup.max_k \(4\) is more than the held-out entities"),
    (dict(decoy_fraction=1.5), r"lookup.decoy_fraction must lie in \[0, 1\], got 1.5"),
]


@pytest.mark.parametrize("settings, message", BAD)
def test_bad_settings_are_refused_naming_the_key(settings, message):
    cfg = small(**settings)
    with pytest.raises(ConfigError, match=f"^data.toy: {message}"):
        check_toy_world(cfg, "data.toy")
    with pytest.raises(ValueError, match=message):
        toyworld.generate_world(cfg)
    overrides = ["data.toy.kind=lookup", "rollout.max_turns=20"] + [f"data.toy.lookup.{k}={v}"
                                                                    for k, v in {**settings}.items()]
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_too_few_turns_for_k_are_refused_naming_rollout_max_turns():
    with pytest.raises(ConfigError, match=r"rollout.max_turns=5 is too few turns for data.toy.lookup.max_k=4.* "
                                          r"at least 6"):
        load_config(None, ["data.toy.kind=lookup", "data.toy.lookup.max_k=4", "rollout.max_turns=5"])
    cfg = load_config(None, ["data.toy.kind=lookup", "data.toy.lookup.max_k=4", "rollout.max_turns=6"])
    assert cfg.data.toy.lookup.max_k == 4


def test_settings_of_the_other_world_are_refused():
    with pytest.raises(ConfigError, match="max_hops is a chain-world setting"):
        load_config(None, ["data.toy.kind=lookup", "data.toy.max_hops=2", "rollout.max_turns=5"])
    with pytest.raises(ConfigError, match="warmstart.detour_fraction=0.3 is the chain world's"):
        load_config(None, ["data.toy.kind=lookup", "warmstart.detour_fraction=0.3", "rollout.max_turns=5"])
    with pytest.raises(ConfigError, match="warmstart.waste_prob=0.2 .* need data.source=toy with "
                                          "data.toy.kind=lookup"):
        load_config(None, ["warmstart.waste_prob=0.2"])


def test_the_lookup_world_pays_plain_em_by_default():
    from fastcredit.config.credit import outcome_reward

    assert outcome_reward(load_config(None, ["data.toy.kind=lookup", "rollout.max_turns=5"])) == "em"
    assert outcome_reward(load_config(None, [])) == "criticsearch"
    assert outcome_reward(load_config(None, ["data.toy.kind=lookup", "rollout.max_turns=5",
                                             "credit.reward=criticsearch"])) == "criticsearch"
