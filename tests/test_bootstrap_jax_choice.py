"""scripts/gpu_jax.sh, the choice scripts/bootstrap.sh makes of the jax it puts in .venv, with
stand-ins for `nvidia-smi` and for the Pythons on PATH: no GPU -> the CPU path as before; a GPU
and a Python that already has a GPU jax -> reuse it; a GPU without one -> jax's CUDA build for
the driver's CUDA version. The stand-in Pythons see only the packages given (fake dist-info
folders), so the answer does not depend on this machine's."""
import os
import stat
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "gpu_jax.sh")

SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |
+-----------------------------------------------------------------------------------------+
"""
GPU_LIST = "GPU 0: NVIDIA H200 (UUID: GPU-5c1e6a8e-0d1b-4e55-9f2a-000000000000)\n"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"


def executable(path, text):
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def choose(tmp_path, smi=None, cuda="13.0", packages=None, args=()):
  """Runs gpu_jax.sh with PATH = stand-ins + /usr/bin:/bin; returns (exit status, output)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  if smi == "gpu":
    (tmp_path / "smi.txt").write_text(SMI_HEADER.format(cuda=cuda))
    (tmp_path / "smi-L.txt").write_text(GPU_LIST)
    executable(bin_dir / "nvidia-smi", f"#!/bin/sh\nif [ \"$1\" = -L ]; then cat {tmp_path}/smi-L.txt; "
               f"else cat {tmp_path}/smi.txt; fi\n")
  elif smi == "no driver":
    executable(bin_dir / "nvidia-smi", f"#!/bin/sh\nprintf '%s' '{NO_DRIVER}'\nexit 9\n")
  elif smi == "no gpu":
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'No devices were found'\nexit 6\n")
  site = tmp_path / "site"
  site.mkdir()
  for name, version in (packages or {}).items():
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
  # -S: none of the real interpreter's site-packages, only the fake ones (PYTHONPATH).
  wrapper = f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S \"$@\"\n"
  for name in ("python3", "python3.12"):
    executable(bin_dir / name, wrapper)
  env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
  proc = subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True,
                        timeout=60, cwd=tmp_path)
  return proc.returncode, (proc.stdout + proc.stderr).strip(), bin_dir


GPU_JAX = {"jax": "0.11.2", "jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2",
           "jax-cuda13-pjrt": "0.11.2"}


@pytest.mark.parametrize("smi", [None, "no driver", "no gpu"])
def test_no_gpu_keeps_the_cpu_path(tmp_path, smi):
  rc, out, _ = choose(tmp_path, smi=smi, packages=GPU_JAX)
  assert (rc, out) == (0, "cpu")


def test_a_python_with_a_gpu_jax_is_reused(tmp_path):
  rc, out, bin_dir = choose(tmp_path, smi="gpu", packages=GPU_JAX)
  assert (rc, out) == (0, f"reuse {bin_dir}/python3")


def test_cuda12_plugin_and_newer_jax_are_reused(tmp_path):
  packages = {"jax": "0.12.0", "jaxlib": "0.12.0", "jax-cuda12-plugin": "0.12.0",
              "jax-cuda12-pjrt": "0.12.0"}
  rc, out, bin_dir = choose(tmp_path, smi="gpu", cuda="12.8", packages=packages)
  assert (rc, out) == (0, f"reuse {bin_dir}/python3")


@pytest.mark.parametrize("packages", [
    pytest.param({"jax": "0.11.2", "jaxlib": "0.11.2"}, id="cpu-jax"),
    pytest.param({**GPU_JAX, "jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda13-plugin": "0.10.2",
                  "jax-cuda13-pjrt": "0.10.2"}, id="old-jax"),
    pytest.param({**GPU_JAX, "jax-cuda13-plugin": "0.11.1"}, id="plugin-not-jaxlibs"),
    pytest.param({k: v for k, v in GPU_JAX.items() if k != "jax-cuda13-pjrt"}, id="no-pjrt"),
    pytest.param({}, id="no-jax"),
])
@pytest.mark.parametrize("cuda,build", [("13.0", "cuda13"), ("13.1", "cuda13"),
                                        ("12.8", "cuda12")])
def test_without_a_gpu_jax_the_drivers_cuda_build_is_installed(tmp_path, packages, cuda, build):
  rc, out, _ = choose(tmp_path, smi="gpu", cuda=cuda, packages=packages)
  assert (rc, out) == (0, f"install jax[{build}]")


def test_a_driver_too_old_is_refused(tmp_path):
  rc, out, _ = choose(tmp_path, smi="gpu", cuda="11.8")
  assert rc != 0 and "CUDA '11'" in out and "update the driver" in out, out


def test_check_tells_one_interpreter(tmp_path):
  rc, _, bin_dir = choose(tmp_path, smi="gpu", packages=GPU_JAX)
  assert subprocess.run(["bash", SCRIPT, "--check", str(bin_dir / "python3")]).returncode == 0
  without = tmp_path / "other"
  without.mkdir()
  rc, _, bin_dir = choose(without, smi="gpu", packages={"jax": "0.11.2", "jaxlib": "0.11.2"})
  assert subprocess.run(["bash", SCRIPT, "--check", str(bin_dir / "python3")]).returncode == 1
