"""Every Triton kernel compiles for sm_90 (H100) on a machine without a GPU, with the launch choices of the host
code, within the H100's shared memory and without register spills (tools/gpu/gpu_preflight_kernels.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from fastcredit.kernels.linear_logprob.triton import gpu_config
from fastcredit.kernels.turn_surrogate import AGG_MODES
from fastcredit.kernels.turn_surrogate.triton import gpu_block

from bench.shapes import QWEN_HIDDEN, QWEN_VOCAB
from tools.gpu.aot_compile import compile_only, limit_problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def preflight(tmp_path_factory):
    """(exit status, output, rows of kernels.jsonl, kernels.md) of the sm_90 preflight, run once for the module."""
    out = tmp_path_factory.mktemp("preflight")
    # The kernels must be compiled, not interpreted: the script runs with TRITON_INTERPRET=0 whatever it inherits.
    proc = subprocess.run([sys.executable, "-m", "tools.gpu.gpu_preflight_kernels", str(out), "--arch", "90"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    rows = [json.loads(line) for line in open(out / "kernels.jsonl")] if (out / "kernels.jsonl").exists() else []
    md = (out / "kernels.md").read_text() if (out / "kernels.md").exists() else ""
    return proc.returncode, proc.stdout + proc.stderr, [r for r in rows if "kernel" in r], md


def is_variant(row: dict) -> bool:
    """A row of issue 46's candidate variants (``variant_cases``) rather than of the default kernels."""
    words = row["variant"].split()
    return len(words) > 2


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_within_limits(preflight):
    code, output, rows, md = preflight
    assert code == 0, output[-5000:]
    assert "[preflight] passed: sm_90" in output
    md_rows = md.count("| sm_90 |")
    variants, rows = [r for r in rows if is_variant(r)], [r for r in rows if not is_variant(r)]
    kernels = {(r["op"], r["kernel"], r["dtype"], r["seg_dtype"]) for r in rows}
    assert kernels == {("linear_logprob", k, d, None) for k in ("_fwd_kernel", "_combine_kernel", "_dlogits_kernel")
                       for d in DTYPES} | {("turn_surrogate", k, "fp32", s) for s in ("int32", "int64") for k in (
                           "_turn_count_kernel", "_fwd_kernel", "_bwd_kernel", "_finish_kernel")}
    assert {r["variant"].split()[0] for r in rows if r["op"] == "turn_surrogate"} == set(AGG_MODES)
    for r in rows:
        assert r["arch"] == 90 and r["status"] in ("ok", "warn"), r
        assert r["smem_bytes"] <= r["smem_limit_bytes"] == 232_448
        if r["op"] == "linear_logprob":
            assert r["spill_store_bytes"] == r["spill_load_bytes"] == 0, r
        if r["kernel"] in ("_fwd_kernel", "_dlogits_kernel") and r["op"] == "linear_logprob":
            assert r["tensor_cores"] == "wgmma", r  # bf16 on tensor cores; fp32 as 3xTF32
    assert md_rows == len({r["hash"] for r in rows + variants})
    # Every candidate variant compiles too, without spills, the log-prob's on the tensor cores.
    assert {r["variant"].split(maxsplit=2)[-1] for r in variants if r["op"] == "linear_logprob"} == {
        "tma", "persistent", "tma+persistent", "warp_specialize", "fused", "fused_skip"}
    assert {r["kernel"] for r in variants if r["variant"].endswith("fused")} == {
        "_fwd_kernel", "_combine_kernel", "_fused_bwd_kernel"}
    for r in variants:
        assert r["status"] == "ok" and r["spill_store_bytes"] == 0, r
        if r["kernel"] in ("_fwd_kernel", "_dlogits_kernel", "_fused_bwd_kernel") and r["op"] == "linear_logprob":
            assert r["tensor_cores"] == "wgmma", r


@pytest.mark.slow
def test_the_preflight_compiles_the_host_codes_own_choices(preflight):
    """Tiles, warps, stages and register cap are what the host code picks for an H100, not a copy of them."""
    _, _, rows, _ = preflight
    rows = [r for r in rows if not is_variant(r)]
    hidden = {f"{model}-N8k": h for model, h in QWEN_HIDDEN.items()}
    for r in rows:
        if r["op"] == "linear_logprob" and r["kernel"] != "_combine_kernel":
            cfg = gpu_config(8192, QWEN_VOCAB, hidden[r["shape"]], DTYPES[r["dtype"]], arch=90)
            c = r["constexprs"]
            assert (c["BLOCK_N"], c["BLOCK_V"], c["BLOCK_H"], r["num_warps"], r["num_stages"], r["maxnreg"]) == (
                cfg.block_n, cfg.block_v, cfg.block_h, cfg.num_warps, cfg.num_stages, cfg.max_registers), r
            assert c["PRECISION"] == (cfg.fp32_precision if r["dtype"] == "fp32" else "tf32") and not c["DOT_F32"]
        if r["op"] == "turn_surrogate" and r["kernel"] != "_finish_kernel":
            assert r["constexprs"]["BLOCK"] == gpu_block(1 << 20), r
    # The JIT's own specialisation: 16-byte aligned pointers and sizes divisible by 16 (it changes the code).
    fwd = next(r for r in rows if r["kernel"] == "_fwd_kernel" and r["op"] == "linear_logprob")
    assert fwd["signature"]["HID"] == ("*bf16:16" if fwd["dtype"] == "bf16" else "*fp32:16")
    assert fwd["signature"]["N"] == "i32:16" and fwd["signature"]["inv_temp"] == "fp32"
    # A kernel launched once per backward chunk (151,936 columns in chunks of 8,192) is one row.
    assert {r["launches"] for r in rows if r["kernel"] == "_dlogits_kernel"} == {19}


def test_limits_fail_on_shared_memory_and_spills():
    usage = dict(smem_bytes=232_448, smem_limit_bytes=232_448, spill_store_bytes=0, spill_load_bytes=0)
    assert limit_problems(usage, 90) == ([], [])
    failures, _ = limit_problems({**usage, "smem_bytes": 232_449}, 90)
    assert failures == ["shared memory 232449 B > sm_90 limit 232448 B"]
    spilled = {**usage, "spill_store_bytes": 4, "spill_load_bytes": 4}
    assert limit_problems(spilled, 90) == (["spills 4 B stored / 4 B loaded"], [])
    assert limit_problems(spilled, 90, spills_fail=False) == ([], ["spills 4 B stored / 4 B loaded"])


def test_compile_only_refuses_interpreted_kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels of this process are compiled, not interpreted")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with compile_only(90):
            pass
