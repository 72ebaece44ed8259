"""The per-phase table of a profiled run: seconds per step of each of the trainer's ranges, their share of the
step, the device time inside them and the heaviest kernels (or CPU ops), beside the trainer's own timers.

    phases, other = classify(rows)                         # RangeRow per range name, from nsys or a torch trace
    rows = build_rows(phases, n_steps, metrics, work)      # PhaseRow per phase, in the trainer's order
    text = markdown(rows, info)                            # tools/gpu/nsys_phases.py and --profile print the same

Two sources fill it: ``tools/gpu/nsys_phases.py`` from nsys's ``nvtx_sum`` report (ranges only: no device column), and
``fastcredit.runtime.torch_profile`` from the torch.profiler trace ``--profile`` writes (the ranges are
``record_function`` ranges named as the NVTX ones, ``fastcredit:<phase>``; ``work``: each phase's kernels, or CPU
ops where no kernel ran). Standard library only: the nsys script imports it without torch.

Phases: ``step`` around the whole step; inside it rollout, reward, judge, old_logprobs, ref_logprobs, values,
advantage, update, which partition it up to ``other`` (what the step spends outside them: moving engines and the
training state between phases, bookkeeping); checkpoint and eval between steps; the colocation manager's
sync_weights, switch_to_critic, offload, reload, engine_sleep, engine_wake nested inside the phases.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

DOMAIN = "fastcredit"
PHASES = ("rollout", "reward", "judge", "old_logprobs", "ref_logprobs", "values", "advantage", "update",
          "checkpoint", "eval")
OUTSIDE_STEP = ("checkpoint", "eval")
NESTED = ("sync_weights", "switch_to_critic", "offload", "reload", "engine_sleep", "engine_wake")
STEP = "step"
OTHER = "other"
ALL_NAMES = (*PHASES, *NESTED, STEP)
TOP = 3  # kernels or ops listed per phase
NOTE = ("Rows marked * are the colocation manager's ranges, nested inside their parent phase (judge, the "
        "log-prob passes, update, ...), so the column does not add up to the step; checkpoint and eval run "
        "between steps, outside the step range. The phases inside the step and 'other' (the rest of the step: "
        "moves between phases, bookkeeping) share it out.")


class InputError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


@dataclass
class RangeRow:
    range: str          # as the profile names it, e.g. "fastcredit:rollout"
    style: str          # "PushPop" / "StartEnd"; "" in reports without the column
    total_ns: int
    instances: int


@dataclass
class PhaseRow:
    phase: str
    nested: bool
    total_ns: Optional[int]
    instances: Optional[int]
    s_per_step: Optional[float]
    share: Optional[float]                  # of the step's seconds (phases inside the step)
    device_s_per_step: Optional[float]      # kernels' (or CPU ops') seconds inside the range, per step
    timers_s_per_step: Optional[float]
    ratio: Optional[float]                  # profile / timers
    top: list = field(default_factory=list)  # [[kernel or op, seconds per step]], heaviest first


def split_range(tag: str) -> tuple[Optional[str], str]:
    """(domain, name): ``fastcredit:rollout`` -> ("fastcredit", "rollout"), ``:rollout`` -> ("", "rollout"),
    ``rollout`` -> (None, "rollout")."""
    if ":" in tag:
        domain, name = tag.split(":", 1)
        return domain, name
    return None, tag


def classify(rows: list[RangeRow]) -> tuple[dict[str, RangeRow], list[RangeRow]]:
    """Rows of the trainer's ranges by name (summed over styles), and the others. Once the file names the
    ``fastcredit`` domain, a ``:name`` or bare ``name`` comes from another domain and goes with the others."""
    named = [(r, *split_range(r.range)) for r in rows]
    prefixed = any(d == DOMAIN and n in ALL_NAMES for _, d, n in named)
    accepted = (DOMAIN,) if prefixed else (DOMAIN, "", None)
    phases: dict[str, RangeRow] = {}
    other = []
    for row, domain, name in named:
        if name in ALL_NAMES and domain in accepted:
            had = phases.get(name)
            phases[name] = row if had is None else RangeRow(had.range, f"{had.style}+{row.style}",
                                                            had.total_ns + row.total_ns, had.instances + row.instances)
        else:
            other.append(row)
    return phases, other


def timer_key(phase: str) -> str:
    """The phase's key in metrics.jsonl: ``time/<phase>``, ``time/colocate/<name>`` for a nested range."""
    return f"time/colocate/{phase}" if phase in NESTED else f"time/{phase}"


def timers_per_step(rows: dict[int, dict], phase: str) -> Optional[float]:
    """Mean seconds of ``phase`` over the step rows (0 where a step lacks it); None when no row has it."""
    key = timer_key(phase)
    if not any(key in r for r in rows.values()):
        return None
    return statistics.fmean(float(r.get(key, 0.0)) for r in rows.values())


def num_profiled_steps(phases: dict[str, RangeRow], num_steps: Optional[int], where: str) -> tuple[int, str]:
    """The profiled steps: the instances of the ``step`` range, else ``num_steps``; ``where`` names the profile
    in the error when neither is there."""
    if STEP in phases and phases[STEP].instances > 0:
        return phases[STEP].instances, "Instances of the step range"
    if num_steps is not None:
        return num_steps, "--num-steps"
    raise InputError(f"{where}: no '{DOMAIN}:step' range to count the profiled steps by; give --num-steps N")


def _top(work: dict[str, float], n_steps: int) -> list:
    return [[name, seconds / n_steps] for name, seconds in sorted(work.items(), key=lambda kv: -kv[1])[:TOP]]


def build_rows(phases: dict[str, RangeRow], n_steps: int, metrics: Optional[dict[int, dict]],
               work: Optional[dict[str, dict[str, float]]] = None) -> list[PhaseRow]:
    """A row per phase the profile or the timers have, in the trainer's order, then ``other`` and ``step``.
    ``metrics``: the timers' rows of the profiled steps by step; ``work``: per phase (and ``other``), the seconds
    of each kernel or op inside it over all profiled steps (None: the profile has none)."""
    step_s = phases[STEP].total_ns / 1e9 / n_steps if STEP in phases else None
    out = []
    for phase in (*PHASES, *NESTED, OTHER, STEP):
        if phase == OTHER:
            row = _other_row(out, step_s, work, n_steps)
            out += [row] if row is not None else []
            continue
        nv = phases.get(phase)
        timers = timers_per_step(metrics, phase) if metrics else None
        if nv is None and timers is None:
            continue
        seconds = nv.total_ns / 1e9 / n_steps if nv is not None else None
        share = seconds / step_s if seconds is not None and step_s and phase not in OUTSIDE_STEP else None
        spent = (work or {}).get(phase)
        device = sum(spent.values()) / n_steps if spent is not None else (0.0 if work is not None else None)
        ratio = seconds / timers if seconds is not None and timers else None
        out.append(PhaseRow(phase, phase in NESTED, nv.total_ns if nv else None, nv.instances if nv else None,
                            seconds, share, device, timers, ratio, _top(spent or {}, n_steps)))
    return out


def _other_row(rows: list[PhaseRow], step_s: Optional[float], work, n_steps: int) -> Optional[PhaseRow]:
    """The step's seconds outside its phases (None without a step range)."""
    if step_s is None:
        return None
    inside = [r for r in rows if not r.nested and r.phase not in OUTSIDE_STEP and r.s_per_step is not None]
    seconds = max(step_s - sum(r.s_per_step for r in inside), 0.0)
    spent = (work or {}).get(OTHER, {}) if work is not None else None
    device = sum(spent.values()) / n_steps if spent is not None else None
    return PhaseRow(OTHER, False, None, None, seconds, seconds / step_s if step_s else None, device, None, None,
                    _top(spent or {}, n_steps))


def _cell(value: Optional[float], fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown(rows: list[PhaseRow], info: dict) -> str:
    """The table, its note and the heaviest kernels (or ops) per phase. ``info``: ``source`` (nsys, torch),
    ``profile``, ``num_steps``, ``num_steps_from``, ``metrics`` and ``steps_found``, and ``device`` (GPU, CPU-op;
    None: no device column)."""
    src, device = info["source"], info.get("device")
    lines = [f"{src}: {info['profile']} ({info['num_steps']} profiled steps, from {info['num_steps_from']})",
             f"timers: {info['metrics'] or '(no --metrics)'}"
             + (f", steps {', '.join(map(str, info['steps_found']))}" if info["metrics"] else ""), ""]
    dev_head, dev_rule = (f" {device} s/step |", "---:|") if device else ("", "")
    lines += [f"| phase | {src} s/step | share of step |{dev_head} instances | timers s/step | {src}/timers |",
              f"|---|---:|---:|{dev_rule}---:|---:|---:|"]
    for r in rows:
        label = f"{r.phase}*" if r.nested else r.phase
        dev = f" {_cell(r.device_s_per_step, '.4f')} |" if device else ""
        lines.append(f"| {label} | {_cell(r.s_per_step, '.4f')} | {_cell(r.share, '.1%')} |{dev} "
                     f"{_cell(r.instances, 'd')} | {_cell(r.timers_s_per_step, '.4f')} | {_cell(r.ratio, '.3f')} |")
    lines += ["", NOTE]
    tops = [r for r in rows if r.top]
    if tops:
        lines += ["", f"Heaviest {'kernels' if device == 'GPU' else 'ops'} per phase ({device} s/step, share of the "
                      "phase's):"]
        for r in tops:
            parts = [f"{_short(name)} {s:.4f} ({s / r.device_s_per_step:.0%})" if r.device_s_per_step else
                     f"{_short(name)} {s:.4f}" for name, s in r.top]
            lines.append(f"- {r.phase}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report(rows: list[PhaseRow], other: list[RangeRow], info: dict) -> dict:
    """The JSON the table comes with: ``info``, every row, the other ranges and the note."""
    return {**info, "rows": [asdict(r) for r in rows], "other": [asdict(r) for r in other], "note": NOTE}
