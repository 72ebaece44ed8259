#!/usr/bin/env bash
# The 8xH100 CriticSearch run rehearsed on this machine's CPU: SmolLM2-135M-Instruct on 2 gloo ranks under torchrun
# (configs/rehearsal_smollm2.yaml), a few steps, then per-phase seconds, host memory per rank and held-out EM into
# bench/results/rehearsal_<device>.{json,md}.
#
#   bash bench/rehearsal.sh                     # 3 steps
#   STEPS=1 bash bench/rehearsal.sh eval.questions=4 optim.batch_prompts=2 optim.mini_batch_prompts=2
#
# The policy starts from the config's warm start (the one that makes SmolLM2 search, configs/race_smollm2.yaml's),
# made first in one process on both cores and kept in WARMSTART (about 30 minutes the first time on a shared 2-core
# machine): the torchrun job, and every later rehearsal, load it.
#
# Env: PY (default .venv/bin/python), STEPS (3), RUN (runs/rehearsal_smollm2; replaced), MODEL (the de-quantised
# SmolLM2 folder, made once: runs/smollm2-135m-instruct), WARMSTART (runs/rehearsal_warmstart; kept). Extra arguments
# are key=value overrides of the config.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-3}
RUN=${RUN:-runs/rehearsal_smollm2}
MODEL=${MODEL:-runs/smollm2-135m-instruct}
WARMSTART=${WARMSTART:-runs/rehearsal_warmstart}
CONFIG=configs/rehearsal_smollm2.yaml
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}

"$PY" -m bench.rehearsal model "$MODEL"
rm -rf "$RUN"
overrides=(optim.total_steps="$STEPS" logging.output_dir="$RUN" model.policy="$MODEL" judges.model="$MODEL"
  warmstart.cache_dir="$WARMSTART" "$@")
mkdir -p "$RUN"
"$PY" -m bench.rehearsal warmstart --config "$CONFIG" "${overrides[@]}"
"$PY" -m bench.rehearsal watch --rss "$RUN/rss.json" -- \
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m fastcredit.train --config "$CONFIG" \
  "${overrides[@]}"
"$PY" -m bench.rehearsal report --run "$RUN" --rss "$RUN/rss.json" --config "$CONFIG" --ranks 2 \
  --threads "$OMP_NUM_THREADS" "${overrides[@]}"
