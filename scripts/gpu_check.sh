#!/usr/bin/env bash
# One call on a multi-GPU machine: build jax_hoccl with its CUDA engine, run the GPU tests,
# count kernels per op with ncu, run the benchmark (results JSON under benchmarks/results/),
# and print a short summary table last. The logs and the new results JSON go to
# /tmp/jax_hoccl_gpu_check, and as one archive, gpu_check.tar.gz, to $OUT when it is set.
#   bash scripts/gpu_check.sh [--quick | --no-bench | --bench-only | --fused-only | --staged |
#                               --steps | --per-call | --decode]
# --staged (one GPU, about 6 minutes): the staged path's GPU tests under MPS (their failure
# reports among them); --steps (one GPU, about 5 minutes): bench --steps;
# --per-call (one GPU, about 5 minutes): bench --processes; --decode (one GPU, about 6
# minutes): decode's GEMV inside the psum (JAX_HOCCL_GEMV_PSUM=1) without JAX
# (benchmarks/probe_gemv_psum.cu), its GPU tests, its decode rows (bench --steps --decode),
# and its layers beside XLA's GEMV and the packed psum (probe_chain_kernels.py --decode, both
# settings). Each fits one device call
# (benchmarks/probe_chain_kernels.py, where a captured call's device time goes, runs on its
# own).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
QUICK=${1:-}   # --quick: small sizes only; --bench-only / --no-bench: one half of the job
PHASE=all
case "$QUICK" in
  --bench-only) PHASE=bench; QUICK="";;
  --no-bench) PHASE=tests; QUICK="";;
  --fused-only) PHASE=bench; QUICK="--fused-only";;  # build + the fused section (~1 min)
  --staged) PHASE=staged; QUICK="";;
  --steps) PHASE=steps; QUICK="";;
  --per-call) PHASE=per_call; QUICK="";;
  --decode) PHASE=decode; QUICK="";;
esac
OUTDIR=/tmp/jax_hoccl_gpu_check
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
STARTED="$OUTDIR/.started" && touch "$STARTED"
SUMMARY=()
# The logs and the results JSON written since the start, as one archive in $OUT.
collect() {
  find benchmarks/results -name '*.json' -newer "$STARTED" -exec cp {} "$OUTDIR/" \;
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_check.tar.gz" -C "$OUTDIR" .; fi
}

echo "== build"
# CMake directly (the GPU image's Python lacks scikit-build-core's build backend); the module
# lands next to the sources and everything below runs from the source tree.
t0=$(date +%s)
if cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v $PY)" \
     >"$OUTDIR/build.log" 2>&1 && cmake --build build/gpu >>"$OUTDIR/build.log" 2>&1; then
  cp build/gpu/_hoccl*.so src/jax_hoccl/
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  SUMMARY+=("build: ok ($(( $(date +%s) - t0 )) s), CUDA engine: $($PY -c 'import jax_hoccl; print(jax_hoccl.with_cuda)')")
else
  tail -40 "$OUTDIR/build.log"; echo "BUILD FAILED"; exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -8

if [ "$PHASE" = staged ]; then
  echo "== the staged path's GPU tests (2 and 4 processes under MPS, CUDA graphs, an absent peer, mismatches)"
  timeout 500 $PY -m pytest tests/test_gpu_multiprocess.py -v -p no:cacheprovider -k \
    "cuda_graphs or captured_call or packed or mismatch or (staged_path_under_mps and exchange_kernel)" 2>&1 |
    tee "$OUTDIR/staged_tests.log" | grep -E "TIME|PASSED|FAILED|passed|failed|Error" | tail -30
  SUMMARY+=("staged tests: $(grep -E '(passed|failed|error)' "$OUTDIR/staged_tests.log" | tail -1)")
  collect
  echo
  echo "================ summary ================"
  printf '%s\n' "${SUMMARY[@]}"
  exit 0
fi

if [ "$PHASE" = steps ]; then
  echo "== steps of small layers and decode across processes, 2 and 4 ranks under MPS"
  timeout 480 $PY -m jax_hoccl.bench --steps --out benchmarks/results 2>&1 |
    tee "$OUTDIR/steps.log" | grep -E "^(step|chain|decode)"
  collect
  echo
  echo "================ summary ================"
  printf '%s\n' "${SUMMARY[@]}"
  exit 0
fi

if [ "$PHASE" = decode ]; then
  echo "== decode's GEMV inside the psum, two ranks on two streams, without JAX"
  XLA_FFI=$($PY -c "import jax.ffi; print(jax.ffi.include_dir())")
  if nvcc -std=c++17 -arch=sm_90a -O3 -Icc -I"$XLA_FFI" benchmarks/probe_gemv_psum.cu \
       cc/cuda/staged/gemv_psum_kernel.cu -o "$OUTDIR/probe_gemv_psum" >>"$OUTDIR/build.log" 2>&1; then
    timeout 120 "$OUTDIR/probe_gemv_psum" 2>&1 | tee "$OUTDIR/probe_gemv_psum.log"
    rc=${PIPESTATUS[0]}
    SUMMARY+=("probe_gemv_psum: exit $rc; $(grep '^M ' "$OUTDIR/probe_gemv_psum.log" | cut -c1-60 | paste -sd';')")
  else
    SUMMARY+=("probe_gemv_psum: BUILD FAILED (build.log)")
  fi
  echo "== its GPU tests (2 and 4 processes under MPS, an absent peer in a CUDA graph)"
  timeout 300 $PY -m pytest tests/test_gpu_multiprocess.py -q -p no:cacheprovider -k \
    "decode" 2>&1 | tee "$OUTDIR/decode_tests.log" | grep -E "passed|failed|Error" | tail -6
  SUMMARY+=("decode tests: $(grep -E '(passed|failed|error)' "$OUTDIR/decode_tests.log" | tail -1)")
  echo "== decode's rows (bench --steps --decode): 2 ranks in CUDA graphs, GEMV inside or not"
  timeout 180 $PY -m jax_hoccl.bench --steps --decode --out benchmarks/results 2>&1 |
    tee "$OUTDIR/decode_rows.log" | grep -E "^decode"
  mapfile -t ROWS < <(grep -E '^decode' "$OUTDIR/decode_rows.log" | cut -c1-110)
  SUMMARY+=("${ROWS[@]}")
  collect  # (what a call cut short leaves in $OUT)
  for gemv in 0 1; do
    echo "== decode's layers, JAX_HOCCL_GEMV_PSUM=$gemv"
    JAX_HOCCL_GEMV_PSUM=$gemv timeout 150 $PY benchmarks/probe_chain_kernels.py --decode \
      --sums 1 --ranks 2 2>&1 | tee "$OUTDIR/decode_layers_$gemv.log" | grep -E "==|wall"
  done
  collect
  echo
  echo "================ summary ================"
  printf '%s\n' "${SUMMARY[@]}"
  exit 0
fi

if [ "$PHASE" = per_call ]; then
  echo "== per call across processes, 2 and 4 ranks under MPS"
  timeout 480 $PY -m jax_hoccl.bench --processes --out benchmarks/results 2>&1 |
    tee "$OUTDIR/per_call.log" | sed -n '/^op /,/^host time/p'
  collect
  exit 0
fi

if [ "$PHASE" != bench ]; then
echo "== ipc_memory_test (cc/cuda/ipc_memory_test.cc: two processes, one GPU)"
if cmake --build build/gpu --target ipc_memory_test >>"$OUTDIR/build.log" 2>&1; then
  timeout 300 build/gpu/ipc_memory_test >"$OUTDIR/ipc_memory_test.log" 2>&1
  grep FAIL "$OUTDIR/ipc_memory_test.log" | head -10
  SUMMARY+=("ipc_memory_test: $(tail -1 "$OUTDIR/ipc_memory_test.log")")
else
  SUMMARY+=("ipc_memory_test: BUILD FAILED (build.log)")
fi
echo "== one process per GPU: two processes sharing GPU 0 (before this shell's pytest holds the GPU)"
# (the fused ops at 1024-16384 rows per rank, 2 and 4 ranks, time-sliced and under MPS with
# the SMs shared and split, take most of it: each starts its own MPS daemon)
timeout 1500 $PY -m pytest tests/test_gpu_multiprocess.py -q -x -s -p no:cacheprovider 2>&1 | tee "$OUTDIR/gpu_multiprocess.log" | grep -E "TIME|OK |passed|failed|Error|assert" | tail -30
SUMMARY+=("gpu multiprocess tests: $(grep -E '(passed|failed|error)' "$OUTDIR/gpu_multiprocess.log" | tail -1)")
mapfile -t TIMES < <(grep "^TIME" "$OUTDIR/gpu_multiprocess.log" | sort -u | head -6)
SUMMARY+=("${TIMES[@]}")
echo "== GPU tests"
timeout 300 $PY -m pytest tests/test_gpu.py tests/test_gpu_rows_matmul.py tests/test_gpu_flagged_gemm.py -q -x -p no:cacheprovider 2>&1 | tee "$OUTDIR/gpu_tests.log" | tail -25
SUMMARY+=("gpu tests: $(grep -E '(passed|failed|error)' "$OUTDIR/gpu_tests.log" | tail -1)")

echo "== kernels launched per op (ncu)"
KERN=""
if command -v ncu >/dev/null 2>&1; then
  for op in all_gather all_to_all ppermute psum psum_scatter; do
    log="$OUTDIR/ncu_$op.log"
    timeout 180 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
      $PY benchmarks/kernel_check.py $op >"$log" 2>&1
    k=$(grep -c 'gpu__time_duration' "$log")
    names=$(grep 'gpu__time_duration' "$log" | awk -F'","' '{print $5}' | sort | uniq -c | head -3 | tr -s ' ' | tr '\n' ';')
    KERN+="$op=$k "
    echo "  $op: $k kernel launches in 3 calls ${names}"
  done
else
  KERN="ncu not found"
fi
SUMMARY+=("kernels (3 calls each): $KERN")
fi

if [ "$PHASE" = tests ]; then QUICK=--quick; fi
# one GPU: only the flagged GEMM against XLA's dot means something (the collectives need two)
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -lt 2 ] && [ -z "$QUICK" ]; then QUICK=--gemm-only; fi
echo "== benchmark $QUICK"
timeout 420 $PY -m jax_hoccl.bench $QUICK --out benchmarks/results 2>&1 | tee "$OUTDIR/bench.log" | grep -v "^  "
if [ "$NGPU" -lt 2 ] && [ "$QUICK" = --gemm-only ]; then
  # one GPU: ranks share it under MPS (per call; the fused ops with the SMs split)
  echo "== per call across processes, 2 and 4 ranks under MPS"
  timeout 300 $PY -m jax_hoccl.bench --processes --out benchmarks/results 2>&1 | tee "$OUTDIR/per_call.log" | tail -20
  echo "== steps of small layers and decode across processes, 2 and 4 ranks under MPS"
  timeout 360 $PY -m jax_hoccl.bench --steps --out benchmarks/results 2>&1 | tee "$OUTDIR/steps.log" | grep -E "^(step|chain|decode)"
  echo "== the fused ops' overlap, 2 ranks under MPS with the SMs split"
  timeout 400 $PY -m jax_hoccl.bench --overlap --out benchmarks/results 2>&1 | tee "$OUTDIR/overlap.log" | tail -10
fi
collect

echo
echo "================ summary ================"
printf '%s\n' "${SUMMARY[@]}"
sed -n '/^op  /,$p' "$OUTDIR/bench.log"
