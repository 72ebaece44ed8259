"""The split placement end to end under ``torchrun`` on a CPU (1 training + 1 rollout rank, and in one test 2 rollout
ranks; gloo following NCCL's device rules): k = 0 trains exactly what colocated training trains; k > 0 keeps every
trained turn within its bound; a rank killed with SIGKILL resumes from the last checkpoint with no trained
trajectory lost or trained twice. ``FASTCREDIT_SPLIT_MATRIX=1`` adds every estimator at k = 0, 1, 2 and the vLLM
engine."""
import json
import os
import sys

import pytest

from fastcredit.data.sampler import PromptSampler
from tests.commands import run_main, run_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=4"]
# PPO with the KL in the reward: non-zero advantages, policy and value losses from the second step on, even for the
# untrained debug policy (whose outcome rewards are all 0)
MOVING = ["credit.estimator=ppo", "credit.kl_in_reward=0.05", "optim.total_steps=3"]
SPLIT = ["distributed.placement=split"]
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
WORLD: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _one_world(tmp_path_factory):
    WORLD["dir"] = str(tmp_path_factory.mktemp("world"))
    yield
    WORLD.clear()


def command(out, *overrides, launcher=TORCHRUN, entry=("-m", "fastcredit.train")):
    config = os.path.join(ROOT, "configs", "debug.yaml")
    return [sys.executable, *launcher, *entry, "--config", config, f"logging.output_dir={out}",
            f"data.world_dir={WORLD['dir']}", *SMALL,
            f"warmstart.cache_dir={os.path.join(WORLD['dir'], 'warmstarts')}", *overrides]


def run(out, *overrides, launcher=TORCHRUN, resume=False):
    """The trainer under ``launcher`` (torchrun), or its ``main`` in this process for ``launcher=()``."""
    cmd = command(out, *overrides, launcher=launcher) + (["--resume"] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_process(cmd, timeout=600, env=env) if launcher else run_main("fastcredit.train", cmd[3:], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def step_rows(out) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


def ledger(out) -> list:
    return [json.loads(line) for line in open(os.path.join(out, "trained.jsonl"))]


def check_ledger(out, steps: int, bound: int, n_train=None) -> None:
    """Every step trained once, in order, on the prompts the shared prompt order gives it, all its trajectories,
    no turn older than ``bound`` versions. ``n_train``: training questions (default: the file's world's)."""
    rows = ledger(out)
    assert [r["step"] for r in rows] == list(range(steps))
    n = n_train
    if n is None:
        with open(os.path.join(WORLD["dir"], "train.jsonl")) as f:
            n = sum(1 for line in f if line.strip())
    order = PromptSampler(n, 0)
    for r in rows:
        assert r["prompts"] == order.take(4)  # debug.yaml: 4 prompts a step, 2 samples each
        assert r["trajectories"] == 8
        assert 0 <= r["version_lag_max"] <= bound


def test_staleness_zero_trains_what_colocated_trains(tmp_path):
    colocated, split = str(tmp_path / "colocated"), str(tmp_path / "split")
    run(colocated, *MOVING, launcher=())
    run(split, *MOVING, *SPLIT)
    a, b = step_rows(colocated), step_rows(split)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert abs(a[3]["actor/pg_loss"]) > 1e-5 and a[3]["critic/grad_norm"] > 0  # the losses are not trivially 0
    for step in a:
        keys = [k for k in a[step] if k.startswith(("actor/", "critic/", "credit/", "reward", "em", "offpolicy/"))]
        assert len(keys) > 15
        for k in keys:
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-6, abs=1e-9), (step, k)
        assert b[step]["offpolicy/version_lag_max"] == 0
    check_ledger(split, 3, 0)


def test_two_rollout_ranks_two_steps_ahead_with_partial_rollouts_and_the_critic_switch(tmp_path):
    """One training rank fed by two rollout ranks (their index sharded between them, their batches merged), k = 2,
    weights loaded in flight, CriticSearch's frozen critic (a policy-shaped model) switched into the rollout engines
    and the policy's newest weights back, evaluation every 2 steps."""
    from tools.gpu.gpu_check_train import random_policy

    models, out = str(tmp_path / "models"), str(tmp_path / "run")
    policy, critic = random_policy(models, False, "policy", 0), random_policy(models, False, "critic", 1)
    proc = run(out, *SPLIT, "distributed.rollout_ranks=2", "rollout.max_staleness=2", "rollout.partial=true",
               f"model.policy={policy}", "credit.estimator=criticsearch", "credit.reward=criticsearch",
               "judges.backend=colocated", f"judges.model={critic}", "judges.max_tokens=64", "optim.total_steps=4",
               "eval.every=2", f"data.world_dir={models}/world",
               launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"))
    with open(os.path.join(models, "world", "train.jsonl")) as f:  # this test's own world
        n_train = sum(1 for line in f if line.strip())
    check_ledger(out, 4, 2, n_train=n_train)
    rows = step_rows(out)
    assert all(r["time/colocate/switch_to_critic"] > 0 and r["time/colocate/sync_weights"] > 0 for r in rows.values())
    assert max(r["offpolicy/version_lag_max"] for r in rows.values()) >= 1  # the rollout ran ahead
    stale = [r for r in rows.values() if r["offpolicy/version_lag_max"] > 0]
    assert all(r["offpolicy/stale_token_frac"] > 0 and r["offpolicy/behaviour_weight_mean"] > 0 for r in stale)
    evals = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert sorted(r["step"] for r in evals if "eval/em" in r) == [0, 2, 4]  # before, every 2 steps, after
    assert "held-out EM: " in proc.stdout


def launch_and_kill(out, victim: int, after_step: int, *overrides, resume: bool = False) -> str:
    """Launch the split run; rank ``victim`` SIGKILLs itself at its first phase once the checkpoint of step
    ``after_step`` is on disk (tests/killed_run.py), and torchrun then stops the job; returns the job's output."""
    once = os.path.join(out, "checkpoints", f"step_{after_step:06d}")
    cmd = command(out, *overrides, entry=(os.path.join(ROOT, "tests", "killed_run.py"),))
    proc = run_process(cmd + (["--resume"] if resume else []), timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "KILL_RANK": str(victim), "KILL_ONCE_EXISTS": once})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"killed_run: rank {victim} SIGKILLed" in output, output[-3000:]
    return output


def test_a_killed_rollout_rank_then_a_killed_training_rank_lose_and_repeat_no_trajectory(tmp_path):
    """The rollout rank dies after the step-2 checkpoint, the resumed job's training rank after its next checkpoint;
    a third launch finishes. Every step is trained once, on its own prompts, within the staleness bound."""
    out = str(tmp_path / "run")
    run_args = (*SPLIT, "rollout.max_staleness=1", "optim.total_steps=8", "logging.checkpoint_every=2")
    launch_and_kill(out, 1, 2, *run_args)
    assert ledger(out)[-1]["step"] >= 1  # it had trained up to the checkpoint, maybe past it (batches sent ahead)
    # the training rank may have saved another checkpoint from batches already sent before torchrun stopped it
    newest = max(int(name.split("_")[1]) for name in os.listdir(os.path.join(out, "checkpoints"))
                 if name.startswith("step_") and "." not in name)
    output = launch_and_kill(out, 0, newest + 2, *run_args, resume=True)
    assert f"resumed from {os.path.join(out, 'checkpoints', f'step_{newest:06d}')}" in output
    proc = run(out, *run_args, resume=True)
    assert "resumed from" in proc.stdout
    check_ledger(out, 8, 1)
    assert sorted(step_rows(out)) == list(range(1, 9))  # the metrics were cut back to the checkpoint, no step twice


MATRIX = os.environ.get("FASTCREDIT_SPLIT_MATRIX") == "1"
ESTIMATORS = {
    "grpo": [], "ppo": [], "criticsearch": ["judges.backend=oracle"], "cwgrpo": ["judges.backend=oracle"],
    "pica": ["judges.prm=oracle"], "gigpo": ["credit.gigpo.match=similar"], "igsearch": [],
    "proceed": ["rollout.proceed.enabled=true", "rollout.n_samples=4", "credit.dynamic_sampling.enabled=true",
                "judges.backend=oracle"],
}


@pytest.mark.skipif(not MATRIX, reason="the full matrix (24 torchrun runs) runs with FASTCREDIT_SPLIT_MATRIX=1")
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_every_estimator_at_every_staleness(tmp_path, estimator, k):
    out = str(tmp_path / "run")
    run(out, *SPLIT, f"credit.estimator={estimator}", *ESTIMATORS[estimator], f"rollout.max_staleness={k}",
        f"rollout.partial={'true' if k == 2 else 'false'}", "optim.total_steps=3")
    rows = ledger(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["version_lag_max"] <= k for r in rows)


@pytest.mark.skipif(not MATRIX, reason="vLLM under the split placement runs with FASTCREDIT_SPLIT_MATRIX=1")
def test_vllm_engine_under_the_split_placement(tmp_path):
    pytest.importorskip("vllm")
    out = str(tmp_path / "run")
    run(out, *SPLIT, "rollout.engine=vllm", "rollout.max_staleness=1", "rollout.partial=true", "optim.total_steps=3")
    check_ledger(out, 3, 1)
