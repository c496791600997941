#!/usr/bin/env bash
# What a new user does first on a GPU machine, in one call: install jax_hoccl into the machine's
# Python as the README says, run the quick start, both examples on one GPU, both through
# `python -m jax_hoccl.launch` with 2 and 4 ranks (sharing the GPU under MPS when there are fewer
# GPUs than ranks; `--fused --bf16` once too), then the README's main job
# (scripts/run_example.sh, which makes .venv from that Python without a package index). One line
# each: MATCH / OK / SKIPPED or the error; a summary table last. Logs: $OUT (default
# /tmp/jax_hoccl_first_contact): first_contact.log (every run's output) and summary.txt.
#   bash scripts/gpu_first_contact.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
unset PYTHONPATH  # the installed package, not src/
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/jax_hoccl_first_contact}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/first_contact.log"
: >"$LOG"
ROWS=()
t_start=$(date +%s)

# step NAME TIMEOUT EXPECT COMMAND...: runs COMMAND, logs it, and records one row. EXPECT says
# what success looks like: "match N" (N ranks each print MATCH, or one process: a MATCH line),
# "ok TEXT" (TEXT in the output). The example runs must also have run on the GPU.
step() {
  local name=$1 limit=$2 expect=$3; shift 3
  local out rc t0 status detail
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$LOG"
  out=$(timeout "$limit" "$@" 2>&1); rc=$?
  printf '%s\n' "$out" >>"$LOG"
  status=FAIL
  case "$expect" in
    match\ 1) grep -qE '(^|: )MATCH$' <<<"$out" && status=MATCH ;;
    match\ *) local n=${expect#match } i ok=1
              for ((i = 0; i < n; i++)); do grep -qE "^\[$i\] (.*: )?MATCH$" <<<"$out" || ok=0; done
              [ $ok = 1 ] && status=MATCH ;;
    ok\ *) grep -qF -- "${expect#ok }" <<<"$out" && status=OK ;;
  esac
  if [[ "$name" == *example* || "$name" == *launch* ]] && ! grep -q " gpu devices\| on [0-9]* gpu" <<<"$out"; then
    status=FAIL; detail="did not run on the GPU"
  fi
  [ "$rc" -ne 0 ] && [ "$status" != FAIL ] && status=FAIL
  if [ "$status" = FAIL ]; then
    [ "$rc" = 124 ] && detail="timed out after $limit s"
    : "${detail:=exit $rc: $(grep -E 'Error|error:|MISMATCH|FAIL|DID NOT|Traceback' <<<"$out" | grep -v '^ ' | tail -1 | cut -c1-160)}"
  fi
  local row
  row=$(printf '%-44s %-8s %4d s  %s' "$name" "$status" $(( $(date +%s) - t0 )) "${detail:-}")
  echo "$row"
  ROWS+=("$row")
}

skip() {
  local row
  row=$(printf '%-44s %-8s %4s    %s' "$1" SKIPPED - "$2")
  echo "$row"; ROWS+=("$row")
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "python: $(command -v "$PY") ($($PY --version 2>&1)), $($PY -c 'import importlib.metadata as md; print("jax", md.version("jax"), "jaxlib", md.version("jaxlib"))' 2>&1)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo "${JAX_HOCCL_COMMIT:-?}")"
} | tee -a "$LOG"

step "pip install --no-build-isolation --no-deps ." 400 "ok Successfully installed" \
  $PY -m pip install --no-build-isolation --no-deps .
step "import: CUDA engine built" 60 "ok with_cuda True" \
  $PY -P -c 'import jax_hoccl; print("with_cuda", jax_hoccl.with_cuda)'
step "quickstart" 120 "ok match jax.lax" $PY -P examples/quickstart.py
step "example transformer, 1 GPU" 150 "match 1" $PY -P examples/train_transformer.py
step "example transformer --fused --bf16, 1 GPU" 150 "match 1" \
  $PY -P examples/train_transformer.py --fused --bf16
for n in 2 4; do
  step "launch -n $n transformer" 200 "match $n" \
    $PY -P -m jax_hoccl.launch -n $n examples/train_transformer.py
done
step "launch -n 2 transformer --fused --bf16" 200 "match 2" \
  $PY -P -m jax_hoccl.launch -n 2 examples/train_transformer.py --fused --bf16
if $PY -c "import flax, optax" >/dev/null 2>&1; then
  step "example flax, 1 GPU" 150 "match 1" $PY -P examples/train_flax.py
  for n in 2 4; do
    step "launch -n $n flax" 200 "match $n" $PY -P -m jax_hoccl.launch -n $n examples/train_flax.py
  done
else
  for name in "example flax, 1 GPU" "launch -n 2 flax" "launch -n 4 flax"; do
    skip "$name" "flax/optax not installed in $PY"
  done
fi
# The README's main job from a fresh .venv (no Bazel; offline: the GPU jax of $PY is reused).
step "example: bash scripts/run_example.sh" 300 "match 1" \
  env JAX_HOCCL_BOOTSTRAP_PYTHON="$(command -v "$PY")" bash scripts/run_example.sh

{ echo
  echo "================ summary ($(( $(date +%s) - t_start )) s) ================"
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUTDIR/summary.txt"
cat "$OUTDIR/summary.txt" >>"$LOG"
! grep -q " FAIL " "$OUTDIR/summary.txt"
