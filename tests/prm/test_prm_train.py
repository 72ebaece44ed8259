"""PiCA's PRM training (``fastcredit.prm.train``): the loss against a loop, the AUC against a pair count, the
config and its errors, and a tiny PRM trained on toy trajectories end to end on the CPU: held-out outcome AUC
and pivot gains, a run killed mid-way that resumes to the same numbers, two ranks that train as one, and an
export that PRMScorer scores exactly as the trained model did."""
import json
import math
import os
import random
import sys

import pytest
import torch

from tests.commands import run_main, run_process

from fastcredit.config import load_config
from fastcredit.config.ranges import field_ranges, numeric_keys
from fastcredit.prm.config import PRMTrainConfig
from fastcredit.prm.data import LabelledTrajectory, read_labelled, write_labelled
from fastcredit.models.prm import prm_loss
from fastcredit.prm.metrics import auc, eval_metrics
from fastcredit.prm.train import main, split_by_question

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loop_prm_loss(z, lens, outcome, pivots, lambda_g, tau_g):
    """PiCA Eqs. 8-10 one trajectory and one turn at a time, float64: ``(loss, final, gold)`` lists."""
    loss, final, gold, start = [], [], [], 0
    for b, n in enumerate(lens):
        f = [1.0 / (1.0 + torch.exp(-z[start + t])) for t in range(n)]
        start += n
        fin = -(outcome[b] * torch.log(f[-1]) + (1 - outcome[b]) * torch.log(1 - f[-1]))
        g = torch.zeros((), dtype=torch.float64)
        for t in range(1, n):  # placeholder t follows turn t; pivots[b][t - 1] labels turn t
            if pivots[b][t - 1]:
                gain = (torch.log(f[t]) - torch.log(f[t - 1])) / tau_g
                g = g - torch.log(1.0 / (1.0 + torch.exp(-gain)))
        loss.append(fin + lambda_g * g)
        final.append(fin)
        gold.append(g)
    return loss, final, gold


def _random_batch(seed, lens):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(sum(lens), generator=g, dtype=torch.float64) * 2.5)
    outcome = torch.randint(0, 2, (len(lens),), generator=g).tolist()
    pivots = [torch.randint(0, 2, (n - 1,), generator=g).tolist() for n in lens]
    return z, outcome, pivots


@pytest.mark.parametrize("lambda_g,tau_g", [(1.0, 0.1), (0.0, 0.1), (2.5, 1.0), (0.3, 0.05)])
def test_loss_matches_the_loop_with_its_gradient(lambda_g, tau_g):
    lens = [1, 4, 2, 6, 3, 5, 2]  # placeholders per trajectory: 1 + turns (a question alone too)
    z, outcome, pivots = _random_batch(int(lambda_g * 10 + tau_g * 100), lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    pivot_P = torch.tensor([p for ps in pivots for p in [0, *ps]])
    w = torch.randn(len(lens), dtype=torch.float64)  # a random upstream gradient
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    loss_B, parts = prm_loss(z1, cu, torch.tensor(outcome), pivot_P, lambda_g, tau_g)
    ref, ref_final, ref_gold = loop_prm_loss(z2, lens, outcome, pivots, lambda_g, tau_g)
    torch.testing.assert_close(loss_B, torch.stack(ref), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(parts["final_B"], torch.stack(ref_final).detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(parts["gold_B"], torch.stack(ref_gold).detach(), rtol=1e-10, atol=1e-12)
    (loss_B * w).sum().backward()
    (torch.stack(ref) * w).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-9, atol=1e-12)
    assert z1.grad[0] != 0 and float(parts["gold_B"].sum()) > 0  # the lone question's f is its f(T)


def test_a_pivot_label_on_a_question_placeholder_is_ignored():
    z, cu, outcome = torch.tensor([0.3, -1.0, 2.0]), torch.tensor([0, 3]), torch.tensor([1.0])
    a, _ = prm_loss(z, cu, outcome, torch.tensor([0, 1, 0]), 1.0, 0.1)
    b, _ = prm_loss(z, cu, outcome, torch.tensor([1, 1, 0]), 1.0, 0.1)
    torch.testing.assert_close(a, b)


def brute_force_auc(score, label):
    pos = [s for s, y in zip(score, label) if y]
    neg = [s for s, y in zip(score, label) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("n,levels,seed", [(2, 5, 0), (7, 3, 1), (200, 10, 2), (501, 1000, 3), (64, 1, 4)])
def test_auc_is_the_pair_count_with_ties_halved(n, levels, seed):
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, levels, (n,), generator=g).double() / levels  # few levels: many ties
    label = torch.randint(0, 2, (n,), generator=g)
    label[0], label[-1] = 0, 1
    assert auc(score, label) == pytest.approx(brute_force_auc(score.tolist(), label.tolist()), abs=1e-12)


def test_auc_extremes():
    assert auc(torch.tensor([0.1, 0.2, 0.9]), torch.tensor([0, 0, 1])) == 1.0
    assert auc(torch.tensor([0.9, 0.2, 0.1]), torch.tensor([0, 0, 1])) == 0.0
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))


def test_eval_metrics_against_a_loop():
    lens = [3, 4, 2, 5, 4, 3]
    z, outcome, pivots = _random_batch(7, lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    m = eval_metrics(z, cu, torch.tensor(outcome, dtype=torch.float64),
                     torch.tensor([p for ps in pivots for p in [0, *ps]]), 1.0, 0.1)
    f = torch.sigmoid(z).tolist()
    gains, labels, start = [], [], 0
    for b, n in enumerate(lens):
        gains += [math.log(f[start + t]) - math.log(f[start + t - 1]) for t in range(1, n)]
        labels += pivots[b]
        start += n
    piv = [x for x, y in zip(gains, labels) if y]
    non = [x for x, y in zip(gains, labels) if not y]
    assert m["eval/pivot_gain"] == pytest.approx(sum(piv) / len(piv), rel=1e-9)
    assert m["eval/nonpivot_gain"] == pytest.approx(sum(non) / len(non), rel=1e-9)
    assert m["eval/pivot_auc"] == pytest.approx(brute_force_auc(gains, labels), rel=1e-9)
    last = [f[int(c) - 1] for c in cu[1:]]
    assert m["eval/auc"] == pytest.approx(brute_force_auc(last, outcome), rel=1e-9)
    assert m["eval/f0_mean"] == pytest.approx(sum(f[int(c)] for c in cu[:-1]) / len(lens), rel=1e-9)
    ref = loop_prm_loss(z, lens, outcome, pivots, 1.0, 0.1)[0]
    assert m["eval/loss"] == pytest.approx(float(sum(ref)) / len(lens), rel=1e-9)


def test_held_out_split_keeps_every_row_and_no_question_in_both():
    rows = [LabelledTrajectory(f"q{i % 37}", [{"action": "a", "observation": ""}], i % 2, [0], sample=i)
            for i in range(150)]
    train, test = split_by_question(rows, 0.2, seed=3)
    assert not {r.question for r in train} & {r.question for r in test}
    assert len({r.question for r in test}) == round(37 * 0.2) and len(train) + len(test) == 150
    assert split_by_question(rows, 0.2, seed=3) == (train, test)


def test_every_number_has_a_range_and_the_presets_load():
    assert sorted(numeric_keys(PRMTrainConfig)) == sorted(field_ranges(PRMTrainConfig))
    toy = load_config(os.path.join(ROOT, "configs", "prm.yaml"), root=PRMTrainConfig)
    qwen = load_config(os.path.join(ROOT, "configs", "prm_qwen.yaml"), root=PRMTrainConfig)
    assert toy.model.backbone == "tiny" and qwen.optim.lr == 5e-6 and qwen.optim.batch_size == 256
    assert qwen.prm.placeholder == "<|vision_start|>" and qwen.data.max_tokens == 32768


@pytest.mark.parametrize("override,named", [
    ("optim.lrr=1", "unknown key 'optim.lrr'; did you mean 'optim.lr'"),
    ("prm.tau_g=0", "prm.tau_g must lie in (0, inf)"),
    ("optim.betas=[0.9]", "optim.betas must be two numbers"),
    ("data.train_path=/nonexistent/train.parquet", "data.train_path: /nonexistent/train.parquet does not exist"),
    ("model.backbone=/nonexistent/model", "model.backbone: /nonexistent/model does not exist"),
])
def test_a_bad_config_exits_2_naming_the_key(capsys, override, named):
    assert main(["--config", os.path.join(ROOT, "configs", "prm.yaml"), override]) == 2
    assert named in capsys.readouterr().err


def test_a_bad_data_file_exits_2_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    assert main([f"data.train_path={bad}", "data.test_path=null"]) == 2
    assert f"{bad}: not a readable parquet file" in capsys.readouterr().err
    rows = [LabelledTrajectory("q", [{"action": "a", "observation": ""}], 1, [1])]
    write_labelled(rows, str(tmp_path / "ok.parquet"))
    assert main([f"data.train_path={tmp_path / 'ok.parquet'}", f"data.test_path={tmp_path / 'none.parquet'}"]) == 2
    assert "data.test_path" in capsys.readouterr().err


# TOY DATA: a noisy-oracle policy on the toy world, labelled by rule. A stand-in for
# `python -m fastcredit.prm.label` (its scripted policy is the package's version): swap it for that
# command's output when it lands. Each hop searches its gold sub-query with probability P_GOLD, else the
# same relation of a random other entity; observations are the real retriever's (MiniLM, top 2); a turn is
# a pivot when its search retrieved a gold passage of a hop not found before (toyqa.hops_found); the answer
# is gold (outcome 1) iff the last hop's fact was found, and a turn quotes a fact only when it read it.
P_GOLD, SAMPLES = 0.6, 3


def toy_labelled_trajectories(folder: str) -> tuple[str, str]:
    from fastcredit.data.toyqa import fact_sentence, hops_found, question_hops
    from fastcredit.data.toyworld import ToyWorldConfig, generate_world, write_world
    from fastcredit.retrieval.observation import format_observation
    from fastcredit.retrieval.retriever import open_retriever

    world = generate_world(ToyWorldConfig(num_people=100, num_cities=20, num_countries=6, num_universities=8,
                                          num_companies=30, num_bands=12, num_questions=200, test_fraction=0.2))
    write_world(world, folder)
    retriever = open_retriever(corpus=os.path.join(folder, "corpus.jsonl"), encoder="minilm", device="cpu",
                               progress=False)
    rng, names = random.Random(0), sorted(world.entities)
    plans = []
    for split in ("train", "test"):
        for q in world.split(split):
            for s in range(SAMPLES):
                queries = [h["query"] if rng.random() < P_GOLD else
                           h["query"].replace(h["subject"], rng.choice([n for n in names if n != h["subject"]]))
                           for h in question_hops(q)]
                plans.append((split, q, s, queries, rng.choice(names)))
    unique = sorted({x for p in plans for x in p[3]})
    hits = dict(zip(unique, retriever.search(unique, 2)))  # one batched search
    rows = {"train": [], "test": []}
    for split, q, s, queries, wrong in plans:
        hops, turns, pivots, read = question_hops(q), [], [], ""
        found = [False] * len(hops)
        for j, (hop, query) in enumerate(zip(hops, queries)):
            now = hops_found(q, [h.id for h in hits[query]])
            pivots.append(int(any(a and not b for a, b in zip(now, found))))
            found = [a or b for a, b in zip(now, found)]
            turns.append({"action": f"<think>{read} I need to find {query}.</think>\n<search> {query} </search>",
                          "observation": format_observation(h.contents for h in hits[query])})
            read = " " + fact_sentence(hop) if now[j] else ""
        answer = q.golden_answers[0] if found[-1] else wrong
        turns.append({"action": f"<think>{read} The answer is {answer}.</think>\n<answer> {answer} </answer>",
                      "observation": ""})
        rows[split].append(LabelledTrajectory(q.question, turns, int(found[-1]), pivots + [0], "toyworld",
                                              list(q.golden_answers), answer, s, "rule"))
    return tuple(write_labelled(rows[k], os.path.join(folder, f"{k}.parquet")) for k in ("train", "test"))


# Kills the run (SIGKILL, as a crash would) inside its KILL_AT_SAVE-th checkpoint, before `latest` moves.
KILLER = """import os, signal, sys
import fastcredit.distributed.checkpoint as checkpoint
from fastcredit.distributed.process_group import exit_process
from fastcredit.prm.train import main
calls, write_latest = [0], checkpoint.write_latest
def die_at_nth(root, name):
    calls[0] += 1
    if calls[0] == int(os.environ["KILL_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    write_latest(root, name)
checkpoint.write_latest = die_at_nth
exit_process(main(sys.argv[1:]))
"""


def train(data, out, *extra, entry=None, env=None, check=True, resume=False):
    """The PRM trainer: its ``main`` in this process, or ``python *entry`` as a process (a killer script, torchrun)."""
    args = [*(["--resume"] if resume else []), "--config", os.path.join(ROOT, "configs", "prm.yaml"),
            f"data.train_path={data[0]}", f"data.test_path={data[1]}", f"logging.output_dir={out}",
            "optim.micro_batch_tokens=1024", "logging.checkpoint_every=10", "logging.progress=false", *extra]
    # one torch thread in every run, in this process or a killer's: the runs' numbers are compared to 1e-6, and
    # float sums follow the thread count
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    if entry is None:
        proc = run_main("fastcredit.prm.train", args, env=env)
    else:
        proc = run_process([sys.executable, *entry, *args], timeout=600, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def step_rows(out, key="loss"):
    """``{step: row}`` of the run's metrics.jsonl rows that hold ``key`` (a step's own, or a held-out evaluation's);
    no step twice (a resumed run cuts the lines after its checkpoint)."""
    rows = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if key in r]
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows}), out
    return {r["step"]: r for r in rows}


def final_metrics(out):
    return {k: v for k, v in json.load(open(os.path.join(out, "eval.json")))["metrics"].items() if k != "time/eval"}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return toy_labelled_trajectories(str(tmp_path_factory.mktemp("prm_toy")))


@pytest.fixture(scope="module")
def trained(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prm_runs") / "a")
    return out, train(toy, out)


def test_a_tiny_prm_learns_outcomes_and_pivots(toy, trained):
    out, proc = trained
    train_rows, test_rows = read_labelled(toy[0]), read_labelled(toy[1])
    assert not {r.question for r in train_rows} & {r.question for r in test_rows}
    assert 0.3 < sum(r.outcome for r in train_rows) / len(train_rows) < 0.8  # both labels are common
    m = final_metrics(out)
    assert m["eval/auc"] >= 0.8, m
    assert m["eval/pivot_gain"] > m["eval/nonpivot_gain"] + 0.2, m
    assert m["eval/pivot_auc"] > 0.55, m
    rows = step_rows(out)
    steps = 4 * math.ceil(len(train_rows) / 16)  # configs/prm.yaml: 4 epochs of 16 trajectories
    assert sorted(rows) == list(range(1, steps + 1))
    assert rows[steps]["loss"] < 0.5 * rows[1]["loss"]
    evals = step_rows(out, "eval/auc")  # every 30 steps (configs/prm.yaml) and the final one
    assert sorted(evals) == [*range(30, steps, 30), steps] and evals[steps]["eval/auc"] == m["eval/auc"]
    assert all(math.isfinite(r["grad_norm"]) and r["trajectories_per_s"] > 0 for r in rows.values())
    assert rows[1]["lr"] < rows[10]["lr"] and rows[steps]["lr"] < rows[10]["lr"]  # warm-up, then cosine
    assert "held-out AUC" in proc.stdout and os.path.exists(os.path.join(out, "curves.png"))
    print(f"\ntoy PRM: {len(train_rows)} train / {len(test_rows)} held-out trajectories, {steps} steps: {m}")


def test_the_export_scores_as_the_trained_model(toy, trained):
    from fastcredit.models.prm import load_prm
    from fastcredit.judges.prm import PRMScorer

    out = trained[0]
    scorer = PRMScorer.load(os.path.join(out, "export"), "cpu", micro_batch_tokens=700)
    rows = read_labelled(toy[1])
    got = scorer.score_texts([(r.question, r.turn_texts()) for r in rows])
    want = [json.loads(line) for line in open(os.path.join(out, "eval_scores.jsonl"))]
    assert [w["question"] for w in want] == [r.question for r in rows]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), torch.tensor(w["f"], dtype=torch.float64), rtol=0, atol=2e-6)
    _, _, meta = load_prm(os.path.join(out, "export"))
    assert meta["placeholder"] == "<|vision_start|>" and meta["checkpoint"].endswith("step_%06d" % len(step_rows(out)))


def test_a_killed_run_resumes_to_the_same_numbers(toy, trained, tmp_path):
    a, b = trained[0], str(tmp_path / "b")
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    proc = train(toy, b, entry=(str(killer),), env={"KILL_AT_SAVE": "3"}, check=False)
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert open(os.path.join(b, "checkpoints", "latest")).read().strip() == "step_000020"
    assert max(step_rows(b)) == 30  # step 30 ran and was logged; its checkpoint never finished
    # Resumed from step 20, it replays steps 21-30 and runs on until a second kill inside step 40's save: twenty
    # steps after the resume (data order, RNG, optimizer, LR schedule, the step-30 held-out evaluation) must be the
    # uninterrupted run's.
    proc = train(toy, b, entry=(str(killer),), env={"KILL_AT_SAVE": "2"}, check=False, resume=True)
    assert proc.returncode == -9 and "resumed from" in proc.stdout and "step_000020" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    ra, rb = step_rows(a), step_rows(b)
    assert sorted(rb) == list(range(1, 41))
    for step in rb:
        for key in ("loss", "loss_final", "loss_gold", "grad_norm", "lr"):
            assert rb[step][key] == pytest.approx(ra[step][key], rel=1e-6, abs=1e-9), (step, key)
    ea, eb = step_rows(a, "eval/auc")[30], step_rows(b, "eval/auc")[30]
    assert {k: v for k, v in eb.items() if k.startswith("eval/")} == pytest.approx(
        {k: v for k, v in ea.items() if k.startswith("eval/")}, rel=1e-6, abs=1e-9)


def test_resuming_on_other_data_exits_2(toy, trained, tmp_path):
    import shutil

    b = str(tmp_path / "b")
    shutil.copytree(trained[0], b)
    proc = train(toy, b, "optim.batch_size=8", "--resume", check=False)
    assert proc.returncode == 2 and "was trained on" in proc.stderr and "optim.batch_size" in proc.stderr, proc.stderr


def test_two_ranks_train_as_one(toy, trained, tmp_path):
    """torchrun with 2 gloo ranks (FSDP2; each rank its half of every batch, dummy micro-batches where a rank has
    fewer) until the kill at the first save (step 10): the one-process run's losses and gradient norms (every
    update is clipped: a wrong gradient scale would show from step 2 on)."""
    a, c = trained[0], str(tmp_path / "c")
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    proc = train(toy, c, entry=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(killer)),
                 env={"KILL_AT_SAVE": "1", "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode != 0 and os.path.exists(os.path.join(c, "checkpoints", "step_000010"))
    ra, rc = step_rows(a), step_rows(c)
    assert sorted(rc) == list(range(1, 11)), proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in rc:
        # NOTE: the ranks sum in another order; the first steps agree to 1e-7, then Adam amplifies the rounding by
        # about 4-10x a step, by how much depends on the CPU (measured on one AMD EPYC: grad_norm 2.8e-6 at step 7,
        # 2.4e-5 at step 8, 2.7e-4 at step 10; on another 4e-5 by step 10, 7e-4 by step 30). A wrong gradient
        # scale is off by O(1) from step 1 on, so the first five steps keep the tight bound.
        rel = 1e-5 if step <= 5 else 1e-3
        for key in ("loss", "loss_final", "loss_gold", "grad_norm"):
            assert rc[step][key] == pytest.approx(ra[step][key], rel=rel, abs=1e-7), (step, key)


def test_pica_trains_with_the_learned_prm(trained, tmp_path):
    """The RL trainer with judges.prm = the exported PRM: two PiCA steps on the toy world, its f in the step
    rewards (the PRM's own tokenizer reads the policy's text)."""
    out = str(tmp_path / "pica")
    args = ["--config", os.path.join(ROOT, "configs", "debug.yaml"), f"logging.output_dir={out}",
            f"data.world_dir={tmp_path}/world", "data.toy.num_people=80", "data.toy.num_companies=20",
            "data.toy.num_questions=60", "eval.questions=0", "credit.estimator=pica",
            f"judges.prm={os.path.join(trained[0], 'export')}"]
    proc = run_main("fastcredit.train", args, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 < r["prm/f0_mean"] < 1.0 and 0.0 < r["prm/f_last_mean"] < 1.0 for r in rows), rows
    assert all(math.isfinite(r["credit/step_reward_mean"]) for r in rows)
