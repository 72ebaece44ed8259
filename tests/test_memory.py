"""The GPU and host memory budget (fastcredit.trainer.memory) and ``python -m fastcredit.train --memory-report``.

Figures are recomputed here from the formulas written out, never through the helpers under test.
"""
import json
import math
import os
import struct
import subprocess
import sys

import pytest

from fastcredit.trainer import memory
from fastcredit.config import load_config
from fastcredit.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRITIC = os.path.join(ROOT, "configs", "criticsearch.yaml")
GIB = 2 ** 30
Q7B = ["model.policy=models/Qwen2.5-7B", "judges.model=models/Qwen2.5-7B-Instruct"]
WIKI18 = 21_015_324
REPLICATE = ["retrieval.across_ranks=replicate"]  # every rank holds a whole copy of the index
# the training state moved to the host while the engines work, as the figures below count it (distributed.offload_state
# auto keeps it on the GPU wherever the plan fits it: tests/trainer/test_offload_auto.py)
MOVE = ["distributed.offload_state=true"]


def test_presets_hold_the_public_configs_and_their_exact_counts():
    q3, q7 = memory.PRESETS["qwen2.5-3b"], memory.PRESETS["qwen2.5-7b"]
    assert (q3.hidden, q3.layers, q3.heads, q3.kv_heads, q3.intermediate, q3.vocab, q3.tied) == \
        (2048, 36, 16, 2, 11008, 151936, True)
    assert (q7.hidden, q7.layers, q7.heads, q7.kv_heads, q7.intermediate, q7.vocab, q7.tied) == \
        (3584, 28, 28, 4, 18944, 152064, False)
    # The exact parameter counts agree with the architecture (q/k/v biases, SwiGLU, two norms a layer).
    for p in memory.PRESETS.values():
        assert p.formula_params() == p.params, p.name
    h, kv, i = 2048, 2 * 128, 11008
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    assert q3.params == 36 * layer + 151936 * h + h == 3_085_938_688


def test_lookup_by_name_folder_and_tiny(tmp_path):
    cfg = load_config(CRITIC)
    assert memory.lookup_shape("models/Qwen2.5-3B", "model.policy").params == 3_085_938_688
    assert memory.lookup_shape("/x/qwen2.5-7b-INSTRUCT", "judges.model").params == 7_615_616_512
    tiny = memory.lookup_shape("tiny", "model.policy", cfg.model)
    assert (tiny.hidden, tiny.layers, tiny.heads, tiny.vocab, tiny.intermediate) == (128, 2, 4, 2000, 256)
    with pytest.raises(memory.ShapeError, match="model.policy='models/Mystery-9B'"):
        memory.lookup_shape("models/Mystery-9B", "model.policy")
    assert main(["--config", CRITIC, "--memory-report", "model.policy=models/Mystery-9B"]) == 2


def _fake_model(folder, tensors: dict, config: dict) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for n, (name, shape) in enumerate(tensors.items()):
        header = {"__metadata__": {"format": "pt"},
                  name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 2 * math.prod(shape)]}}
        blob = json.dumps(header).encode()
        # only the header: the tensors' bytes are absent, so reading them would fail
        (folder / f"model-{n:05d}.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_shape_from_a_folder_counts_params_from_safetensors_headers(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False}
    _fake_model(tmp_path / "m", {"a.weight": [1000, 64], "b.weight": [7, 11, 13]}, config)
    s = memory.ModelShape.from_folder(str(tmp_path / "m"))
    assert s.params == 1000 * 64 + 7 * 11 * 13
    assert (s.layers, s.hidden, s.kv_heads, s.head_dim, s.tied, s.name) == (3, 64, 2, 16, False, "m")
    assert memory.kv_bytes_per_token(s) == 2 * 3 * 2 * 16 * 2
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "config.json").write_text(json.dumps(config))  # no weights: the formula
    assert memory.ModelShape.from_folder(str(tmp_path / "n")).params == memory.ModelShape.from_folder(
        str(tmp_path / "n")).formula_params()
    assert memory.lookup_shape(str(tmp_path / "m"), "model.policy").params == 1000 * 64 + 7 * 11 * 13


def _hand_plan(p, layers, hidden, heads_kv, inter, vocab, tied, index_rows=WIKI18):
    """Every component of an 8 x 80 GiB plan with (``index_rows`` of) the wiki-18 e5 flat fp16 index, written out."""
    W, T, total = 8, 16384, 80 * GIB
    kvd = heads_kv * 128
    layer = hidden * hidden + hidden + 2 * (hidden * kvd + kvd) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    res = {"context": GIB, "index": index_rows * 768 * 2, "search": 2 * 2 ** 27 * 2, "encoder": 109_482_240 * 2}
    util = math.floor((total - sum(res.values()) - 2 * GIB) / total * 100) / 100
    kv = int(util * total) - 2 * p - 2 * GIB
    train = {"policy": 16 * p // W, "reference": 2 * p // W, "asleep": GIB // 2,
             "gather": (2 * layer + (p - layers * layer)) * 2,
             "activations": layers * T * hidden * 2 + 2 * T * (8 * hidden + 2 * kvd + 4 * inter) * 2 + T * hidden * 8}
    return res, util, kv, kv // (2 * layers * kvd * 2), train, {"weights": 2 * p, "stream": vocab * hidden * 6}


@pytest.mark.parametrize("across", ["replicate", "shard"])
@pytest.mark.parametrize("size", ["3B", "7B"])
def test_qwen_plans_on_8_x_80_gib_match_the_hand_computation(size, across):
    overrides = (Q7B if size == "7B" else []) + [f"retrieval.across_ranks={across}", *MOVE]
    plan = memory.plan(load_config(CRITIC, overrides), gpu_gib=80, gpus=8)
    rows = WIKI18 if across == "replicate" else -(-WIKI18 // 8)  # shard: 2,626,916 rows a rank
    if size == "3B":
        hand = _hand_plan(3_085_938_688, 36, 2048, 2, 11008, 151936, True, rows)
    else:
        hand = _hand_plan(7_615_616_512, 28, 3584, 4, 18944, 152064, False, rows)
    res, util, kv, kv_tokens, train, sync = hand
    assert plan.utilization == pytest.approx(util)
    assert plan.phases["rollout"] == {**res, "weights": sync["weights"], "vllm": 2 * GIB, "kv": kv}
    assert plan.phases["judge"] == plan.phases["rollout"]  # the critic has the policy's shape, same KV cache
    assert plan.phases["train"] == {**res, **train}
    assert plan.phases["sync"] == {**res, "asleep": GIB // 2, "policy": train["policy"], **sync}
    assert plan.kv_tokens == kv_tokens
    assert plan.kv_tokens_step == 128 // 8 * 5 * (4096 + 4096)
    assert plan.ok
    if across == "shard":
        assert plan.problems == [] and any("split over the 8 ranks" in n for n in plan.notes)
    elif size == "3B":  # the figures docs/gpu.md quotes
        assert round(plan.total("train") / GIB, 1) == 45.8 and util == 0.57
        assert plan.problems == []
    else:
        assert any("vLLM will queue" in q for q in plan.problems)


def test_value_model_and_offload_and_index_overrides():
    plan = memory.plan(load_config(os.path.join(ROOT, "configs", "searchr1_ppo.yaml")), 80, 8)
    p, h = 3_085_938_688, 2048
    assert plan.phases["train"]["value"] == 16 * (p + h + 1) // 8  # tied: the backbone and a scalar head
    assert plan.phases["sync"]["value"] == plan.phases["train"]["value"]
    off = memory.plan(load_config(os.path.join(ROOT, "configs", "searchr1_ppo.yaml"),
                                  ["distributed.cpu_offload=true"]), 80, 8)
    assert off.phases["train"]["policy"] == off.phases["train"]["value"] == 0
    small = memory.plan(load_config(CRITIC, REPLICATE), 80, 8, index_rows=1000, index_dim=64)
    assert small.phases["train"]["index"] == 1000 * 64 * 2
    small = memory.plan(load_config(CRITIC), 80, 8, index_rows=1000, index_dim=64)  # shard: 125 rows a rank
    assert small.phases["train"]["index"] == 125 * 64 * 2
    cpu = memory.plan(load_config(CRITIC, ["retrieval.device=cpu"]), 80, 8)
    assert "index" not in cpu.phases["train"] and "encoder" not in cpu.phases["train"]


def test_without_colocation_nothing_sleeps_and_the_hf_engine_has_no_share():
    plan = memory.plan(load_config(CRITIC, ["distributed.colocate=false"]), 80, 8)
    assert plan.phases["rollout"]["policy"] == 16 * 3_085_938_688 // 8
    assert plan.phases["train"]["kv"] == plan.phases["rollout"]["kv"] and "asleep" not in plan.phases["train"]
    debug = memory.plan(load_config(os.path.join(ROOT, "configs", "debug.yaml")), 80, 1)
    assert debug.utilization is None and debug.ok and "index" not in debug.phases["train"]


def test_a_kept_training_state_sits_beside_the_engine_which_still_sleeps():
    keep = ["distributed.offload_state=false", "rollout.gpu_memory_utilization=0.5"]
    plan = memory.plan(load_config(CRITIC, keep), 80, 8)
    moved = memory.plan(load_config(CRITIC, ["rollout.gpu_memory_utilization=0.5", *MOVE]), 80, 8)
    assert plan.phases["rollout"]["policy"] == 16 * 3_085_938_688 // 8 and "policy" not in moved.phases["rollout"]
    assert "reference" in plan.phases["sync"] and "reference" not in moved.phases["sync"]
    assert "asleep" in plan.phases["train"]  # unlike colocate=false, the engine still sleeps for training
    assert any("offload_state=false" in n for n in plan.notes)
    for phase in ("rollout", "judge"):
        assert not {"offloaded", "reference"} & set(plan.host.phases[phase]), phase
        assert "offloaded" in moved.host.phases[phase]


def test_index_rows_come_from_the_faiss_header(tmp_path):
    path = tmp_path / "x.index"
    rows, dim = 5000, 32
    # IndexFlatIP layout: fourcc, int32 d, int64 ntotal, two int64 dummies, uint8 is_trained, int32 metric, count
    path.write_bytes(b"IxFI" + struct.pack("<iqqqBiQ", dim, rows, 0, 0, 1, 0, rows * dim))  # no vectors: not read
    assert memory.index_header(str(path)) == (rows, dim)
    plan = memory.plan(load_config(CRITIC, [f"retrieval.index={path}"]), 80, 1)
    assert plan.phases["train"]["index"] == rows * dim * 2


def test_num_shards_spread_one_process_not_torchrun_ranks():
    one = memory.plan(load_config(CRITIC, ["retrieval.num_shards=4"]), 80, 1)
    assert one.phases["train"]["index"] == 21_015_324 * 768 * 2 // 4  # one process over 4 GPUs: a quarter each
    ranks = memory.plan(load_config(CRITIC, ["retrieval.num_shards=4", *REPLICATE]), 80, 8)
    assert ranks.phases["train"]["index"] == 21_015_324 * 768 * 2  # 4 quarters from 4 ranks land on each GPU
    split = memory.plan(load_config(CRITIC, ["retrieval.num_shards=4"]), 80, 8)
    assert split.phases["train"]["index"] == 2_626_916 * 768 * 2  # shard: an eighth each, num_shards unused


@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 16])
def test_index_split_across_ranks_per_gpu(gpus):
    """across_ranks=shard (the default): flat fp16 ceil(N / W) x 768 x 2 bytes a GPU; IVF-PQ in CPU memory, the
    centroids and codebooks whole on every rank; HNSW cannot be split."""
    flat = memory.plan(load_config(CRITIC), 80, gpus)
    assert flat.phases["train"]["index"] == -(-WIKI18 // gpus) * 768 * 2
    ivf = memory.plan(load_config(CRITIC, ["retrieval.index_type=ivfpq"]), 80, gpus)
    assert "index" not in ivf.phases["train"]
    nlist, m = int(4 * math.sqrt(WIKI18)), 96  # FAISS's rules of thumb (indexes.factory_string): IVF18337,PQ96x8
    share = -(-WIKI18 // gpus) * (m + 8) + nlist * 768 * 4 + 256 * 768 * 4
    if gpus > 1:
        assert any(f"split over the {gpus} ranks" in n and f"{share / GIB:.1f} GiB per rank, in CPU memory" in n
                   for n in ivf.notes), ivf.notes
    hnsw = memory.plan(load_config(CRITIC, ["retrieval.index_type=hnsw"]), 80, gpus)
    assert hnsw.ok == (gpus == 1)
    if gpus > 1:
        assert "retrieval.across_ranks=replicate" in hnsw.hard[0]
        assert memory.plan(load_config(CRITIC, ["retrieval.index_type=hnsw", *REPLICATE]), 80, gpus).ok


def test_auto_utilization_formula_and_errors():
    u = memory.engine_memory_utilization(60 * GIB, 80 * GIB, 2 * GIB, 6 * GIB, 1 * GIB)
    assert u == 0.72  # (60 - 2) / 80 = 0.725, rounded down
    assert memory.engine_memory_utilization(58.4 * GIB, 80 * GIB, 2 * GIB, GIB, GIB) == 0.70  # 0.705
    with pytest.raises(memory.MemoryBudgetError, match=r"0.10 x 80.0 GiB = 8.0 GiB.*need 9.0 GiB"):
        memory.engine_memory_utilization(10 * GIB, 80 * GIB, 2 * GIB, 8 * GIB, 1 * GIB)
    with pytest.raises(ValueError):  # a ValueError subclass
        memory.engine_memory_utilization(GIB, 80 * GIB, 2 * GIB, 0, 0)
    memory.check_fixed_utilization(0.5, 40 * GIB, 80 * GIB)
    with pytest.raises(memory.MemoryBudgetError,
                       match=r"asks vLLM for 48.0 GiB of the 80.0 GiB GPU, but only 40.0 GiB"):
        memory.check_fixed_utilization(0.6, 40 * GIB, 80 * GIB)


def test_fixed_utilization_and_foreign_critic_are_hard_problems():
    grpo = os.path.join(ROOT, "configs", "searchr1_grpo.yaml")
    plan = memory.plan(load_config(grpo, ["rollout.gpu_memory_utilization=0.7", *REPLICATE]), 80, 8)
    assert not plan.ok and "asks vLLM for 56.0 GiB" in plan.hard[0]
    assert memory.plan(load_config(grpo, ["rollout.gpu_memory_utilization=0.7"]), 80, 8).ok  # an eighth of the index
    foreign = memory.plan(load_config(CRITIC, ["judges.model=models/Qwen2.5-7B-Instruct"]), 80, 8)
    assert not foreign.ok and "judges.backend=http" in foreign.hard[0] and "judge" not in foreign.phases


def test_impossible_config_reports_and_exits_2(capsys):
    rc = main(["--config", CRITIC, "--memory-report", "--gpu-gib", "24", "--gpus=1", *Q7B])
    out = capsys.readouterr().out
    assert rc == 2
    assert "train phase needs 172.8 GiB of a 24 GiB GPU: shard over more GPUs" in out
    assert "ERROR" in out and "OVER" in out
    rc = main(["--config", CRITIC, "--memory-report", "--gpu-gib", "80", "--gpus", "8", "--host-gib", "1024"])
    out = capsys.readouterr().out
    assert rc == 0 and "problems: none" in out and "fits" in out and "OVER" not in out


def test_a_split_placement_is_planned_as_colocated_and_says_so(capsys):
    assert main(["--config", CRITIC, "--memory-report", "--gpu-gib", "80", "--gpus", "8",
                 "distributed.placement=split"]) in (0, 2)
    assert "distributed.placement=split is planned as colocated ranks: an upper bound" in capsys.readouterr().out


def test_report_flags_are_checked(capsys):
    for argv, said in ((["--gpu-gib", "80"], "--gpu-gib only apply with --memory-report"),
                       (["--memory-report", "--gpus", "many"], "argument --gpus: invalid int value: 'many'")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", CRITIC, *argv])
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_the_report_loads_nothing():
    code = ("import sys, time\nt = time.time()\nfrom fastcredit.train import main\n"
            f"rc = main(['--config', {CRITIC!r}, '--memory-report', '--gpu-gib', '80', '--gpus', '8', "
            "'--host-gib', '1024'])\n"
            "import torch.distributed as dist\n"
            "heavy = [m for m in ('fastcredit.trainer.loop', 'fastcredit.trainer.parts', 'vllm', 'transformers',"
            " 'faiss', 'fastcredit.retrieval.indexes') if m in sys.modules]\n"
            "print('RESULT', rc, heavy, dist.is_initialized(), round(time.time() - t, 1))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "WORLD_SIZE": "8"})
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stderr[-2000:]
    _, rc, heavy, group, _ = line[0].split()
    assert (rc, heavy, group) == ("0", "[]", "False")  # no trainer, model code or index; no process group


# ---- host RAM per node (fastcredit.trainer.memory.host); figures written out from its docstring's formulas

P05, P3 = 494_032_768, 3_085_938_688  # Qwen2.5-0.5B and Qwen2.5-3B (their -Instruct critics alike)
SMALL = ["model.policy=models/Qwen2.5-0.5B", "judges.model=models/Qwen2.5-0.5B-Instruct", "retrieval.device=cpu", *MOVE]


def _small_plan(**kw):
    """criticsearch with a 0.5B policy and critic, a 1000 x 64 flat index and the e5-base encoder on the CPU."""
    return memory.plan(load_config(CRITIC, SMALL), 80, 4, index_rows=1000, index_dim=64, **kw)


def test_host_figures_of_a_small_config_by_hand():
    plan = _small_plan(gpus_per_node=2, host_gib=64)
    host = plan.host
    assert (host.ranks_per_node, host.nodes, host.readers) == (2, 2, 1)  # FSDP2 under torchrun: rank 0 reads
    resident = {"process": 2 * GIB,
                "index": 250 * 64 * 4,           # shard: ceil(1000 / 4) rows of fp32 on the CPU = 64,000
                "encoder": 109_482_240 * 4,      # e5-base in fp32 = 437,928,960
                "tokens": 1000 * 140 * 4 + 8 * 1001}  # int32 tokens + int64 offsets = 568,008, once per node
    offloaded, reference, critic = 16 * P05 // 4, 2 * P05 // 4, 2 * P05  # 1,976,131,072; 247,016,384; 988,065,536
    assert host.phases["start-up"] == {**resident, "loaded": 4 * P05, "copy": 4 * P05}  # the reference's deepcopy
    assert host.phases["rollout"] == {**resident, "offloaded": offloaded, "reference": reference, "critic": critic}
    assert host.phases["judge"] == host.phases["rollout"]
    assert host.phases["train"] == {**resident, "critic": critic}  # state and reference on the GPU, level-2 engine
    assert host.phases["sync"] == {**resident, "reference": reference, "critic": critic}
    rank = 2 * GIB + 64_000 + 437_928_960
    assert host.total("start-up") == 2 * rank + 568_008 + 8 * P05  # one reader: 4P read + 4P copied
    assert host.total("rollout") == 2 * (rank + 1_976_131_072 + 247_016_384 + 988_065_536) + 568_008
    assert host.total("train") == 2 * (rank + 988_065_536) + 568_008
    assert host.margin_bytes == 4 * GIB and host.usable_bytes == 60 * GIB  # 5% of 64 GiB is below the 4 GiB floor
    assert plan.ok
    text = memory.format_plan(plan)
    assert "GiB host RAM per node" in text and "64.0 GiB of RAM a node (--host-gib)" in text
    assert f"{(2 * (rank + 1_976_131_072 + 247_016_384 + 988_065_536) + 568_008) / GIB:.1f}" in text


def test_host_total_is_per_rank_times_ranks_per_node_plus_per_node():
    rank = 2 * GIB + 16 * P3 // 8 + 2 * P3 // 8 + 2 * P3  # process, offloaded state, reference shard, pinned critic
    tokens = WIKI18 * 140 * 4 + 8 * (WIKI18 + 1)  # the token store is past 4 GiB: memory-mapped, once per node
    for per_node in (1, 2, 4, 8):
        host = memory.plan(load_config(CRITIC, MOVE), 80, 8, gpus_per_node=per_node).host
        assert (host.ranks_per_node, host.nodes) == (per_node, 8 // per_node)
        assert host.total("rollout") == per_node * rank + tokens
        assert host.node_bytes("rollout", "critic") == per_node * 2 * P3
    assert memory.plan(load_config(CRITIC), 80, 4).host.ranks_per_node == 4  # default: min(gpus, 8)
    assert memory.plan(load_config(CRITIC), 80, 16).host.ranks_per_node == 8


def test_host_over_the_node_is_refused_with_exit_2(capsys):
    rank = 2 * GIB + 16 * P3 // 8 + 2 * P3 // 8 + 2 * P3
    need = 8 * rank + WIKI18 * 140 * 4 + 8 * (WIKI18 + 1)  # rollout on one 8-GPU node: 124.8 GiB
    rc = main(["--config", CRITIC, *MOVE, "--memory-report", "--gpu-gib", "80", "--gpus", "8", "--host-gib", "100"])
    out = capsys.readouterr().out
    assert rc == 2
    assert (f"ERROR: host: the rollout phase needs {need / GIB:.1f} GiB of host RAM per node (8 rank(s) x "
            f"{rank / GIB:.1f} GiB + 11.1 GiB once per node) of 100.0 GiB (95.0 usable, 5.0 GiB kept for the "
            "OS)") in out
    assert "judges.backend=http" in out and "fewer ranks per node (--gpus-per-node)" in out
    assert "the train phase" not in out  # 73.1 GiB fits in 95
    gpu_verdict, host_verdict = [line for line in out.splitlines() if line.startswith("verdict")]
    assert "OVER" not in gpu_verdict and host_verdict.split() == ["verdict", "fits", "OVER", "OVER", "fits", "fits"]
    # two ranks a node fit in 100 GiB: 2 x 14.2 + 11.1
    two = ["--config", CRITIC, *MOVE, "--memory-report", "--gpus", "8", "--host-gib", "100", "--gpus-per-node", "2"]
    assert main(two) == 0
    assert main(["--config", CRITIC, "--memory-report", "--gpus", "8", "--gpus-per-node", "9"]) == 2
    assert "--gpus-per-node 9 must be between 1 and --gpus (8)" in capsys.readouterr().err


def test_the_os_margin_is_where_the_node_stops_fitting():
    host = _small_plan().host
    need = host.total("rollout")  # the largest phase; under 76 GiB, so the margin is 4 GiB
    assert need == max(host.total(phase) for phase in host.phases)
    assert _small_plan(host_gib=(need + 4 * GIB) / GIB).ok
    tight = _small_plan(host_gib=(need + 4 * GIB - 1) / GIB)
    assert not tight.ok and tight.hard[0].startswith("host: the rollout phase needs")
    assert _small_plan(host_gib=None).ok and "not checked" in memory.format_plan(_small_plan())


@pytest.mark.parametrize("gpus", [1, 8])
def test_deepspeed_reads_the_policy_on_every_rank_fsdp2_on_rank0(gpus):
    fsdp = memory.plan(load_config(CRITIC), 80, gpus).host
    deepspeed = memory.plan(load_config(CRITIC, ["distributed.engine=deepspeed"]), 80, gpus).host
    assert fsdp.readers == 1 and deepspeed.readers == gpus
    # each reader holds the fp32 policy (4P) and the reference's fp32 deepcopy (4P) at once
    assert deepspeed.total("start-up") - fsdp.total("start-up") == (gpus - 1) * 8 * P3
    assert deepspeed.node_bytes("start-up", "loaded") == gpus * 4 * P3
    assert deepspeed.total("rollout") == fsdp.total("rollout")  # after start-up the two hold the same
    tiny = memory.plan(load_config(os.path.join(ROOT, "configs", "debug.yaml")), 80, gpus).host
    assert tiny.readers == gpus  # the tiny policy is built in code on every rank


def test_the_rank0_rule_is_the_trainers():
    from fastcredit.models.build import loads_on_rank0
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.trainer.memory.host import reads_on_rank0_only

    for config, overrides in ((CRITIC, []), (CRITIC, ["distributed.engine=deepspeed"]),
                              (os.path.join(ROOT, "configs", "debug.yaml"), [])):
        cfg = load_config(config, overrides)
        for gpus in (1, 2, 8):
            assert reads_on_rank0_only(cfg, gpus) == loads_on_rank0(cfg, DistInfo(world_size=gpus)), (overrides, gpus)


def test_host_rows_follow_what_each_setting_moves():
    offload = memory.plan(load_config(CRITIC, SMALL + ["distributed.cpu_offload=true"]), 80, 4).host
    for phase in ("rollout", "judge", "train", "sync"):  # the state lives on the CPU throughout
        assert offload.phases[phase]["cpu_offload"] == 16 * P05 // 4 and "offloaded" not in offload.phases[phase]
    assert "cpu_offload" not in offload.phases["start-up"]  # AdamW's state is made at the first step
    level1 = memory.plan(load_config(CRITIC, SMALL + ["rollout.sleep_level=1"]), 80, 4).host
    assert level1.phases["train"]["engine"] == 2 * P05 and "engine" not in level1.phases["sync"]
    apart = memory.plan(load_config(CRITIC, SMALL + ["distributed.colocate=false"]), 80, 4).host
    assert not {"offloaded", "reference"} & set(apart.phases["rollout"]) and "critic" in apart.phases["rollout"]
    http = memory.plan(load_config(CRITIC, SMALL + ["judges.backend=http"]), 80, 4).host
    assert "critic" not in http.phases["train"] and "judge" not in http.phases
    # a critic of another architecture gets an HF engine of its own, moved to the CPU while it sleeps
    own = memory.plan(load_config(CRITIC, SMALL + ["rollout.engine=hf", "judges.model=models/Qwen2.5-1.5B"]), 80, 4)
    assert own.host.phases["rollout"]["judge_engine"] == 2 * 1_543_714_304
    assert "judge_engine" not in own.host.phases["judge"]
    assert own.host.phases["judge"]["engine"] == own.host.phases["train"]["engine"] == 2 * P05  # the policy's
    hnsw = memory.plan(load_config(CRITIC, ["retrieval.index_type=hnsw", *REPLICATE]), 80, 1).host
    assert hnsw.phases["train"]["index"] == WIKI18 * 768 * 4 + WIKI18 * ((2 * 32 + 1) * 4 + 12)  # vectors + graph


def test_machine_memory_is_read_from_meminfo(tmp_path, capsys, monkeypatch):
    from fastcredit.trainer.memory import request

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684092 kB\nMemFree:        13958988 kB\n")
    assert memory.machine_memory_gib(str(meminfo)) == 24684092 * 1024 / GIB
    assert memory.machine_memory_gib(str(tmp_path / "absent")) is None
    monkeypatch.setattr(request, "local_gpus", lambda: (1, 80.0))  # this machine, with a GPU, is the plan's node
    main(["--config", os.path.join(ROOT, "configs", "debug.yaml"), "--memory-report", "--gpus", "1"])
    out = capsys.readouterr().out
    here = memory.machine_memory_gib()
    assert (f"{here:.1f} GiB of RAM a node (MemTotal of this machine, /proc/meminfo)" in out) if here else \
        "not checked" in out
