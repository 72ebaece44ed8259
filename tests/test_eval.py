"""``fastcredit.eval``: scores as Search-R1's qa_em, the command on the toy world and on a fabricated seven-source
parquet in Search-R1's schema, resuming after an interruption, a run folder evaluated through its exported
checkpoint, and the trainer's periodic evaluation per data source. The held-out scoring itself (questions spread
over sources, the papers' table, the predictions cache) is ``tests/trainer/test_heldout.py``."""
import json
import os
import re
import string
import subprocess
import sys
import zlib
from dataclasses import replace

import pytest

from fastcredit.data.build import load_data
from fastcredit.models.build import run_tokenizer
from fastcredit import eval as E
from fastcredit.config import load_config
from fastcredit.data.loaders import write_searchr1_parquet
from fastcredit.data.toyqa import oracle_actions
from fastcredit.rollout.engines.base import GenOutput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "debug.yaml")
SEVEN = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def searchr1_em(prediction, golds) -> float:
    """Search-R1's qa_em.em_check with its normalize_answer, as written there."""
    def norm(s):
        s = s.lower()
        s = "".join(ch for ch in s if ch not in set(string.punctuation))
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())

    return float(prediction is not None and any(norm(g) == norm(prediction) for g in golds))


# ---------------------------------------------------------------------- the command, scripted policy


class OracleEngine:
    """A policy that plays the toy world's oracle trajectory (search each gold hop, then answer), but answers
    "nobody" on questions whose id hashes to 0 mod 3, so the expected EM of any question set is known.
    Counts the questions it is asked to start and can be told to fail after some."""

    def __init__(self, tokenizer, examples, fail_after=None):
        self.tokenizer, self.by_question = tokenizer, {ex.question: ex for ex in examples}
        self.started, self.fail_after = 0, fail_after

    @staticmethod
    def right(ex) -> bool:
        return zlib.crc32(ex.id.encode()) % 3 != 0

    def _one(self, prompt, params):
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        ex = max((ex for q, ex in self.by_question.items() if q in text), key=lambda ex: len(ex.question))
        turn = text[text.index(ex.question):].count("</information>")  # the prompt's own mention comes before
        if turn == 0:
            self.started += 1
            if self.fail_after is not None and self.started > self.fail_after:
                raise RuntimeError("engine died")
        actions = oracle_actions(ex)
        action = actions[min(turn, len(actions) - 1)][0]
        if turn >= len(actions) - 1 and not self.right(ex):
            action = "<think>I do not know.</think>\n<answer> nobody </answer>"
        ids = self.tokenizer(action, add_special_tokens=False)["input_ids"]
        return GenOutput(ids, [0.0] * len(ids), "stop", None)

    def generate(self, prompts, params):
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [self._one(p, q) for p, q in zip(prompts, params)]

    async def agenerate(self, prompt, params):
        return self._one(prompt, params)

    def close(self):
        pass


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy world, a tiny model folder with its tokenizer, the world's config, and a seven-source parquet."""
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    base = tmp_path_factory.mktemp("eval")
    overrides = [f"data.world_dir={base}/world", f"logging.output_dir={base}/run", "data.toy.num_people=80",
                 "data.toy.num_companies=20", "data.toy.num_questions=60", "rollout.max_turns=4",
                 "rollout.max_obs_tokens=160", "rollout.max_response_tokens=640", "rollout.max_action_tokens=64"]
    cfg = load_config(DEBUG, overrides)
    data = load_data(cfg)
    tok = run_tokenizer(cfg, data, str(base / "run"))
    folder = save_tiny_policy(build_tiny_policy(tok, hidden=32, layers=1, heads=2), tok, str(base / "model"))
    every = data.train + data.test
    seven = [replace(ex, data_source=SEVEN[i % 7]) for i, ex in enumerate(every)]
    write_searchr1_parquet(seven, str(base / "test.parquet"), split="test")
    return {"cfg": cfg, "data": data, "folder": folder, "parquet": str(base / "test.parquet"), "seven": seven,
            "base": base, "overrides": overrides}


def _run(toy, monkeypatch, examples, fail_after=None, **kw):
    engines = []

    def make(kind, folder, tokenizer, cfg, device):
        engines.append(OracleEngine(tokenizer, examples, fail_after))
        return engines[-1]

    monkeypatch.setattr(E, "engine_factory", make)
    return E.evaluate(toy["cfg"], toy["folder"], progress=False, **kw), engines


def test_eval_on_the_toy_world(toy, monkeypatch, tmp_path):
    test = toy["data"].test
    res, engines = _run(toy, monkeypatch, test, out=str(tmp_path / "e"))
    assert engines[0].started == len(test)
    want = sum(OracleEngine.right(ex) for ex in test) / len(test)
    assert 0 < want < 1 and res["sources"] == [{"name": "toyworld", "n": len(test), "em": pytest.approx(want),
                                                "f1": pytest.approx(want), "in_domain": True}]
    preds = [json.loads(x) for x in open(tmp_path / "e" / "predictions.jsonl")]
    assert sorted(p["index"] for p in preds) == list(range(len(test)))
    for p in preds:  # each EM as Search-R1 scores the prediction; the oracle searched every hop
        ex = test[p["index"]]
        assert p["em"] == searchr1_em(p["prediction"], ex.golden_answers) == float(OracleEngine.right(ex))
        assert p["searches"] == len(ex.metadata["hops"]) and p["format_ok"]
    assert json.load(open(tmp_path / "e" / "results.json"))["average"]["em"] == pytest.approx(want)
    assert "| EM | " in open(tmp_path / "e" / "results.md").read()


def test_eval_on_a_seven_source_parquet_in_search_r1s_schema(toy, monkeypatch, tmp_path):
    seven = toy["seven"]
    res, engines = _run(toy, monkeypatch, seven, data=toy["parquet"], limit=35, out=str(tmp_path / "e"),
                        in_domain=("nq", "hotpotqa"))
    assert engines[0].started == 35
    assert [r["name"] for r in res["sources"]] == list(SEVEN) and all(r["n"] == 5 for r in res["sources"])
    assert [r["in_domain"] for r in res["sources"]] == [s in ("nq", "hotpotqa") for s in SEVEN]
    preds = [json.loads(x) for x in open(tmp_path / "e" / "predictions.jsonl")]
    for s in res["sources"]:
        mine = [seven[p["index"]] for p in preds if p["data_source"] == s["name"]]
        assert s["em"] == pytest.approx(sum(OracleEngine.right(ex) for ex in mine) / len(mine))
    ood = [r["em"] for r in res["sources"] if not r["in_domain"]]
    assert res["out_of_domain"]["em"] == pytest.approx(sum(ood) / 5)
    head = open(tmp_path / "e" / "results.md").readline()
    assert head.startswith("| model | nq† | triviaqa* | popqa* | hotpotqa† | 2wikimultihopqa* | musique* "
                           "| bamboogle* |")


def test_an_interrupted_eval_resumes_where_it_stopped(toy, monkeypatch, tmp_path):
    seven, out = toy["seven"], str(tmp_path / "e")
    with pytest.raises(RuntimeError, match="engine died"):  # dies in the second chunk of 10
        _run(toy, monkeypatch, seven, data=toy["parquet"], limit=28, batch=10, out=out, fail_after=15)
    assert len(open(os.path.join(out, "predictions.jsonl")).readlines()) == 10
    res, engines = _run(toy, monkeypatch, seven, data=toy["parquet"], limit=28, batch=10, out=out)
    assert engines[0].started == 28 - 10
    full, _ = _run(toy, monkeypatch, seven, data=toy["parquet"], limit=28, out=str(tmp_path / "full"))
    assert res["sources"] == full["sources"]
    with pytest.raises(E.ConfigError, match="limit"):  # another question set: refused, not mixed in
        _run(toy, monkeypatch, seven, data=toy["parquet"], limit=21, out=out)


def _ranks_cmd(toy, out: str, started) -> tuple[list, dict]:
    """The two-rank gloo evaluation of tests/eval_ranks.py, the index split between the ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", "eval_ranks.py"), "--model", toy["folder"], "--data", toy["parquet"],
           "--batch", "4", "--out", out, "--config", DEBUG, *toy["overrides"], "retrieval.across_ranks=shard"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ORACLE_DATA": toy["parquet"],
           "STARTED_DIR": str(started)}
    return cmd, env


def _torchrun(cmd: list, env: dict, timeout: float = 600):
    from tests.commands import run_process  # here: tests/eval_ranks.py imports this module with tests/ as its folder

    return run_process(cmd, timeout=timeout, env=env)


def test_eval_under_torchrun_splits_the_questions_and_a_killed_rank_resumes_its_shard_only(toy, monkeypatch,
                                                                                         tmp_path):
    """Two gloo ranks, each rolling out every second question into its own predictions file, the index split
    between them: rank 1 is killed once both ranks have saved two chunks of 4 (rank 0 holds there: the handshake of
    tests/eval_ranks.py); started again, each rank rolls out only what its shard still lacks, rank 0 merges the
    files, and the table is the one process's."""
    seven, out, started = toy["seven"], str(tmp_path / "e"), tmp_path / "started"
    started.mkdir()
    cmd, env = _ranks_cmd(toy, out, started)
    proc = _torchrun(cmd, {**env, "FAIL_RANK": "1", "FAIL_AFTER": "2", "PEER_RECORDS": "8", "HOLD_AFTER": "2"})
    assert proc.returncode != 0 and not os.path.exists(os.path.join(out, "results.json")), proc.stderr[-3000:]
    assert "eval_ranks: rank" not in proc.stderr, proc.stderr[-3000:]  # no handshake timed out
    shards = [list(range(len(seven)))[r::2] for r in range(2)]
    saved = [[json.loads(x)["index"] for x in open(os.path.join(out, f"predictions.rank{r}.jsonl"))]
             for r in range(2)]
    assert saved == [shards[0][:8], shards[1][:8]]
    for f in started.iterdir():
        f.unlink()
    proc = _torchrun(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [int((started / f"rank{r}").read_text()) for r in range(2)] == [len(shards[r]) - 8 for r in range(2)]
    assert "(2 ranks, each its shard)" in proc.stdout and "questions/s" in proc.stdout
    preds = [json.loads(x)["index"] for x in open(os.path.join(out, "predictions.jsonl"))]
    assert preds == list(range(len(seven))) and not [f for f in os.listdir(out) if ".rank" in f]
    one, _ = _run(toy, monkeypatch, seven, data=toy["parquet"], out=str(tmp_path / "one"))
    assert json.load(open(os.path.join(out, "results.json")))["sources"] == one["sources"]


def test_a_rank_that_fails_ends_the_job_instead_of_leaving_the_others_waiting(toy, tmp_path):
    """Rank 1 raises after its second chunk, once rank 0 has saved its whole shard and so waits in the gather of
    every rank's records: rank 1's process ends at once (its traceback printed) and torchrun stops rank 0. Before,
    rank 1 waited in the retrieval session for rank 0 to leave it, and rank 0 for rank 1's records: both for ever
    (the gloo timeout, 30 minutes)."""
    out, started = str(tmp_path / "e"), tmp_path / "started"
    started.mkdir()
    cmd, env = _ranks_cmd(toy, out, started)
    shard0 = len(range(0, len(toy["seven"]), 2))
    try:
        proc = _torchrun(cmd, {**env, "FAIL_RANK": "1", "FAIL_AFTER": "2", "PEER_RECORDS": str(shard0),
                               "FAIL_MODE": "raise"}, timeout=300)
    except subprocess.TimeoutExpired:  # run_process killed the job's session, its ranks with it
        raise AssertionError("the job hung after one rank failed") from None
    assert proc.returncode != 0 and "rank 1 fails on purpose after 2 chunks" in proc.stderr, proc.stderr[-3000:]
    assert "eval_ranks: rank" not in proc.stderr, proc.stderr[-3000:]
    assert len(open(os.path.join(out, "predictions.rank0.jsonl")).readlines()) == shard0
    assert not os.path.exists(os.path.join(out, "results.json"))


def test_the_command_refuses_bad_input(toy, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # the line itself: a usage error, before anything is read
        E.main(["--data", toy["parquet"]])
    assert exc.value.code == 2 and "the following arguments are required: --model" in capsys.readouterr().err
    assert E.main(["--model", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert E.main(["--model", toy["folder"], "--data", str(tmp_path / "missing.parquet")]) == 2
    assert "missing.parquet" in capsys.readouterr().err
    assert E.main(["--model", toy["folder"], "--step", "3"]) == 2
    assert "run folder" in capsys.readouterr().err


# ------------------------------------------------- a trained run: periodic eval per source, then the command


@pytest.fixture(scope="module")
def run(toy):
    """Two training steps of the debug config on the seven-source parquet (train and test), evaluating every step."""
    base = toy["base"]
    out = str(base / "trained")
    args = ["--config", DEBUG, f"logging.output_dir={out}", "data.source=searchr1",
            f"data.train_path={toy['parquet']}", f"data.test_path={toy['parquet']}",
            f"retrieval.corpus={toy['data'].corpus}", "eval.questions=14", "eval.every=1", "optim.total_steps=2"]
    from tests.commands import run_main  # here: tests/eval_ranks.py imports this module with tests/ as its folder

    proc = run_main("fastcredit.train", args, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_the_trainers_periodic_eval_scores_every_source(run):
    out, proc = run
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r for r in rows if "eval/em" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert {k.split("/")[2] for k in r if k.startswith("eval/em/")} == set(SEVEN)
        assert r["eval/em"] == pytest.approx(sum(r[f"eval/em/{s}"] for s in SEVEN) / 7)
    assert "held-out EM before training:" in proc.stdout and "bamboogle" in proc.stdout


def test_eval_of_a_run_goes_through_its_exported_checkpoint(run, capsys):
    out, _ = run
    assert E.main(["--model", out, "--limit", "7", "--in-domain", "hotpotqa"]) == 0
    printed = capsys.readouterr().out
    assert os.path.exists(os.path.join(out, "exports", "step_000002", "config.json"))
    folder = os.path.join(out, "eval", "test-step000002")
    res = json.load(open(os.path.join(folder, "results.json")))
    assert res["step"] == 2 and [r["n"] for r in res["sources"]] == [1] * 7
    assert [r["name"] for r in res["sources"] if r["in_domain"]] == ["hotpotqa"]
    for p in map(json.loads, open(os.path.join(folder, "predictions.jsonl"))):
        assert p["em"] == searchr1_em(p["prediction"], p["golden_answers"])
    assert "| model" not in printed and "| trained step 2 |" in printed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # save_checkpoint in this one process
def test_predictions_of_an_earlier_save_of_the_step_are_not_mixed_in(run, tmp_path, capsys):
    """The run's step saved again with other weights (a collapse-guard rollback): its export is made again, and the
    predictions the earlier weights left in --out are refused until --fresh."""
    import shutil

    import torch

    from fastcredit.distributed.checkpoint import load_checkpoint, save_checkpoint
    from fastcredit.models.packed import PolicyModel
    from fastcredit.models.build import load_policy
    from transformers import AutoTokenizer

    copy, out = str(tmp_path / "run"), str(tmp_path / "eval")
    shutil.copytree(run[0], copy)
    args = ["--model", copy, "--limit", "7", "--out", out]
    assert E.main(args) == 0
    ckpt = os.path.join(copy, "checkpoints", "step_000002")
    policy = PolicyModel(load_policy(load_config(os.path.join(copy, "config.yaml")),
                                     AutoTokenizer.from_pretrained(os.path.join(copy, "tokenizer"))))
    load_checkpoint(ckpt, {"policy": policy}, {})
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.25)
    save_checkpoint(os.path.join(copy, "checkpoints"), 2, {"policy": policy}, {}, {})
    capsys.readouterr()
    assert E.main(args) == 2
    printed = capsys.readouterr()
    assert "made from another save of step_000002" in printed.out
    assert "holds predictions of another evaluation (checkpoint differ" in printed.err and "--fresh" in printed.err
    assert E.main([*args, "--fresh"]) == 0
