"""Host RAM per node: what each phase of a step keeps in CPU memory, beside the GPU plan, and whether it fits.

    plan = memory.plan(cfg, gpu_gib=80, gpus=16, host_gib=1024, gpus_per_node=8)
    plan.host.total("train")             # bytes on the fullest node (node 0, with rank 0)

Units as in ``fastcredit.trainer.memory.gpu`` (P policy parameters, S the shard group, TP, W GPUs), and
P_c: the critic's parameters; R: ranks per node (--gpus-per-node, default min(W, 8), one rank
a GPU). A row is bytes on every rank (x R on the node), on each rank that reads the policy at
start-up, or once per node. A node's total must fit its RAM (--host-gib) less a margin for the
OS and everything else on it: 5%, at least 4 GiB. Pinned and pageable copies count alike.

* every phase, every rank: the process itself (Python, torch, the CUDA runtime, vLLM; about
  2 GiB, an estimate); an index in CPU memory (index_type=hnsw / ivfpq, or retrieval.device=cpu),
  the rank's share as ``fastcredit.trainer.memory.retrieval`` sizes it (shard: ceil(N / W) rows;
  replicate: whole), HNSW with its graph, N x ((2M + 1) x 4 + 12) bytes; the query encoder in
  fp32 with retrieval.device=cpu, 4 bytes a parameter; under distributed.cpu_offload the trained
  models' state, 16 bytes a parameter over S, pinned (FSDP2's CPUOffloadPolicy, ZeRO-Offload).
* every phase, once per node: the passage token store when it stays on the CPU
  (retrieval.device=cpu, or tokens past 4 GiB): memory-mapped, so the node's ranks share its
  pages (page cache, counted whole; the corpus text is read the same way and not counted).
* start-up, the peak while ``fastcredit.trainer.roles.build_training_side`` runs: the policy read from
  files in fp32, 4P, on each rank that reads it: rank 0 alone under torchrun with FSDP2 (the others build it on
  the meta device and receive their shards, ``fastcredit.distributed.from_rank0``); every rank
  with DeepSpeed, on one process, or for the tiny policy (built in code). Beside it a fp32
  deepcopy, 4P, while the reference or the value model is made from it
  (``fastcredit.models.build.frozen_copy`` copies before it casts); with a value model the
  reference's shard, 2P/S on every rank, is already offloaded. The HF engine's model is made on
  its GPU and filled by the weight sync (``fastcredit.trainer.roles.engine_start``): no host copy.
* rollout and judge, colocated: the training state offloaded, 16P/S a trained model
  (``FSDP2Engine.offload``: fp32 params and grads pageable, AdamW moments pinned; DeepSpeed's
  ``offload_states``, pinned, with ZeRO-2's replicated bf16 params, 2P); the reference's bf16
  shard, 2P/S, offloaded between its passes (in the weight sync too).
* a critic of the policy's architecture waits in pinned memory, bf16, 2P_c on every rank in
  every phase after start-up (``judges.switch.CriticWeights``); a critic with an HF engine of
  its own is moved to the CPU while it sleeps (rollout, train, sync, colocated), 2P_c.
* train, colocated: the sleeping policy engine's weights: vLLM sleep level 1
  (rollout.sleep_level=1) offloads them to pinned memory, 2P/TP (level 2 drops them); the HF
  engine moves its copy to the CPU, 2P, when the training state moves (also in the judge phase
  when the judge has an engine of its own).

distributed.colocate=false: nothing sleeps or moves; the resident rows and cpu_offload remain.
A training state that stays on the GPU (``moves`` false: ``fastcredit.trainer.memory.offload`` decides): the engines
sleep as colocated, but the training state, the reference and the HF engine's weights stay on the GPU (no
offloaded rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from fastcredit.trainer.memory.parts import (JudgeSetup, reference_bytes, shard_group, trained_params,
                                             training_state_bytes, uses_reference, zero2_bytes)
from fastcredit.trainer.memory.retrieval import (IndexSize, encoder_size, index_bytes_per_rank, token_store_bytes,
                                         token_store_fits_gpu)
from fastcredit.trainer.memory.shapes import ModelShape
from fastcredit.trainer.memory.units import GIB, gib_text

PROCESS_BYTES = 2 * GIB           # one rank's process: Python, torch, the CUDA runtime, vLLM (estimate)
OS_MARGIN_FRACTION = 0.05         # of the node's RAM kept for the OS and everything else on the node
OS_MARGIN_MIN_BYTES = 4 * GIB
MEMINFO = "/proc/meminfo"
STARTUP = "start-up"

HOST_LABELS = {
    "process": "process: Python, torch, CUDA (est.)", "loaded": "policy fp32, read from files",
    "copy": "its fp32 copy being made",
    "offloaded": "training state, offloaded", "cpu_offload": "training state (cpu_offload)",
    "reference": "reference bf16 shard, offloaded", "critic": "frozen critic bf16 (pinned)",
    "judge_engine": "judge's own engine, asleep", "engine": "policy engine weights, asleep",
    "index": "retrieval index (CPU)", "encoder": "query encoder fp32 (CPU)",
    "tokens": "passage token store (page cache)",
}
LOADER_ROWS = ("loaded", "copy")  # on each rank that reads the policy, at start-up
NODE_ROWS = ("tokens",)                          # once per node


@dataclass
class HostPlan:
    """Host bytes per phase and component, on one rank (or once per node for NODE_ROWS); ``host_gib``: the
    node's RAM (None: not checked) and ``source``: where that figure came from."""
    ranks_per_node: int
    nodes: int
    readers: int            # ranks on the fullest node that read the policy from files at start-up
    host_gib: Optional[float] = None
    source: str = ""
    phases: dict = field(default_factory=dict)   # phase -> {component: bytes}
    advice: dict = field(default_factory=dict)   # component -> what makes it smaller

    def copies(self, component: str) -> int:
        """How many of ``component`` a node holds."""
        if component in NODE_ROWS:
            return 1
        return self.readers if component in LOADER_ROWS else self.ranks_per_node

    def node_bytes(self, phase: str, component: str) -> int:
        return self.phases[phase][component] * self.copies(component)

    def total(self, phase: str) -> int:
        """Bytes on the fullest node in ``phase``."""
        return sum(self.node_bytes(phase, component) for component in self.phases[phase])

    @property
    def margin_bytes(self) -> int:
        return max(int(OS_MARGIN_FRACTION * self.host_gib * GIB), OS_MARGIN_MIN_BYTES) if self.host_gib else 0

    @property
    def usable_bytes(self) -> Optional[int]:
        """The node's RAM less the OS margin; None when the RAM is not known."""
        return None if self.host_gib is None else int(self.host_gib * GIB) - self.margin_bytes

    def breakdown(self, phase: str) -> str:
        """``8 ranks x 9.5 GiB + 23.0 GiB on rank 0, which reads the policy + 11.1 GiB once per node``."""
        rows = self.phases[phase]
        each_rank = sum(b for c, b in rows.items() if c not in LOADER_ROWS + NODE_ROWS)
        reader = sum(b for c, b in rows.items() if c in LOADER_ROWS)
        node = sum(b for c, b in rows.items() if c in NODE_ROWS)
        text = f"{self.ranks_per_node} rank(s) x {gib_text(each_rank)} GiB"
        if reader and self.readers == 1 and self.ranks_per_node > 1:
            text += f" + {gib_text(reader)} GiB on rank 0, which reads the policy"
        elif reader:
            text += f" + {self.readers} x {gib_text(reader)} GiB reading the policy"
        return text + (f" + {gib_text(node)} GiB once per node" if node else "")


def machine_memory_gib(path: str = MEMINFO) -> Optional[float]:
    """This machine's RAM (MemTotal) in GiB; None where ``path`` cannot be read."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GIB  # the value is in kB (KiB)
    except OSError:
        return None
    return None


def reads_on_rank0_only(cfg, gpus: int) -> bool:
    """``fastcredit.models.build.loads_on_rank0``: under torchrun with FSDP2 a policy read from files is read on
    rank 0 alone; DeepSpeed, one process and the tiny policy (built in code) read it on every rank."""
    return gpus > 1 and cfg.distributed.engine == "fsdp2" and cfg.model.policy != "tiny"


def resident_rows(cfg, gpus: int, idx: Optional[IndexSize], shape: ModelShape, shard: int) -> dict:
    """What every phase holds in host memory: the process, a CPU index, a CPU encoder, a token store left on the
    CPU (once per node) and the state under distributed.cpu_offload."""
    rcfg, rows = cfg.retrieval, {"process": PROCESS_BYTES}
    if cfg.distributed.cpu_offload:
        rows["cpu_offload"] = sum(training_state_bytes(cfg, shape, shard).values())
    if idx is None:
        return rows
    if idx.rows and not idx.on_gpu:
        split = rcfg.across_ranks == "shard" and gpus > 1
        shards = gpus if rcfg.num_shards <= 0 else rcfg.num_shards
        rows["index"] = index_bytes_per_rank(idx, gpus, split, shards) + idx.graph_bytes
    if rcfg.device == "cpu":
        rows["encoder"] = encoder_size(rcfg.encoder)[0] * 4
    if idx.rows and (rcfg.device == "cpu" or not token_store_fits_gpu(idx.rows)):
        rows["tokens"] = token_store_bytes(idx.rows)
    return rows


def startup_rows(cfg, shape: ModelShape, gpus: int, shard: int, moves: bool) -> dict:
    """The start-up peak's own rows (see the module docstring): the policy as read, its copy and the offloaded
    reference shard (``moves``: the training state leaves the GPU), whichever the models built after the policy
    need."""
    reference, value = uses_reference(cfg), "value" in trained_params(cfg, shape)
    rows = {"loaded": 4 * shape.params}
    if reference or value:
        rows["copy"] = 4 * shape.params
    if reference and value and moves:
        rows["reference"] = reference_bytes(cfg, shape, shard)
    return rows


def phase_rows(cfg, shape: ModelShape, shard: int, phase: str, judge: JudgeSetup, moves: bool) -> dict:
    """What ``phase`` adds in host memory: what colocation moved off the GPU (``moves``: the training state
    leaves it), and the critic's host copies."""
    dcfg, rows = cfg.distributed, {}
    if moves and phase in ("rollout", "judge"):
        state = 0 if dcfg.cpu_offload else sum(training_state_bytes(cfg, shape, shard).values())
        if state + zero2_bytes(dcfg, shape):
            rows["offloaded"] = state + zero2_bytes(dcfg, shape)
    if moves and phase != "train" and uses_reference(cfg):
        rows["reference"] = reference_bytes(cfg, shape, shard)
    if judge.mode == "switch":
        rows["critic"] = 2 * judge.critic.params
    if judge.mode == "own" and dcfg.colocate and phase != "judge":
        rows["judge_engine"] = 2 * judge.critic.params
    rollout = cfg.rollout
    weights = shape.params * 2 // max(1, rollout.tensor_parallel)
    if dcfg.colocate and rollout.engine == "vllm" and rollout.sleep_level == 1 and phase == "train":
        rows["engine"] = weights
    hf_asleep = phase == "train" or (phase == "judge" and judge.mode == "own")
    if dcfg.colocate and moves and rollout.engine == "hf" and hf_asleep:  # a kept state keeps the HF weights too
        rows["engine"] = weights
    return rows


def advice(cfg, gpus: int) -> dict:
    """What makes each row smaller, for the message of a node that does not fit."""
    vllm = cfg.rollout.engine == "vllm"
    if cfg.retrieval.index_type == "hnsw":  # it cannot be split over the ranks
        index_tip = "retrieval.index_type=ivfpq (smaller, and split over the ranks) or retrieval.backend=http"
    else:
        index_tip = ("retrieval.across_ranks=shard, the index on the GPU (retrieval.device=cuda with "
                     "index_type=flat) or retrieval.backend=http")
    tips = {
        "cpu_offload": "distributed.cpu_offload=false",
        "offloaded": "more nodes (each rank's shard of the training state shrinks as 1 / W)",
        "reference": "more nodes (a smaller reference shard on each rank)",
        "critic": "judges.backend=http (the critic served elsewhere)",
        "judge_engine": "judges.backend=http (the critic served elsewhere)",
        "engine": "rollout.sleep_level=2" if vllm else "rollout.engine=vllm (sleep level 2 drops the weights)",
        "index": index_tip,
        "encoder": "retrieval.device=cuda",
        "tokens": "retrieval.backend=http",
    }
    if cfg.distributed.engine == "deepspeed" and gpus > 1:
        for row in LOADER_ROWS:
            tips[row] = "distributed.engine=fsdp2 (under torchrun rank 0 alone reads the policy)"
    return tips


def host_plan(cfg, shape: ModelShape, gpus: int, phases: list, idx: Optional[IndexSize], judge: JudgeSetup,
              moves: bool, host_gib: Optional[float] = None, gpus_per_node: Optional[int] = None,
              source: str = "") -> HostPlan:
    """Host bytes of the start-up and of each of ``phases`` (the GPU plan's) for ``cfg`` on ``gpus`` GPUs,
    ``gpus_per_node`` (default min(gpus, 8)) ranks a node with ``host_gib`` of RAM each; ``moves``: the training
    state leaves the GPU while the engines work (the GPU plan's ``offload``)."""
    ranks = min(gpus, gpus_per_node or 8)
    readers = 1 if reads_on_rank0_only(cfg, gpus) else ranks
    result = HostPlan(ranks, math.ceil(gpus / ranks), readers, host_gib, source, advice=advice(cfg, gpus))
    shard = shard_group(cfg.distributed, gpus)
    resident = resident_rows(cfg, gpus, idx, shape, shard)
    startup = {**resident, **startup_rows(cfg, shape, gpus, shard, moves)}
    startup.pop("cpu_offload", None)  # the optimizer state is created at the first step, after the peak
    result.phases[STARTUP] = startup
    for phase in phases:
        result.phases[phase] = {**resident, **phase_rows(cfg, shape, shard, phase, judge, moves)}
    return result


def host_problems(host: HostPlan) -> list:
    """A hard problem for each phase whose node total exceeds the node's RAM less the OS margin."""
    if host.host_gib is None:
        return []
    problems = []
    for phase in host.phases:
        need = host.total(phase)
        if need <= host.usable_bytes:
            continue
        largest = sorted(host.phases[phase], key=lambda c: -host.node_bytes(phase, c))
        tips = list(dict.fromkeys(host.advice[c] for c in largest if c in host.advice))[:3]
        tips.append("fewer ranks per node (--gpus-per-node)" if host.ranks_per_node > 1 else "a node with more RAM")
        problems.append(f"host: the {phase} phase needs {gib_text(need)} GiB of host RAM per node "
                        f"({host.breakdown(phase)}) of {host.host_gib:.1f} GiB ({gib_text(host.usable_bytes)} usable, "
                        f"{gib_text(host.margin_bytes)} GiB kept for the OS): {', '.join(tips[:-1])}"
                        f"{' or ' if len(tips) > 1 else ''}{tips[-1]}")
    return problems
