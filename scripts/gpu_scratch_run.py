# Scratch orchestration for one device call: build, executor smoke test without XLA, a
# minimal JAX repro with native backtraces, then the full check/benchmark with the first
# configuration that works. Prints a compact log; full logs go to $OUT.
import glob
import os
import re
import subprocess
import sys
import time

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "400"))
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
PY = sys.executable
ENV = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", JAX_HOCCL_TIMEOUT_S="60")


def left():
    return BUDGET - (time.time() - T0)


def run(name, cmd, timeout, env=None, keep=lambda l: True):
    t = time.time()
    try:
        p = subprocess.run(cmd, shell=True, env=env or ENV, timeout=max(5, timeout),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "TIMEOUT", (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
    with open(os.path.join(OUT, name + ".log"), "w") as f:
        f.write(out)
    print(f"--- {name}: rc={rc} {time.time() - t:.0f}s (t={time.time() - T0:.0f}s)", flush=True)
    lines = [l for l in out.splitlines() if keep(l)]
    return rc, out, lines


def show(lines, n=40):
    for l in lines[-n:]:
        print("  " + l[:300], flush=True)


def resolve_backtrace(out, so):
    # "/path/lib.so(+0x1234)[0x...]" -> addr2line for our own module
    for l in out.splitlines():
        m = re.match(r"(.*?)\((.*?)\)\[(0x[0-9a-f]+)\]", l.strip())
        if not m:
            continue
        path, sym = m.group(1), m.group(2)
        where = ""
        if "_hoccl" in path and sym.startswith("+"):
            r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", path, sym[1:]],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            where = " | ".join(r.stdout.split("\n")[:4])
        print(f"  bt {os.path.basename(path)}({sym}) {where}", flush=True)


print(subprocess.run("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; command -v gdb addr2line",
                     shell=True, stdout=subprocess.PIPE, text=True).stdout, flush=True)

# 1. build the extension (debug info, optimised) and the scratch tools
rc, out, _ = run("build", f"cmake -S . -B /tmp/hb -G Ninja -DPython_EXECUTABLE={PY} "
                 "-DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build /tmp/hb", 120)
so = (glob.glob("/tmp/hb/_hoccl*.so") or [None])[0]
if not so:
    show(out.splitlines(), 20)
    import zipfile
    z = zipfile.ZipFile(glob.glob(".whl/*.whl")[0])
    name = [x for x in z.namelist() if "/_hoccl." in x][0]
    z.extract(name, "/tmp/ext")
    so = "/tmp/ext/" + name
print("extension:", so, flush=True)
ENV["HOCCL_EXT"] = so
run("tools", "g++ -std=c++17 -O2 -g -Icc -I/usr/local/cuda/include scripts/gpu_scratch_smoke.cc "
    "cc/cuda_executor.cc cc/driver_api.cc cc/plan.cc cc/communicator.cc -L/usr/local/cuda/lib64 "
    "-lcudart_static -ldl -lrt -lpthread -o /tmp/smoke && "
    "gcc -shared -fPIC -O0 -g scripts/gpu_scratch_segv.c -o /tmp/segv.so", 90)

# 2. the executor alone (no XLA)
rc, out, lines = run("smoke", "/tmp/smoke", min(90, left() - 200),
                     env=dict(ENV, JAX_HOCCL_TIMEOUT_S="20"))
show(lines, 25)

# 3. minimal JAX repro, with tracing and native backtraces; try variants if it dies
variants = [{}, {"JAX_HOCCL_NO_STREAM_DEVICE": "1"}, {"JAX_HOCCL_NO_STREAM_DEVICE": "1", "JAX_HOCCL_BATCH_MEMOPS": "0"}]
chosen = None
for i, v in enumerate(variants):
    if left() < 150:
        break
    env = dict(ENV, JAX_HOCCL_DEBUG="1", LD_PRELOAD="/tmp/segv.so", **v)
    rc, out, lines = run(f"minimal{i}", f"{PY} scripts/gpu_scratch_executor.py --minimal", 75, env=env)
    print("  variant", v, flush=True)
    show([l for l in lines if "[jax_hoccl]" not in l], 25)
    trace = [l for l in lines if "[jax_hoccl]" in l]
    show(trace[:12] + (["  ..."] if len(trace) > 24 else []) + trace[-12:] if len(trace) > 24 else trace, 30)
    if "signal" in out:
        resolve_backtrace(out, so)
    if rc == 0:
        chosen = v
        break

# 4. the full check + benchmark
if chosen is not None and left() > 60:
    env = dict(ENV, **chosen)
    rc, out, lines = run("full", f"{PY} scripts/gpu_scratch_executor.py", left() - 10, env=env,
                         keep=lambda l: "OK  " not in l and not l.startswith(" "))
    show(lines, 120)
print(f"total {time.time() - T0:.0f}s", flush=True)
