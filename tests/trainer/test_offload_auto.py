"""distributed.offload_state=auto: the training state stays on the GPU when the memory plan with it kept fits every
phase with the stated margin (10% of the GPU, at least 4 GiB) and, with vLLM, a KV cache that holds a step; it moves
otherwise. The cases of issue 44: the Qwen2.5-0.5B shape on one 80 GB GPU keeps, 7B on one offloads, CriticSearch's
3B on 8 x 80 GB keeps with vLLM's share from the plan. Figures are recomputed from the formulas written out."""
import math
import os
import types

import pytest
import torch

from fastcredit.config import load_config
from fastcredit.train import main
from fastcredit.trainer import memory
from fastcredit.trainer.memory.offload import decide_offload, keep_margin_bytes, local_offload
from fastcredit.trainer.memory.parts import OffloadChoice

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRITIC = os.path.join(ROOT, "configs", "criticsearch.yaml")
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
DESIGN = os.path.join(ROOT, "configs", "searchr1_design.yaml")
GIB = 2 ** 30
H100 = 79.1  # GiB an "80 GB" H100 reports (torch's total_memory)
P05, P3, P7 = 494_032_768, 3_085_938_688, 7_615_616_512
WIKI18_SHARD = -(-21_015_324 // 8)  # the e5 flat index split over 8 ranks: rows a rank


def test_the_half_billion_shape_on_one_80gb_gpu_keeps_the_state_and_the_hf_weights():
    """The issue's search_step: configs/demo.yaml (HF engine) at the Qwen2.5-0.5B shape on one GPU."""
    cfg = load_config(DEMO, ["model.policy=Qwen2.5-0.5B"])
    choice = decide_offload(cfg, H100, 1)
    assert not choice.moves and choice.setting == "auto" and choice.utilization is None
    assert "fits every phase" in choice.reason and "margin 7.9 GiB" in choice.reason  # 10% of 79.1 GiB
    plan = memory.plan(cfg, H100, 1)
    assert plan.offload == choice and choice.line() in plan.notes
    # the state, the reference and the HF engine's weights stay: on the GPU while it trains, off the host
    assert plan.phases["rollout"]["policy"] == 16 * P05 and plan.phases["rollout"]["reference"] == 2 * P05
    assert plan.phases["train"]["weights"] == 2 * P05
    for phase in ("rollout", "judge", "train", "sync"):
        assert not {"offloaded", "reference", "engine"} & set(plan.host.phases.get(phase, {})), phase


def test_seven_billion_on_one_80gb_gpu_offloads():
    cfg = load_config(DEMO, ["model.policy=Qwen2.5-7B"])
    choice = decide_offload(cfg, H100, 1)
    assert choice.moves and "with it kept the rollout phase would need" in choice.reason
    assert memory.plan(cfg, H100, 1).phases["rollout"].get("policy") is None  # planned as it runs: moved
    vllm = decide_offload(load_config(CRITIC, ["model.policy=models/Qwen2.5-7B",
                                               "judges.model=models/Qwen2.5-7B-Instruct"]), H100, 1)
    assert vllm.moves and vllm.utilization is None


def _criticsearch_kept(params: int, layers: int, kv_width: int) -> tuple[float, int]:
    """vLLM's share and KV tokens per GPU of criticsearch.yaml on 8 x 80 GiB with the state kept: the e5 index's
    shard (fp16), its search workspace, the e5-base encoder (bf16), the CUDA context, 16P/8 state, 2P/8 reference,
    then the 8 GiB margin and the 2 GiB rollout.memory_margin_gib."""
    total = 80 * GIB
    beside = GIB + WIKI18_SHARD * 768 * 2 + 2 * 2 ** 27 * 2 + 109_482_240 * 2 + 16 * params // 8 + 2 * params // 8
    util = math.floor((total - beside - 8 * GIB - 2 * GIB) / total * 100) / 100
    kv = int(util * total) - 2 * params - 2 * GIB
    return util, kv // (2 * layers * kv_width * 2)


def test_criticsearch_3b_on_8_x_80gb_keeps_with_vllms_share_from_the_plan(capsys):
    cfg = load_config(CRITIC)
    util, kv_tokens = _criticsearch_kept(P3, 36, 2 * 128)
    assert util == 0.72 and kv_tokens >= 128 // 8 * 5 * 8192  # the step's 655,360 tokens fit: vLLM need not queue
    choice = decide_offload(cfg, 80, 8)
    assert not choice.moves and choice.utilization == util and choice.reserve_bytes == keep_margin_bytes(80)
    plan = memory.plan(cfg, 80, 8)
    assert plan.utilization == util and plan.kv_tokens == kv_tokens and plan.ok
    assert plan.phases["rollout"]["policy"] == 16 * P3 // 8 and "asleep" in plan.phases["train"]
    # what --memory-report prints: the choice, its reason and the share it gives vLLM
    assert main(["--config", CRITIC, "--memory-report", "--gpu-gib", "80", "--gpus", "8", "--host-gib", "1024"]) == 0
    out = capsys.readouterr().out
    assert "- distributed.offload_state=auto: the training state stays on the GPU (the plan with it kept fits" in out
    assert "vLLM's share 0.72 from the plan" in out and "vLLM gpu_memory_utilization: 0.72" in out


def test_criticsearch_7b_on_8_x_80gb_moves_since_vllm_would_queue():
    cfg = load_config(CRITIC, ["model.policy=models/Qwen2.5-7B", "judges.model=models/Qwen2.5-7B-Instruct"])
    util, kv_tokens = _criticsearch_kept(P7, 28, 4 * 128)
    assert kv_tokens < 128 // 8 * 5 * 8192  # kept, the KV cache would hold fewer tokens than a step asks for
    choice = decide_offload(cfg, 80, 8)
    assert choice.moves and "vLLM's KV cache would hold" in choice.reason and "vLLM would queue" in choice.reason
    assert memory.plan(cfg, 80, 8).utilization == 0.9  # moved: the share measured with the state off the GPU


def test_the_margin_is_where_keeping_stops():
    """The kept plan's largest phase with the HF engine does not depend on the GPU's size: a GPU that leaves 4 GiB
    (the floor of the margin, 10% being less here) beside it keeps, a hair smaller moves."""
    cfg = load_config(DEMO, ["model.policy=Qwen2.5-0.5B"])
    peak = max(memory.plan(cfg, 80, 1).total(p) for p in ("rollout", "train", "sync")) / GIB
    assert 30 < peak < 36  # so 10% of peak + 4 GiB is under the 4 GiB floor
    assert not decide_offload(cfg, peak + 4 + 1e-6, 1).moves
    tight = decide_offload(cfg, peak + 4 - 1e-3, 1)
    assert tight.moves and "(margin 4.0 GiB kept free)" in tight.reason
    assert keep_margin_bytes(141) == int(14.1 * GIB) and keep_margin_bytes(24) == 4 * GIB


def test_the_search_r1_design_and_explicit_settings_are_never_overridden():
    design = load_config([DEMO, DESIGN], ["model.policy=Qwen2.5-0.5B"])
    assert design.distributed.offload_state is True  # configs/searchr1_design.yaml pins it, as its scripts do
    assert decide_offload(design, H100, 1) == OffloadChoice(True, "as set", True)
    keep = load_config(DEMO, ["model.policy=Qwen2.5-7B", "distributed.offload_state=false"])
    assert not decide_offload(keep, H100, 1).moves  # the user's word, even where it cannot fit
    assert "distributed.offload_state=false: the training state stays on the GPU (as set)" in memory.plan(
        keep, H100, 1).notes


def test_without_a_gpu_or_colocation_nothing_moves():
    cfg = load_config(DEMO, ["model.policy=Qwen2.5-0.5B", "distributed.offload_state=true"])
    cpu = local_offload(cfg, torch.device("cpu"), 1)
    assert not cpu.moves and cpu.line() == "distributed.offload_state=true: nothing moves (no GPU)"
    apart = decide_offload(load_config(DEMO, ["distributed.colocate=false"]), H100, 1)
    assert not apart.moves and "colocate=false" in apart.reason


def test_the_trainer_decides_from_its_own_gpu_and_the_world_size(monkeypatch):
    """``local_offload`` on a CUDA device reads that GPU's size and plans for the world size: CriticSearch's 3B
    over 8 GPUs of 80 GiB keeps its state, on one GPU of that size it moves."""
    sizes = []

    def properties(device):
        sizes.append(device)
        return types.SimpleNamespace(total_memory=80 * GIB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    cfg = load_config(CRITIC)
    gpu = torch.device("cuda", 3)
    assert local_offload(cfg, gpu, 8) == decide_offload(cfg, 80.0, 8) and not local_offload(cfg, gpu, 8).moves
    assert local_offload(cfg, gpu, 1).moves and sizes == [gpu] * 3


def test_a_plan_that_cannot_size_the_run_moves_the_state(tmp_path):
    cfg = load_config(DEMO, [f"model.policy={tmp_path / 'no-such-model'}"])
    choice = decide_offload(cfg, H100, 1)
    assert choice.moves and "the plan cannot size the run" in choice.reason


@pytest.mark.parametrize("setting, expect", [("auto", "auto"), ("true", True), ("false", False)])
def test_every_place_asks_the_one_decision(setting, expect):
    """The memory plan's rows and host rows follow the choice, whatever produced it."""
    cfg = load_config(DEMO, ["model.policy=Qwen2.5-0.5B", f"distributed.offload_state={setting}"])
    assert cfg.distributed.offload_state == expect
    plan = memory.plan(cfg, H100, 1)
    moved = plan.offload.moves
    assert moved is (expect is True)
    assert ("policy" not in plan.phases["rollout"]) is moved
    assert ("offloaded" in plan.host.phases["rollout"]) is moved and ("engine" in plan.host.phases["train"]) is moved
