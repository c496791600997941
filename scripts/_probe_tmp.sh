export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 JAX_HOCCL_COMMIT=wip-data-deps
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(command -v python3) >/dev/null && cmake --build build/gpu >/dev/null && cp build/gpu/_hoccl*.so jax_hoccl/
export PYTHONPATH=$PWD
timeout 250 python3 -m pytest tests/test_gpu.py tests/test_gpu_rows_matmul.py -q -p no:cacheprovider 2>&1 | tail -4 > $OUT/tests.txt
PROBE_TIMELINE=summary python3 benchmarks/probe_fused.py all_gather_matmul > $OUT/tl_agmm.txt 2>&1
timeout 300 python3 benchmarks/bench.py --fused-only > $OUT/bench.txt 2>&1; cp benchmarks/results/*fused.json $OUT/
cat $OUT/tests.txt; grep -E "x1\.|calls in|busy|idle" $OUT/tl_agmm.txt | head -12
grep "^fused" $OUT/bench.txt
