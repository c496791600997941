#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets up .venv and Bazel (scripts/bootstrap.sh),
# builds the package with pip (CMake), then `bazel test //...`, which builds cc/ again with
# Bazel and runs the C++ scheduler test and the pytest suite against the Bazel-built
# extension. GPU tests skip without >= 2 GPUs (run scripts/gpu_check.sh on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export JAX_HOCCL_PYTHON="$PWD/.venv/bin/python"
log=$(mktemp)
status=0
bazel test //... --test_output=all 2>&1 | tee "$log" || status=$?
bazel shutdown >/dev/null 2>&1 || true
# One closing line that CI can read: the pytest summary counts.
summary=$(grep -E "^=+ .*(passed|failed|error).* in [0-9.]+s" "$log" | tail -1 || true)
passed=$(echo "$summary" | grep -oE "[0-9]+ passed" | grep -oE "[0-9]+" || echo 0)
failed=$(echo "$summary" | grep -oE "[0-9]+ (failed|errors?)" | awk '{s += $1} END {print s + 0}')
skipped=$(echo "$summary" | grep -oE "[0-9]+ skipped" | grep -oE "[0-9]+" || echo 0)
[ -n "$failed" ] || failed=0
if [ "$status" -ne 0 ] && [ "$failed" = 0 ]; then failed=1; fi
echo "tests: ${passed:-0} passed, ${failed} failed, ${skipped:-0} skipped"
exit "$status"
