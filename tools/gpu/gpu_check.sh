#!/usr/bin/env bash
# Everything GPU-side in one command: bash tools/gpu/gpu_check.sh OUTDIR   (or: make gpu-check)
#
# Stages, each under `timeout`, each writing into OUTDIR as it goes (a stage that times out
# loses nothing written before it): env -> build the CUDA extension -> GPU tests and the kernel
# tests compiled -> kernel benchmarks and targets -> three trainer steps -> two steps under torchrun on
# every visible GPU (2 or more) -> the async-vs-lockstep rollout bench -> a step against the Search-R1
# design, random weights -> the same, warm-started so that it searches -> an nsys profile -> with vLLM (when it imports;
# tools/gpu/gpu_check_vllm.py): the engine starts, sleep levels 1 and 2, the critic switch, async vs lockstep, three
# colocated trainer steps, the step against the Search-R1 design -> summary.md.
# Exit status 1 when any stage or target fails. Wheels placed in tools/gpu/wheels/ (or
# $GPU_CHECK_WHEELS) are installed first with --no-deps (liger-kernel, nvtx, ... on a bare image).
# GPU_CHECK_STAGES="kernels train" runs only those stages into the same OUTDIR (the summary reads
# every stage file there), so the check can be split over two 10-minute runs.
# On a machine without CUDA the same command runs quick shapes under the Triton interpreter and
# reports the stages that need CUDA as "not run".
set -uo pipefail
OUT=${1:?usage: bash tools/gpu/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
mkdir -p "$OUT/work"
OUT=$(cd "$OUT" && pwd)
STAGE_TIMEOUT=${GPU_CHECK_STAGE_TIMEOUT:-900}
export OUT PY STAGE_TIMEOUT

has_cuda() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
record() {  # stage status reason
  "$PY" -c "import sys, json
json.dump({'stage': sys.argv[1], 'status': sys.argv[2], 'reason': sys.argv[3]}, open(sys.argv[4], 'w'))" \
    "$1" "$2" "$3" "$OUT/stage_$1.json"
  echo "[gpu-check] $1: $2${3:+ ($3)}"
}
export -f record
VLLM_STAGES="vllm_engine vllm_sleep vllm_critic vllm_rollout vllm_train vllm_step"
ALL_STAGES="env build tests kernels train ranks rollout step search_step split nsys $VLLM_STAGES"
want() { [[ " ${GPU_CHECK_STAGES:-$ALL_STAGES} " == *" $1 "* ]]; }
run_stage() {  # name, then a command or an exported function; a timeout or crash without a record is a failure
  local name=$1; shift
  want "$name" || return 0
  rm -f "$OUT/stage_$name.json"
  timeout "$STAGE_TIMEOUT" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ ! -f "$OUT/stage_$name.json" ]; then
    if [ "$rc" = 124 ]; then record "$name" failed "timed out after ${STAGE_TIMEOUT} s"
    else record "$name" failed "exit $rc"; fi
  fi
}

WHEELS=${GPU_CHECK_WHEELS:-tools/gpu/wheels}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps "$WHEELS"/*.whl 2>&1 | tail -3
fi
if has_cuda; then CUDA=1; else
  CUDA=0; export TRITON_INTERPRET=1
  echo "[gpu-check] no CUDA device: quick shapes under the Triton interpreter; CUDA stages are not run"
fi
export GPU_CHECK_CUDA=$CUDA  # the stages take the answer (tools/gpu/gpu_check_common.py) instead of asking torch

run_stage env "$PY" -m tools.gpu.gpu_check env "$OUT"

if [ "$CUDA" = 1 ]; then
  build() {
    FASTCREDIT_BUILD_CUDA=1 "$PY" -m pip install --no-deps --no-build-isolation --use-pep517 -e . \
      && "$PY" -c "import fastcredit._C" \
      && record build passed "fastcredit._C built and loaded" || record build failed "see build.log"
  }
  export -f build
  run_stage build build
  tests() {
    local timeout_flag=""
    "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag="--timeout=300"
    "$PY" -m pytest -q -p no:cacheprovider $timeout_flag -o faulthandler_timeout=300 \
      --junitxml "$OUT/tests_kernels.xml" \
      tests/kernels tests/retrieval/test_retrieval_ops.py tests/test_build.py
    local a=$?
    "$PY" -m pytest -q -p no:cacheprovider -m gpu $timeout_flag -o faulthandler_timeout=300 \
      --junitxml "$OUT/tests_gpu.xml" \
      tests --ignore=tests/kernels --ignore=tests/retrieval/test_retrieval_ops.py
    local b=$?
    if [ $a = 0 ] && [ $b = 0 ]; then record tests passed "junit: tests_kernels.xml, tests_gpu.xml"
    else record tests failed "pytest exit $a (kernels, retrieval ops, build) / $b (-m gpu)"; fi
  }
  export -f tests
  run_stage tests tests
else
  want build && record build "not run" "needs CUDA"
  want tests && record tests "not run" "needs CUDA (the kernel tests run under the interpreter in make test)"
fi

run_stage kernels "$PY" -m tools.gpu.gpu_check kernels "$OUT"
run_stage train "$PY" -m tools.gpu.gpu_check train "$OUT"
run_stage ranks "$PY" -m tools.gpu.gpu_check_ranks "$OUT"
run_stage rollout "$PY" -m tools.gpu.gpu_check rollout "$OUT"

if [ "$CUDA" = 1 ]; then
  step_stage() {  # fastcredit's step against the Search-R1 design (bench/bench_step.py), a random Qwen2.5-0.5B
    "$PY" -m bench.bench_step --shape Qwen2.5-0.5B --steps 3 --warmup 1 --out "$OUT" --work "$OUT/work/step" \
      && record step passed "step_Qwen2.5-0.5B_*.{json,md,png}" || record step failed "see step.log"
  }
  export -f step_stage
  run_stage step step_stage
  # the same at the demo's batch with a short warm start, so the policy searches and the retrieval path, where the
  # designs differ most, is timed too (random weights make no searches); each design warm-starts before its steps
  search_step_stage() {
    "$PY" -m bench.bench_step --shape Qwen2.5-0.5B --config configs/demo.yaml --tag search --steps 3 --warmup 1 \
      --out "$OUT" --work "$OUT/work/search_step" \
      warmstart.questions=1500 warmstart.epochs=1 warmstart.lr=5e-4 \
      && record search_step passed "step_Qwen2.5-0.5B_search_*.{json,md,png}" \
      || record search_step failed "see search_step.log"
  }
  export -f search_step_stage
  run_stage search_step search_step_stage
else
  want step && record step "not run" "needs CUDA (on a CPU: python -m bench.bench_step)"
  want search_step && record search_step "not run" \
    "needs CUDA (on a CPU: python -m bench.bench_step --config configs/demo.yaml)"
fi

GPUS=$([ "$CUDA" = 1 ] && "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$CUDA" = 1 ] && [ "$GPUS" -ge 2 ]; then
  split_stage() {  # the split placement at k = 0, 1, 2 beside colocated, 2 ranks, vLLM where it imports
    ENGINE=$("$PY" -c "import importlib.util as u; print('vllm' if u.find_spec('vllm') else 'hf')")
    "$PY" -m bench.bench_step --placement split --staleness 0,1,2 \
      --shape Qwen2.5-0.5B --steps 4 --warmup 1 --out "$OUT" --work "$OUT/work/split" rollout.engine=$ENGINE \
      && record split passed "step_split_Qwen2.5-0.5B_*.{json,md} (engine $ENGINE)" \
      || record split failed "see split.log"
  }
  export -f split_stage
  run_stage split split_stage
elif want split; then
  record split "not run" "$([ "$CUDA" = 1 ] && echo "needs 2 GPUs (a training and a rollout rank), $GPUS visible" \
    || echo 'needs CUDA (the CPU figure: python -m bench.bench_step --placement split, in bench/results)')"
fi

if [ "$CUDA" = 1 ] && command -v nsys >/dev/null; then
  nsys_stage() {
    nsys profile -o "$OUT/work/profile" --force-overwrite true -t cuda,nvtx --capture-range=cudaProfilerApi \
      --capture-range-end=stop "$PY" -m fastcredit.train --config configs/debug.yaml --profile \
      "logging.output_dir=$OUT/work/train_nsys" "data.world_dir=$OUT/work/world" optim.total_steps=4 \
      eval.questions=0 data.toy.num_questions=200 logging.checkpoint_every=0 \
      && nsys stats -q -r cuda_gpu_kern_sum,nvtx_sum -f csv -o "$OUT/profile" "$OUT/work/profile.nsys-rep" \
      && record nsys passed "profile_cuda_gpu_kern_sum.csv, profile_nvtx_sum.csv (the report: work/)" \
      || record nsys failed "see nsys.log"
  }
  export -f nsys_stage
  run_stage nsys nsys_stage
elif want nsys; then
  record nsys "not run" "$([ "$CUDA" = 1 ] && echo 'nsys is not on PATH' || echo 'needs CUDA')"
fi

# each records "not run" and why without CUDA or an importable vLLM (on the lent image: the kit, docs/gpu.md); without
# CUDA one process records all of them (a process each would import torch six times for the same answer)
if [ "$CUDA" = 1 ]; then
  for s in $VLLM_STAGES; do run_stage "$s" "$PY" -m tools.gpu.gpu_check_vllm "${s#vllm_}" "$OUT"; done
else
  VLLM_WANTED=$(for s in $VLLM_STAGES; do want "$s" && echo "${s#vllm_}"; done | paste -sd, -)
  [ -z "$VLLM_WANTED" ] || "$PY" -m tools.gpu.gpu_check_vllm "$VLLM_WANTED" "$OUT" 2>&1 | tee "$OUT/vllm.log"
fi

"$PY" -m tools.gpu.gpu_check summary "$OUT"
