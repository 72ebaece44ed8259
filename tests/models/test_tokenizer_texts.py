"""The tiny policy's tokenizer on the lookup world is fitted without the held-out entities' passages, so no token of a
held-out name is one that training never shows the policy; the chain world's tokenizer sees its whole corpus."""
from fastcredit.config import load_config
from fastcredit.data.build import load_data
from fastcredit.data.toyqa import gold_fact_passages, question_hops
from fastcredit.models.build import held_out_passages, run_tokenizer

LOOKUP = ["data.toy.kind=lookup", "rollout.max_turns=5", "data.toy.num_questions=300", "data.toy.test_fraction=0.2",
          "data.toy.lookup.entities=60", "data.toy.lookup.test_entities=20", "model.tiny_vocab=6000"]


def test_held_out_passages_are_left_out_of_the_lookup_tokenizer(tmp_path):
    cfg = load_config(None, [*LOOKUP, f"data.world_dir={tmp_path / 'world'}"])
    data = load_data(cfg)
    held = held_out_passages(data)
    cited = {pid for ex in data.test for ids in gold_fact_passages(ex) for pid in ids}
    assert held and held == cited and not held & {pid for ex in data.train for ids in gold_fact_passages(ex)
                                                  for pid in ids}
    tok = run_tokenizer(cfg, data, str(tmp_path / "run"))
    seen = set()
    for ex in data.train:  # what training shows: its questions, and the passages of the entities they name
        seen.update(tok(" " + ex.question)["input_ids"])
        for h in question_hops(ex):
            seen.update(tok(f" {h['subject']} has the code {h['answer']}.")["input_ids"])
    names = {h["subject"] for ex in data.test for h in question_hops(ex)}
    # a vocabulary this large merges whole names: fitted to the held-out passages it would hold tokens only they use
    assert all(set(tok(" " + n)["input_ids"]) <= seen for n in names)


def test_the_chain_worlds_tokenizer_reads_every_passage(tmp_path):
    cfg = load_config(None, ["data.toy.num_people=40", "data.toy.num_companies=10", "data.toy.num_questions=30",
                             f"data.world_dir={tmp_path / 'world'}"])
    assert held_out_passages(load_data(cfg)) == set()
