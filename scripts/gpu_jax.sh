#!/usr/bin/env bash
# Which jax scripts/bootstrap.sh puts in .venv, decided without installing anything and without
# starting a jax backend. Prints one line:
#   cpu                     no NVIDIA GPU (nvidia-smi missing, failing, or listing none)
#   reuse PYTHON            a Python on PATH (JAX_HOCCL_BOOTSTRAP_PYTHON first, then python3,
#                           python3.12) already has jax >= 0.11.2 with a CUDA plugin of jaxlib's
#                           version: .venv uses its packages (the way offline GPU machines work)
#   install jax[cudaNN]     otherwise, jax's CUDA build for the driver's CUDA version (the
#                           "CUDA Version" nvidia-smi prints: 13.x -> cuda13, 12.x -> cuda12)
# Exits non-zero, saying why, for a driver too old for either build.
#   bash scripts/gpu_jax.sh --check PYTHON   exits 0 if PYTHON has such a jax (same test)
set -euo pipefail

MIN_JAX=0.11.2
# jax, jaxlib and a jax-cudaNN-plugin (with its pjrt) of jaxlib's version, by package metadata.
HAS_GPU_JAX=$(cat <<EOF
import importlib.metadata as md, re, sys
def version(name):
    try:
        return tuple(int(p) for p in re.findall(r"\d+", md.version(name))[:3])
    except md.PackageNotFoundError:
        return None
jax, jaxlib = version("jax"), version("jaxlib")
ok = (sys.version_info >= (3, 12) and jax is not None and jaxlib is not None
      and jax >= tuple(int(p) for p in "$MIN_JAX".split(".")))
ok = ok and any(version(f"jax-cuda{v}-plugin") == jaxlib and version(f"jax-cuda{v}-pjrt") == jaxlib
                for v in (13, 12))
sys.exit(0 if ok else 1)
EOF
)

has_gpu_jax() { "$1" -c "$HAS_GPU_JAX" >/dev/null 2>&1; }

if [ "${1:-}" = --check ]; then
  has_gpu_jax "$2"
  exit
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! gpus=$(nvidia-smi -L 2>/dev/null) ||
   ! grep -q "^GPU [0-9]" <<<"$gpus"; then
  echo cpu
  exit 0
fi

for p in "${JAX_HOCCL_BOOTSTRAP_PYTHON:-}" python3 python3.12; do
  [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 || continue
  if has_gpu_jax "$p"; then
    echo "reuse $(command -v "$p")"
    exit 0
  fi
done

cuda=$(nvidia-smi 2>/dev/null | grep -o "CUDA Version: *[0-9]*" | grep -o "[0-9]*$" || true)
case "$cuda" in
  1[3-9]|[2-9][0-9]) echo "install jax[cuda13]" ;;
  12) echo "install jax[cuda12]" ;;
  *) echo "gpu_jax.sh: the NVIDIA driver supports CUDA '${cuda:-?}' (nvidia-smi); jax's CUDA" \
          "builds need 12 or 13: update the driver" >&2
     exit 1 ;;
esac
