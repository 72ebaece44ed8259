"""The memory report's text: the GPU table, the host table, the vLLM share, the notes and the problems.

    print(format_plan(memory.plan(cfg, gpu_gib=80, gpus=8, host_gib=1024)))   # --memory-report
"""
from __future__ import annotations

from fastcredit.trainer.memory.gpu import LABELS, PHASES, MemoryPlan
from fastcredit.trainer.memory.host import HOST_LABELS, NODE_ROWS, OS_MARGIN_FRACTION, OS_MARGIN_MIN_BYTES, HostPlan
from fastcredit.trainer.memory.units import GIB, gib_text, tokens_text

CELL = 10  # characters a phase's column takes


def gpu_table(plan: MemoryPlan) -> list:
    """Phase x component GiB per GPU, the totals, the GPU's size and a verdict per phase."""
    phases = [phase for phase in PHASES if phase in plan.phases]
    components = [c for c in LABELS if any(plan.phases[phase].get(c) for phase in phases)]
    width = max(len(LABELS[c]) for c in components) + 2
    head = "GiB per GPU".ljust(width) + "".join(f"{phase:>{CELL}}" for phase in phases)
    lines = [head, "-" * len(head)]
    for c in components:
        cells = [gib_text(plan.phases[phase][c]) if c in plan.phases[phase] else "-" for phase in phases]
        lines.append(LABELS[c].ljust(width) + "".join(f"{cell:>{CELL}}" for cell in cells))
    lines.append("-" * len(head))
    lines.append("total".ljust(width) + "".join(f"{gib_text(plan.total(phase)):>{CELL}}" for phase in phases))
    lines.append("GPU".ljust(width) + "".join(f"{plan.gpu_gib:>{CELL}.1f}" for _ in phases))
    verdict = ["fits" if plan.total(phase) <= plan.gpu_gib * GIB else "OVER" for phase in phases]
    lines.append("verdict".ljust(width) + "".join(f"{v:>{CELL}}" for v in verdict))
    return lines


def _copies_text(host: HostPlan, component: str) -> str:
    """How a row multiplies up to the node: ``8 x`` (ranks, or ranks reading the policy) or ``node``."""
    return "node" if component in NODE_ROWS else f"{host.copies(component)} x"


def host_table(host: HostPlan) -> list:
    """Phase x component GiB of host RAM per node, each row's count per node, the totals and a verdict."""
    phases = list(host.phases)
    components = [c for c in HOST_LABELS if any(host.phases[phase].get(c) for phase in phases)]
    width = max(len(HOST_LABELS[c]) for c in components) + 2
    head = "GiB host RAM per node".ljust(width) + f"{'':>6}" + "".join(f"{phase:>{CELL}}" for phase in phases)
    lines = [head, "-" * len(head)]
    for c in components:
        cells = [gib_text(host.node_bytes(phase, c)) if host.phases[phase].get(c) else "-" for phase in phases]
        lines.append(HOST_LABELS[c].ljust(width) + f"{_copies_text(host, c):>6}"
                     + "".join(f"{cell:>{CELL}}" for cell in cells))
    lines.append("-" * len(head))
    pad = width + 6
    lines.append("total".ljust(pad) + "".join(f"{gib_text(host.total(phase)):>{CELL}}" for phase in phases))
    if host.usable_bytes is None:
        return lines
    lines.append("host RAM, usable".ljust(pad) + "".join(f"{gib_text(host.usable_bytes):>{CELL}}" for _ in phases))
    verdict = ["fits" if host.total(phase) <= host.usable_bytes else "OVER" for phase in phases]
    lines.append("verdict".ljust(pad) + "".join(f"{v:>{CELL}}" for v in verdict))
    return lines


def host_note(host: HostPlan) -> str:
    """Where the host figures come from: ranks per node, nodes, the RAM and its source, the OS margin."""
    node = f"{host.ranks_per_node} rank(s) per node (--gpus-per-node), {host.nodes} node(s), figures for node 0"
    if host.host_gib is None:
        return f"host: {node}; host RAM not known (--host-gib): not checked"
    margin = f"{OS_MARGIN_FRACTION:.0%}, at least {OS_MARGIN_MIN_BYTES / GIB:g} GiB"
    return (f"host: {node}; {host.host_gib:.1f} GiB of RAM a node ({host.source}), "
            f"{gib_text(host.margin_bytes)} GiB of it kept for the OS ({margin})")


def format_plan(plan: MemoryPlan) -> str:
    """The GPU table, the host table, then vLLM's share, the notes and the problems."""
    lines = [plan.title, ""] + gpu_table(plan) + [""]
    if plan.host is not None:
        lines += host_table(plan.host) + [""]
    if plan.utilization is not None:
        lines.append(f"vLLM gpu_memory_utilization: {plan.utilization:.2f}; its KV cache holds "
                     f"{tokens_text(plan.kv_tokens)} tokens, a step asks for {tokens_text(plan.kv_tokens_step)} "
                     f"(max context {tokens_text(plan.max_context)})")
    lines += [f"- {note}" for note in plan.notes]
    if plan.host is not None:
        lines.append(f"- {host_note(plan.host)}")
    lines.append("problems:" if plan.problems else "problems: none")
    lines += [f"  {'ERROR' if problem in plan.hard else 'note'}: {problem}" for problem in plan.problems]
    return "\n".join(lines)
