#!/usr/bin/env bash
# Creates .venv (Python 3.12) with jax_hoccl's dependencies and installs jax_hoccl into it
# (pip builds cc/ with CMake). Idempotent: a second run only rebuilds the package.
# Env: JAX_VERSION (default 0.11.2, the version on the GPU machines), SKIP_BAZEL=1.
# With an NVIDIA GPU (scripts/gpu_jax.sh) .venv gets a jax that runs on it: the GPU jax that
# python3 already has (seen through a .pth file), else jax's CUDA build from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for p in "${JAX_HOCCL_BOOTSTRAP_PYTHON:-}" "$HOME/.pyenv/versions/3.12.1/bin/python3" \
           "$(command -v pyenv >/dev/null 2>&1 && pyenv root 2>/dev/null)/versions/3.12.1/bin/python3" \
           python3.12 python3; do
    [ -n "$p" ] || continue
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      echo "$p"; return
    fi
  done
  echo "jax_hoccl needs Python >= 3.12 (jax >= 0.11); none found" >&2; exit 1
}

# With an NVIDIA GPU, a jax that runs on it (scripts/gpu_jax.sh decides, installing nothing).
JAX_CHOICE=$(bash scripts/gpu_jax.sh)
if [ "$JAX_CHOICE" = cpu ]; then
  if [ ! -x .venv/bin/python ]; then
    "$(find_python)" -m venv .venv
  fi
  PY=.venv/bin/python
  JAX_VERSION="${JAX_VERSION:-0.11.2}"
  if ! $PY -c "import jax, nanobind, scikit_build_core, pytest, matplotlib" >/dev/null 2>&1; then
    $PY -m pip install -q --upgrade pip
    $PY -m pip install -q "jax==${JAX_VERSION}" "jaxlib==${JAX_VERSION}" nanobind scikit-build-core pytest numpy matplotlib
  fi
  # flax and optax for examples/train_flax.py and its test (the pins of pyproject.toml's
  # `examples` extra; ~10 s and ~125 MB from the package index, once).
  if ! $PY -c "import flax, optax" >/dev/null 2>&1; then
    # (jax named too, so that pip never swaps the jax under test for another)
    $PY -m pip install -q "flax==0.12.12" "optax==0.2.8" "jax==${JAX_VERSION}" "jaxlib==${JAX_VERSION}"
  fi
  # The linters scripts/run_tests.sh runs, pinned: another version formats differently.
  RUFF_VERSION=0.17.6 CLANG_FORMAT_VERSION=23.1.5
  if ! { .venv/bin/ruff --version 2>/dev/null | grep -qx "ruff ${RUFF_VERSION}" &&
         .venv/bin/clang-format --version 2>/dev/null | grep -q "version ${CLANG_FORMAT_VERSION}"; }; then
    $PY -m pip install -q "ruff==${RUFF_VERSION}" "clang-format==${CLANG_FORMAT_VERSION}"
  fi
else
  PY=.venv/bin/python
  case "$JAX_CHOICE" in
    reuse\ *)
      # That Python's jax and the rest of its packages, seen from .venv through a .pth file (a
      # venv made from a venv does not see its packages, even with --system-site-packages).
      GPU_PY=${JAX_CHOICE#reuse }
      if [ ! -x $PY ]; then "$GPU_PY" -m venv .venv; fi
      version='import sys; print(sys.version_info[:2])'
      if [ "$($PY -c "$version")" != "$("$GPU_PY" -c "$version")" ]; then
        echo "bootstrap.sh: .venv is for another Python than $GPU_PY (whose GPU jax it would" \
             "use): remove .venv and run again" >&2
        exit 1
      fi
      site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      "$GPU_PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        >"$site/jax_hoccl_gpu_python.pth"
      ;;
    install\ *)
      if [ ! -x $PY ]; then "$(find_python)" -m venv .venv; fi
      if ! bash scripts/gpu_jax.sh --check $PY; then
        $PY -m pip install -q --upgrade pip
        $PY -m pip install -q "${JAX_CHOICE#install }==${JAX_VERSION:-0.11.2}"
      fi
      ;;
  esac
  if ! bash scripts/gpu_jax.sh --check $PY; then
    echo "bootstrap.sh: .venv's jax has no CUDA plugin of jaxlib's version (.venv made before," \
         "for another Python or jax?): remove .venv and run again" >&2
    exit 1
  fi
  # What pip's build of jax_hoccl needs (the main job needs nothing else), then what the tests,
  # the Flax example and the linters need: without a package index (an offline GPU machine)
  # those are left out with a warning, and only the main job runs.
  if ! $PY -c "import nanobind, scikit_build_core" >/dev/null 2>&1; then
    $PY -m pip install -q nanobind scikit-build-core
  fi
  jax_pin="jax==$($PY -c 'import importlib.metadata as md; print(md.version("jax"))')"
  extras=()
  $PY -c "import pytest" >/dev/null 2>&1 || extras+=(pytest)
  $PY -c "import matplotlib" >/dev/null 2>&1 || extras+=(matplotlib)
  $PY -c "import flax, optax" >/dev/null 2>&1 || extras+=("flax==0.12.12" "optax==0.2.8")
  if [ ${#extras[@]} -gt 0 ] && ! $PY -m pip install -q --retries 1 --timeout 10 "${extras[@]}" "$jax_pin"; then
    echo "bootstrap.sh: could not install ${extras[*]} (no package index?): the main job runs;" \
         "the tests and the Flax example need them" >&2
  fi
  # (into .venv/bin even if the reused Python has them: scripts/run_tests.sh runs them from there)
  RUFF_VERSION=0.17.6 CLANG_FORMAT_VERSION=23.1.5
  if ! { .venv/bin/ruff --version 2>/dev/null | grep -qx "ruff ${RUFF_VERSION}" &&
         .venv/bin/clang-format --version 2>/dev/null | grep -q "version ${CLANG_FORMAT_VERSION}"; } &&
     ! $PY -m pip install -q --retries 1 --timeout 10 --ignore-installed "ruff==${RUFF_VERSION}" \
         "clang-format==${CLANG_FORMAT_VERSION}"; then
    echo "bootstrap.sh: could not install ruff and clang-format (no package index?): the main" \
         "job runs; scripts/run_tests.sh's lint needs them" >&2
  fi
fi
# Build and install jax_hoccl itself (the CUDA engine too when nvcc is found).
$PY -m pip install -q --no-build-isolation --no-deps --force-reinstall .

if [ "${SKIP_BAZEL:-0}" != 1 ] && ! command -v bazel >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap) >/dev/null
  else
    echo "bazel not found and apt-get unavailable: install bazel-bootstrap" >&2; exit 1
  fi
fi
