#!/usr/bin/env bash
# What a user does: a fresh environment with some jax, then a plain `pip install .` (isolated
# build: pip makes its own build environment from pyproject.toml), then run the quick start
# from the checkout's root (where the source tree must not shadow the installed package).
# Checked for the oldest supported jax and the newest on PyPI; the checkout is a copy that the
# build must leave unchanged (a read-only checkout then installs too).
#   bash scripts/check_pip_install.sh [jax versions...]   (default: 0.11.2 newest)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
versions=("$@")
if (( ${#versions[@]} == 0 )); then versions=(0.11.2 newest); fi

find_python() {
  for p in "$HOME/.pyenv/versions/3.12.1/bin/python3" python3.12 python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      echo "$p"; return
    fi
  done
  echo "check_pip_install.sh: no Python >= 3.12" >&2; exit 1
}
PY="$(find_python)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The checkout as a user has it: tracked and untracked-but-not-ignored files only.
src="$work/jax_hoccl"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$src"
listing() { (cd "$src" && find . -print | sort); }
before="$(listing)"

for v in "${versions[@]}"; do
  echo "== pip install . into a fresh venv with jax ${v}"
  venv="$work/venv-$v"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if [ "$v" = newest ]; then
    "$venv/bin/python" -m pip install -q jax jaxlib
  else
    "$venv/bin/python" -m pip install -q "jax==$v" "jaxlib==$v"
  fi
  "$venv/bin/python" -m pip install -q "$src"
  (cd "$src" && "$venv/bin/python" examples/quickstart.py)
  if [ "$(listing)" != "$before" ]; then
    echo "check_pip_install.sh: pip install wrote into the source tree:" >&2
    diff <(echo "$before") <(listing) >&2 || true
    exit 1
  fi
done
echo "check_pip_install.sh: plain pip install works with jax ${versions[*]}"
