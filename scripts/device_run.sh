#!/usr/bin/env bash
# One device run for issue 22 (NVIDIA H200), no network needed. Run from the repo root after
# `bash scripts/prepare_device_payload.sh` (builds the git-ignored device_payload/), through the
# device tool with carry=["device_payload"]:
#   run(command="bash scripts/device_run.sh", carry=["device_payload"], timeout_s=600)
# Stages (each with its own timeout inside a total budget, DEVICE_RUN_BUDGET_S=560 by default; a
# failed or skipped stage is recorded and the next one runs), every stage's JSON and log under
# $OUT (default ./results/device):
#   1 e2e      scripts/device_e2e.py: stories260K greedy vs llama2.c, attn_impl auto and pallas_gpu
#   2 kernels  scripts/device_check_kernels.py: kernel tests compiled for the GPU, timings vs XLA,
#              jax's pallas gpu ops, cuDNN, torch SDPA flash, FlashAttention fwd/bwd
#   3 serving  scripts/bench_serving.py: random llama1b (built locally), bf16, 64 prompts, beside
#              transformers generate (static batches) and generate_batch, on cuda
#   4 roofline scripts/bench_roofline.py: llama1b bf16 decode, batch 1 and 64, vs bandwidth
# DEVICE_RUN_DRY=1: the CPU dry run (tiny/interpreted variants of each stage, seconds each).
# DEVICE_RUN_STAGES="serving roofline" (say): only those stages (a re-run of what the budget cut).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/results/device}"
mkdir -p "$OUT"
DRY="${DEVICE_RUN_DRY:-0}"
BUDGET="${DEVICE_RUN_BUDGET_S:-560}"
START=$(date +%s)
PAYLOAD="$PWD/device_payload"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAXINFER_SHARED="${JAXINFER_SHARED:-$PAYLOAD/shared}"
export JAXINFER_CACHE_DIR="${JAXINFER_CACHE_DIR:-/tmp/jaxinfer_device_cache}"
export JAXINFER_RESULTS_DIR="$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-python}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY" >&2; }

note "device_run $(date -u +%FT%TZ) dry=$DRY budget=${BUDGET}s git=$(git rev-parse --short HEAD 2>/dev/null || echo none)"
"$PY" - >"$OUT/env.json" 2>>"$OUT/env.log" <<'PYEOF'
import json, importlib
info = {}
for m in ("jax", "jaxlib", "torch", "transformers", "triton", "pytest", "numpy"):
    try:
        info[m] = importlib.import_module(m).__version__
    except Exception as e:
        info[m] = f"missing: {type(e).__name__}: {e}"
try:
    import jax
    info["backend"], info["devices"] = jax.default_backend(), [str(d) for d in jax.devices()]
except Exception as e:
    info["backend"] = f"error: {e}"
print(json.dumps(info, indent=1))
PYEOF
note "env: $(tr -d '\n' < "$OUT/env.json")"
if [ ! -f "$JAXINFER_SHARED/models/stories260K/greedy_reference.json" ]; then
  note "WARNING: $JAXINFER_SHARED/models/stories260K missing: run scripts/prepare_device_payload.sh and carry device_payload"
fi
# pytest for the kernel tests: offline from the payload's wheels when the device lacks it.
if ! "$PY" -c "import pytest" 2>/dev/null; then
  if ls "$PAYLOAD"/wheels/pytest-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$PAYLOAD/wheels" --target "$PAYLOAD/pylib" pytest \
      >"$OUT/pip_pytest.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$PAYLOAD/pylib"
    note "pytest installed from payload wheels: rc=$?"
  else
    note "pytest missing and no payload wheels: the kernel tests will fail to start"
  fi
fi

# stage NAME SECONDS CMD...: runs CMD with min(SECONDS, budget left) as its timeout; stdout to
# $OUT/NAME.json, stderr to $OUT/NAME.log; records rc and time; skipped when < 20 s remain.
stage() {
  local name=$1 want=$2; shift 2
  case " ${DEVICE_RUN_STAGES:-e2e kernels serving roofline} " in
    *" $name "*) ;;
    *) note "stage $name: not selected (DEVICE_RUN_STAGES)"; return ;;
  esac
  local left=$(( BUDGET - ($(date +%s) - START) ))
  local t=$(( want < left ? want : left ))
  if [ "$t" -lt 20 ]; then note "stage $name: SKIPPED (only ${left}s of the budget left)"; return; fi
  local t0=$(date +%s)
  timeout -k 10 "$t" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  local rc=$?
  note "stage $name: rc=$rc ($([ $rc -eq 124 ] && echo "TIMEOUT after ${t}s" || echo "$(( $(date +%s) - t0 ))s")) -> $OUT/$name.json"
}

have_cuda() { "$PY" -c "import jax,sys; sys.exit(jax.default_backend()!='gpu')" 2>/dev/null; }

if [ "$DRY" = 1 ]; then
  stage e2e 120 "$PY" scripts/device_e2e.py --attn-impls xla,pallas_gpu_interpret --max-cases 1
  stage kernels 120 "$PY" scripts/device_check_kernels.py --cpu-smoke
  stage serving 150 "$PY" scripts/bench_serving.py --quick --hf-generate-batch
  stage roofline 90 "$PY" scripts/bench_roofline.py --quick
else
  if ! have_cuda; then note "jax sees no GPU (backend $("$PY" -c 'import jax; print(jax.default_backend())' 2>&1 | tail -1)): device stages will report it"; fi
  HFDEV=cpu; "$PY" -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null && HFDEV=cuda
  note "transformers device: $HFDEV"
  stage e2e 90 "$PY" scripts/device_e2e.py --attn-impls auto,pallas_gpu,xla
  stage kernels 300 "$PY" scripts/device_check_kernels.py --iters 20
  stage serving 200 "$PY" scripts/bench_serving.py --models llama1b --num-prompts 64 \
    --engine-dtype bfloat16 --hf-dtypes bfloat16 --hf-device "$HFDEV" --hf-batch-size 16 \
    --hf-generate-batch --max-num-seqs 64
  stage roofline 80 "$PY" scripts/bench_roofline.py --models llama1b --dtype bfloat16 \
    --batch-sizes 1,64 --quantization none --steps 16 --bandwidth-mb 2048
fi
note "device_run done in $(( $(date +%s) - START ))s"
exit 0
