#!/usr/bin/env bash
# The main job: train the data x tensor parallel transformer with jax_hoccl collectives on
# whatever devices exist (8 virtual CPU devices without a GPU; with one, the GPU jax that
# scripts/bootstrap.sh found or installed), checked against jax.lax.
set -euo pipefail
cd "$(dirname "$0")/.."
SKIP_BAZEL=1 bash scripts/bootstrap.sh
exec .venv/bin/python -P examples/train_transformer.py "$@"
