"""The memory budget of a run, before anything loads: GPU memory per phase, and host RAM per node.

    plan = memory.plan(load_config("configs/criticsearch.yaml"), gpu_gib=80, gpus=8, host_gib=1024)
    print(memory.format_plan(plan))                  # python -m fastcredit.train ... --memory-report
    util = memory.engine_memory_utilization(free, total, margin, weight_bytes, min_kv_bytes)

    shapes.py      model sizes: ModelShape, the presets, a folder's config.json and safetensors headers
    retrieval.py   the index and query encoder: sizes from file headers, a rank's share of the index
    vllm_share.py  vLLM's share of the GPU, auto or fixed, and MemoryBudgetError
    parts.py       what a config puts where: shard group, trained models, reference, the judge's mode, OffloadChoice
    gpu.py         the GPU plan: what each phase holds on one GPU (the formulas in its docstring)
    offload.py     distributed.offload_state decided (auto: from the plan with the state kept); plan itself
    host.py        host RAM per rank and per node in each phase and at start-up (the formulas in its docstring)
    report.py      format_plan: both tables, the notes and the problems
"""
from fastcredit.trainer.memory.gpu import (ASLEEP_BYTES, CONTEXT_BYTES, LABELS, PHASES, SEARCH_BYTES,
                                           VLLM_OVERHEAD_BYTES, MemoryPlan)
from fastcredit.trainer.memory.host import HOST_LABELS, HostPlan, host_plan, machine_memory_gib
from fastcredit.trainer.memory.offload import decide_offload, local_offload, plan
from fastcredit.trainer.memory.parts import OffloadChoice
from fastcredit.trainer.memory.report import format_plan
from fastcredit.trainer.memory.retrieval import (ENCODERS, TOKEN_STORE_GPU_CAP, TOKENS_PER_PASSAGE, WIKI18_E5,
                                                 IndexSize, encoder_size, index_header, index_size)
from fastcredit.trainer.memory.shapes import (PRESETS, ModelShape, ShapeError, kv_bytes_per_token, lookup_shape,
                                      safetensors_params, tiny_shape)
from fastcredit.trainer.memory.units import GIB
from fastcredit.trainer.memory.vllm_share import MemoryBudgetError, check_fixed_utilization, engine_memory_utilization

__all__ = [
    "ASLEEP_BYTES", "CONTEXT_BYTES", "ENCODERS", "GIB", "HOST_LABELS", "LABELS", "PHASES", "PRESETS", "SEARCH_BYTES",
    "TOKEN_STORE_GPU_CAP", "TOKENS_PER_PASSAGE", "VLLM_OVERHEAD_BYTES", "WIKI18_E5", "HostPlan", "IndexSize",
    "MemoryBudgetError", "MemoryPlan", "ModelShape", "OffloadChoice", "ShapeError", "check_fixed_utilization",
    "decide_offload", "encoder_size", "engine_memory_utilization", "format_plan", "host_plan", "index_header",
    "index_size", "kv_bytes_per_token", "local_offload", "lookup_shape", "machine_memory_gib", "plan",
    "safetensors_params", "tiny_shape",
]
