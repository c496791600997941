#!/usr/bin/env bash
# Runs the pytest suite (//:pytest_suite) against the Bazel-built extension.
# Arguments (from BUILD.bazel): python_bin.sh  src/jax_hoccl/_hoccl.so  bazel_pytest_plugin.py
# [extra pytest args...]. The current directory is the runfiles root of the workspace.
set -euo pipefail

python_bin_sh="$1"
built_so="$2"
plugin="$3"
shift 3

# shellcheck disable=SC1090
source "$python_bin_sh"  # sets PYTHON, the interpreter the extension was built against
if [[ ! -x "$PYTHON" ]]; then
  echo "run_pytest.sh: configured interpreter $PYTHON does not exist;" \
       "re-run with 'bazel sync --configure' or set JAX_HOCCL_PYTHON" >&2
  exit 1
fi

# A private, writable copy of the package and the tests: real files, so neither runfiles
# symlinks nor the source tree (which may hold a stale in-place build) are involved.
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
src="$tmp/src"
rm -rf "$src"
mkdir -p "$src"
for f in src/jax_hoccl tests examples benchmarks scripts pyproject.toml README.md; do
  if [[ -e "$f" ]]; then cp -RL "$f" "$src/"; fi
done
cp -L "$plugin" "$src/bazel_pytest_plugin.py"
chmod -R u+w "$src"
so="$src/jax_hoccl/$(basename "$built_so")"

# Subprocesses that run `python` or `pytest` by name get the same interpreter.
export PATH="$(dirname "$PYTHON"):$PATH"
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONNOUSERSITE=1
export TMPDIR="$tmp"
export HOCCL_EXPECTED_EXTENSION="$so"
export XLA_FLAGS="--xla_force_host_platform_device_count=8${XLA_FLAGS:+ $XLA_FLAGS}"
export PJRT_NPROC="${PJRT_NPROC:-16}"
cd "$src"

echo "run_pytest.sh: $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
# Fail early, with a clear message, if the import does not resolve to the Bazel-built .so.
"$PYTHON" - <<'PY'
import os, sys
import jax_hoccl._hoccl as m
want = os.environ["HOCCL_EXPECTED_EXTENSION"]
print("run_pytest.sh: jax_hoccl._hoccl from", m.__file__, "| registrations:",
      sorted(m.registrations()))
if os.path.realpath(m.__file__) != os.path.realpath(want):
    sys.exit("run_pytest.sh: jax_hoccl._hoccl was loaded from %s, not the Bazel-built %s "
             "(is jax_hoccl installed in the venv?)" % (m.__file__, want))
PY

shopt -s nullglob globstar
test_files=(tests/**/test_*.py tests/**/*_test.py)
if (( ${#test_files[@]} == 0 )); then
  echo "run_pytest.sh: no test files under tests/ yet; only the import check ran."
  exit 0
fi

junit=()
if [[ -n "${XML_OUTPUT_FILE:-}" ]]; then junit=(--junitxml="$XML_OUTPUT_FILE"); fi
# shellcheck disable=SC2086
exec "$PYTHON" -m pytest tests -q -rfE -p no:cacheprovider -p bazel_pytest_plugin \
  "${junit[@]}" ${HOCCL_TEST_ARGS:-} "$@"
