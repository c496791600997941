"""docs/development.md's layout names files that exist; every environment variable the code
reads is one jax_hoccl knows and docs/supported.md names. (Run on the checkout by
scripts/run_tests.sh: Bazel's copy of the tests holds neither docs/ nor cc/.)"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVELOPMENT = ROOT / "docs" / "development.md"


def layout_paths(text):
  """The paths the layout block names: its first column, relative to the folder lines above
  (deeper indentation = inside), `a.{h,cc}` expanded, `a, b` split. Lines indented to the
  description column continue a description."""
  block = text.split("## Layout", 1)[1].split("```")[1]
  parents = []  # (indent, folder)
  paths = []
  for line in block.splitlines():
    indent = len(line) - len(line.lstrip())
    if not line.strip() or indent >= 20:
      continue
    while parents and parents[-1][0] >= indent:
      parents.pop()
    base = parents[-1][1] if parents else ""
    names = re.split(r"\s{2,}", line.strip())[0]
    for name in re.findall(r"[^\s,{]+(?:\{[^}]*\}[^\s,]*)?", names):
      brace = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
      for expanded in ([brace[1] + x + brace[3] for x in brace[2].split(",")] if brace else [name]):
        paths.append(base + expanded)
      if name.endswith("/"):
        parents.append((indent, base + name))
  return paths


@pytest.mark.skipif(not DEVELOPMENT.exists(), reason="needs the checkout (not Bazel's copy)")
def test_layout_names_existing_files():
  paths = layout_paths(DEVELOPMENT.read_text())
  assert len(paths) > 40
  missing = [p for p in paths if not (ROOT / p).exists()]
  assert not missing, f"docs/development.md names files that do not exist: {missing}"
  unnamed = [str(f.relative_to(ROOT)) for f in (ROOT / "cc").rglob("*")
             if f.is_file() and str(f.relative_to(ROOT)) not in paths]
  assert not unnamed, f"docs/development.md's layout leaves out {unnamed}"


@pytest.mark.skipif(not (ROOT / "cc").exists(), reason="needs the checkout (not Bazel's copy)")
def test_every_variable_the_code_reads_is_known_and_documented():
  """A JAX_HOCCL_* variable read anywhere in cc/ or src/ is one environment.check knows (else
  setting it would warn that it does nothing) and one docs/supported.md names."""
  from jax_hoccl._src import environment
  read = set()
  for top in ("cc", "src"):
    for path in (ROOT / top).rglob("*"):
      if path.suffix in (".cc", ".h", ".cu", ".py"):
        read |= set(re.findall(r'(?:Env\w*\(|getenv\(|environ\[|environ\.get\()"'
                               r'(JAX_HOCCL_[A-Z0-9_]+)"', path.read_text()))
  assert {"JAX_HOCCL_STAGED_KERNEL", "JAX_HOCCL_STAGED_BYTES", "JAX_HOCCL_TIMEOUT_S"} <= read
  assert read - set(environment.VARIABLES) == set()
  supported = (ROOT / "docs" / "supported.md").read_text()
  scripts_only = {"JAX_HOCCL_PYTHON", "JAX_HOCCL_BOOTSTRAP_PYTHON", "JAX_HOCCL_COMMIT",
                  "JAX_HOCCL_JOB_SECRET", "JAX_HOCCL_FAILURE_LOG", "JAX_HOCCL_LAUNCH",
                  "JAX_HOCCL_NODE"}
  assert {v for v in read - scripts_only if f"`{v}`" not in supported} == set()
