#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets up .venv and Bazel (scripts/bootstrap.sh),
# builds the package with pip (CMake), checks lint and format (ruff, clang-format), builds
# cc/cuda/ipc_memory_test.cc (with nvcc), then
# `bazel test //...`, which builds cc/ again with Bazel and runs the C++ scheduler test and
# the pytest suite against the Bazel-built extension, and finally what a user does: a plain
# (isolated) `pip install .` into fresh environments with the oldest supported and the newest
# jax (scripts/check_pip_install.sh).
# GPU tests skip without a GPU (run scripts/gpu_check.sh on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export JAX_HOCCL_PYTHON="$PWD/.venv/bin/python"
log=$(mktemp)
status=0
# Lint and format (pyproject.toml's ruff rules, .clang-format), the docs' layout against the
# tree and the lowering's limits against the engine's (tests/test_docs.py and
# tests/test_engine_limits.py need the checkout, which Bazel's test copy is not).
lint() {
  # (each step returns on failure itself: set -e does not apply left of `||`)
  .venv/bin/ruff check --quiet . || return 1
  find cc -name '*.cc' -o -name '*.h' | xargs .venv/bin/clang-format --dry-run --Werror || return 1
  local out  # kept out of the log: its pytest summary is not the suite's
  out=$(.venv/bin/python -P -m pytest -q -p no:cacheprovider tests/test_docs.py \
    tests/test_engine_limits.py 2>&1) ||
    { echo "$out" | tail -20; return 1; }
  echo "run_tests.sh: lint and format clean"
}
lint_status=0
lint 2>&1 | tee "$log" || lint_status=$?
if [ "$lint_status" -ne 0 ]; then status=$lint_status; fi
# cc/cuda/ipc_memory_test.cc wherever the CUDA toolkit is: it needs a GPU only to run (without
# one it says SKIPPED; scripts/gpu_check.sh runs it on one).
ipc_test() {
  if ! command -v nvcc >/dev/null 2>&1; then echo "run_tests.sh: ipc_memory_test: no nvcc"; return 0; fi
  cmake -S . -B build/ipc_memory_test -DPython_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null &&
    cmake --build build/ipc_memory_test --target ipc_memory_test >/dev/null || return 1
  echo "run_tests.sh: ipc_memory_test: $(build/ipc_memory_test/ipc_memory_test | tail -1)"
}
ipc_status=0
ipc_test 2>&1 | tee -a "$log" || ipc_status=$?
if [ "$ipc_status" -ne 0 ]; then status=$ipc_status; fi
bazel test //... --test_output=all 2>&1 | tee -a "$log" || status=$?
bazel shutdown >/dev/null 2>&1 || true
pip_status=0
bash scripts/check_pip_install.sh 2>&1 | grep -v "^WARNING: Location" | tee -a "$log" || pip_status=$?
if [ "$pip_status" -ne 0 ]; then status=$pip_status; fi
# One closing line that CI can read: the pytest summary counts (e.g. "655 passed, 119 skipped,
# 2 xfailed in 133.05s") plus the C++ test.
summary=$(grep -E "[0-9]+ passed.* in [0-9.]+s" "$log" | tail -1 || true)
count() { echo "$summary" | grep -oE "[0-9]+ $1" | awk '{s += $1} END {print s + 0}' || true; }
passed=$(count passed); failed=$(( $(count failed) + $(count error) )); skipped=$(count skipped)
if grep -q "//cc:plan_test .*PASSED" "$log"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
if grep -q "run_tests.sh: lint and format clean" "$log"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
if grep -qE "ipc_memory_test: (no nvcc|SKIPPED|ALL PASSED)" "$log"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
if grep -q "check_pip_install.sh: plain pip install works" "$log"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit "$status"
