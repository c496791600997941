export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(command -v python3) >/dev/null && cmake --build build/gpu >/dev/null && cp build/gpu/_hoccl*.so jax_hoccl/
export PYTHONPATH=$PWD
timeout 250 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "between_start or psum_ring_on_gpu" 2>&1 | grep -E "^E |passed|failed|FAILED" | head -40
