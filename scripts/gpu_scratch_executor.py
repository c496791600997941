# Scratch check of the CUDA executor through raw jax.ffi calls (independent of jax_hoccl's
# Python API, which is being written): correctness vs numpy, then device time per op vs
# jax.lax and a raw peer copy. Runs on CPU too (registers the cpu capsules) for a dry run.
#   python scripts/gpu_scratch_executor.py [--quick]
import ctypes
import glob
import importlib.util
import os
import site
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

QUICK = "--quick" in sys.argv
t_start = time.time()


def log(*a):
    print(f"[{time.time() - t_start:7.1f}s]", *a, flush=True)


def load_ext():
    # Load _hoccl.so by path so an in-progress jax_hoccl/__init__.py cannot get in the way.
    paths = [os.environ["HOCCL_EXT"]] if os.environ.get("HOCCL_EXT") else []
    for d in site.getsitepackages() + [site.getusersitepackages()]:
        paths += glob.glob(os.path.join(d, "jax_hoccl", "_hoccl*.so"))
    assert paths, "jax_hoccl._hoccl not installed"
    spec = importlib.util.spec_from_file_location("_hoccl", paths[0])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m, paths[0]


ext, ext_path = load_ext()
if "--check-ext" in sys.argv:
    print(ext.with_cuda)
    sys.exit(0)
log("extension", ext_path, "with_cuda", ext.with_cuda)
for name, per in ext.registrations().items():
    for plat, cap in per.items():
        jax.ffi.register_ffi_target(name, cap, platform=plat)

devs = jax.devices()
PLATFORM = devs[0].platform
n = len(devs)
mesh = Mesh(np.array(devs), ("x",))
IDS = np.array([d.id for d in devs], np.int64)
log("platform", PLATFORM, "devices", devs)
SH = NamedSharding(mesh, P("x"))


def ag(x, groups=IDS, gs=n):
    return jax.ffi.ffi_call("hoccl_all_gather", jax.ShapeDtypeStruct((gs,) + x.shape, x.dtype),
                            has_side_effect=True)(x, groups=groups, group_size=np.int64(gs))


def a2a(x, groups=IDS, gs=n):
    return jax.ffi.ffi_call("hoccl_all_to_all", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            has_side_effect=True)(x, groups=groups, group_size=np.int64(gs))


def pp(x, dst, groups=IDS, gs=n):
    return jax.ffi.ffi_call("hoccl_ppermute", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            has_side_effect=True)(
        x, groups=groups, group_size=np.int64(gs), permute_dst=np.array(dst, np.int64))


_SMAP_CACHE = {}


def smap_cached(key, f):
    if key not in _SMAP_CACHE:
        _SMAP_CACHE[key] = smap(f)
    return _SMAP_CACHE[key]


def smap(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


rng = np.random.default_rng(0)


def rand(shape, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-100, 100, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


failures = []


def check(name, got, want):
    got = np.asarray(got)
    ok = got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    if not ok:
        failures.append(name)
    log(("OK  " if ok else "FAIL"), name, got.shape, got.dtype)


def correctness(tag, m, dtype):
    # all_gather: per-device (m,) -> (n, m)
    x = rand((n * m,), dtype)
    got = smap_cached("ag", ag)(jax.device_put(x, SH))
    want = np.tile(x.reshape(1, n, m), (n, 1, 1)).reshape(n * n, m)
    check(f"all_gather {tag} m={m} {np.dtype(dtype).name}", got, want)
    # all_to_all: per-device (n, c)
    c = max(1, m // n)
    x = rand((n * n, c), dtype)
    got = smap_cached("a2a", a2a)(jax.device_put(x, SH))
    want = x.reshape(n, n, c).transpose(1, 0, 2).reshape(n * n, c)
    check(f"all_to_all {tag} c={c} {np.dtype(dtype).name}", got, want)
    # ppermute: a shift, and one where rank 0 receives nothing (zeros)
    for dst in ([(i + 1) % n for i in range(n)], [1] + [-1] * (n - 1)):
        x = rand((n * m,), dtype)
        got = smap_cached(("pp", tuple(dst)), lambda v, dst=dst: pp(v, dst))(jax.device_put(x, SH))
        xs = x.reshape(n, m)
        want = np.zeros_like(xs)
        for s, d in enumerate(dst):
            if d >= 0:
                want[d] = xs[s]
        check(f"ppermute {tag} dst={dst} m={m} {np.dtype(dtype).name}", got, want.reshape(-1))


def set_env(**kw):
    for k in ("JAX_HOCCL_CHUNKS", "JAX_HOCCL_CHANNELS", "JAX_HOCCL_MULTISTREAM_MIN_BYTES"):
        os.environ.pop(k, None)
    for k, v in kw.items():
        os.environ[k] = str(v)


if "--minimal" in sys.argv:
    # the smallest thing that crosses the FFI boundary: one op of each kind, small
    log("=== minimal")
    x = rand((n * 1000,), np.float32)
    got = smap(ag)(jax.device_put(x, SH))
    check("minimal all_gather", got, np.tile(x.reshape(1, n, 1000), (n, 1, 1)).reshape(n * n, 1000))
    got = smap(lambda v: pp(v, [(i + 1) % n for i in range(n)]))(jax.device_put(x, SH))
    check("minimal ppermute", got, np.roll(x.reshape(n, 1000), 1, axis=0).reshape(-1))
    x = rand((n * n, 4096), np.float32)
    got = smap(a2a)(jax.device_put(x, SH))
    check("minimal all_to_all", got, x.reshape(n, n, 4096).transpose(1, 0, 2).reshape(n * n, 4096))
    x = rand((n * (4 << 20),), np.float32)
    got = smap(ag)(jax.device_put(x, SH))
    check("minimal all_gather 16 MiB", got, np.tile(x.reshape(1, n, -1), (n, 1, 1)).reshape(n * n, -1))
    log("minimal failures:", failures or "none")
    sys.exit(1 if failures else 0)

# ------------------------------------------------------------------ correctness
log("=== correctness")
big = 3 * 2**20 + 13 if PLATFORM != "cpu" else 70001
for m, dtype in [(1000, np.float32), (12345, np.int8), (4097, jnp.bfloat16),
                 (2**18, np.float32), (big, np.int8), (16 * 2**20 // 4, np.float32)]:
    correctness("default", m, dtype)
for env in ({"JAX_HOCCL_CHUNKS": 3, "JAX_HOCCL_CHANNELS": 3},
            {"JAX_HOCCL_CHUNKS": 2, "JAX_HOCCL_CHANNELS": 2},
            {"JAX_HOCCL_CHUNKS": 5, "JAX_HOCCL_CHANNELS": 7, "JAX_HOCCL_MULTISTREAM_MIN_BYTES": 1},
            {"JAX_HOCCL_MULTISTREAM_MIN_BYTES": 1}):
    set_env(**env)
    correctness(str(env), big, np.int8)
    correctness(str(env), 777, np.float32)
set_env()

# groups in another order (rank != device id) and groups of one
if n >= 2:
    rev = IDS[::-1].copy()
    x = rand((n * 5000,), np.float32)
    got = smap(lambda v: ag(v, groups=rev))(jax.device_put(x, SH))
    want = np.tile(x.reshape(n, 5000)[::-1][None], (n, 1, 1)).reshape(n * n, 5000)
    check("all_gather reversed group order", got, want)
    got = smap(lambda v: ag(v, gs=1))(jax.device_put(x, SH))
    check("all_gather groups of one", got, x.reshape(n, 5000))

# a chain inside one jit + many launches in flight, then check and look for leaks
x = rand((n * 65536,), np.float32)
xs = jax.device_put(x, SH)


def chain(v):
    for _ in range(8):
        v = ag(v)[(1) % n] * 1.0
        v = a2a(v.reshape(n, -1)).reshape(-1)
        v = pp(v, [(i + 1) % n for i in range(n)])
    return v


f = smap(chain)
outs = [f(xs) for _ in range(50 if QUICK else 200)]
got = np.asarray(outs[-1])
want = x.reshape(n, 65536)
for _ in range(8):
    want = np.tile(want[1 % n][None], (n, 1))
    blocks = want.reshape(n, n, -1)
    want = blocks.transpose(1, 0, 2).reshape(n, -1)
    want = np.roll(want, 1, axis=0)
check("chain x8 (ag,a2a,pp), 200 launches in flight", got, want.reshape(-1))
log("live rendezvous slots after", ext.live_slot_count())
if ext.live_slot_count() != 0:
    failures.append("live slots")

def bad_group_test():
    # an invalid group table must come back as an error, not a hang (run last: the failed
    # side-effecting launch leaves an error token behind)
    try:
        smap(lambda v: ag(v, groups=np.array([100 + i for i in range(n)], np.int64)))(xs).block_until_ready()
        failures.append("bad group table accepted")
        log("FAIL bad group table accepted")
    except Exception as e:  # noqa: BLE001
        log("OK   bad group table ->", type(e).__name__, str(e).splitlines()[0][:200])


log("correctness failures:", failures or "none")

# ------------------------------------------------------------------ timing
if "--no-timing" in sys.argv:
    bad_group_test()
    sys.exit(1 if failures else 0)
log("=== timing (device time per op = (t(K2)-t(K1))/(K2-K1), median of reps)")
K1, K2 = 4, 20
perm = [(i, (i + 1) % n) for i in range(n)]
dst = [(i + 1) % n for i in range(n)]


def median_time(fn, arg, reps=5):
    fn(arg).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(arg).block_until_ready()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


IMPLS = {
    "all_gather": {
        "hoccl": lambda v: ag(v)[1 % n],
        "lax": lambda v: jax.lax.all_gather(v, "x")[1 % n],
    },
    "ppermute": {
        "hoccl": lambda v: pp(v, dst),
        "lax": lambda v: jax.lax.ppermute(v, "x", perm),
    },
    "all_to_all": {
        "hoccl": lambda v: a2a(v.reshape(n, -1)).reshape(-1),
        "lax": lambda v: jax.lax.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True).reshape(-1),
    },
}


def chained(op, k):
    def body(v):
        for _ in range(k):
            v = op(v)
        return v
    return smap(body)


def per_op(op, x):
    f1, f2 = chained(op, K1), chained(op, K2)
    return (median_time(f2, x) - median_time(f1, x)) / (K2 - K1)


def busbw(opname, nbytes, t):
    # nccl-tests: all_gather/all_to_all S = full buffer, *(n-1)/n; ppermute S/t.
    if opname == "ppermute":
        return nbytes / t / 1e9
    return n * nbytes / t * (n - 1) / n / 1e9


results = {}
sizes = [2**16, 2**20, 2**26, 2**30] if PLATFORM != "cpu" else [2**16, 2**20]
if QUICK:
    sizes = sizes[:2]
for nbytes in sizes:
    x = jax.jit(lambda: jnp.ones((n * nbytes // 4,), jnp.float32), out_shardings=SH)()
    for opname in ("all_gather", "ppermute", "all_to_all"):
        row = {}
        for impl, op in IMPLS[opname].items():
            row[impl] = per_op(op, x)
        results[(opname, nbytes)] = row
        log(f"{opname:10s} {nbytes / 2**20:8.3f} MiB/dev  hoccl {row['hoccl'] * 1e6:9.1f} us "
            f"({busbw(opname, nbytes, row['hoccl']):6.1f} GB/s)  lax {row['lax'] * 1e6:9.1f} us "
            f"({busbw(opname, nbytes, row['lax']):6.1f} GB/s)  lax/hoccl {row['lax'] / row['hoccl']:.2f}x")
    del x

# ------------------------------------------------------------------ raw peer copies
def find_cudart():
    pats = []
    for d in site.getsitepackages():
        pats += glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so*"))
        pats += glob.glob(os.path.join(d, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
    pats += glob.glob("/usr/local/cuda/lib64/libcudart.so*")
    return pats[0] if pats else None


def raw_copies():
    path = find_cudart()
    if PLATFORM == "cpu" or not path or n < 2:
        log("raw copy: skipped", path)
        return
    rt = ctypes.CDLL(path)
    vp = ctypes.c_void_p

    def ck(e, what):
        if e != 0:
            raise RuntimeError(f"{what} -> cudaError {e}")

    log("raw copy via", path)
    K = 20
    for nbytes in sizes:
        bufs, streams, evs = {}, {}, {}
        for d in (0, 1):
            ck(rt.cudaSetDevice(d), "setdev")
            e = rt.cudaDeviceEnablePeerAccess(1 - d, 0)
            if e not in (0, 704):
                ck(e, "peer")
            rt.cudaGetLastError()
            a, b = vp(), vp()
            ck(rt.cudaMalloc(ctypes.byref(a), ctypes.c_size_t(nbytes)), "malloc")
            ck(rt.cudaMalloc(ctypes.byref(b), ctypes.c_size_t(nbytes)), "malloc")
            s = vp()
            ck(rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "stream")
            e0, e1 = vp(), vp()
            ck(rt.cudaEventCreate(ctypes.byref(e0)), "ev")
            ck(rt.cudaEventCreate(ctypes.byref(e1)), "ev")
            bufs[d], streams[d], evs[d] = (a, b), s, (e0, e1)

        def run(dirs):
            for d in dirs:
                ck(rt.cudaSetDevice(d), "setdev")
                ck(rt.cudaEventRecord(evs[d][0], streams[d]), "rec")
                for _ in range(K):
                    # pull: device d reads the peer's buffer into its own
                    ck(rt.cudaMemcpyPeerAsync(bufs[d][1], d, bufs[1 - d][0], 1 - d,
                                              ctypes.c_size_t(nbytes), streams[d]), "copy")
                ck(rt.cudaEventRecord(evs[d][1], streams[d]), "rec")
            out = []
            for d in dirs:
                ck(rt.cudaSetDevice(d), "setdev")
                ck(rt.cudaEventSynchronize(evs[d][1]), "sync")
                ms = ctypes.c_float()
                ck(rt.cudaEventElapsedTime(ctypes.byref(ms), evs[d][0], evs[d][1]), "elapsed")
                out.append(ms.value * 1e-3 / K)
            return max(out)

        run((0,))
        one = min(run((0,)) for _ in range(3))
        both = min(run((0, 1)) for _ in range(3))
        log(f"raw peer copy {nbytes / 2**20:8.3f} MiB  one way {one * 1e6:9.1f} us "
            f"({nbytes / one / 1e9:6.1f} GB/s)  both ways {both * 1e6:9.1f} us ({nbytes / both / 1e9:6.1f} GB/s each)")
        for d in (0, 1):
            rt.cudaSetDevice(d)
            rt.cudaFree(bufs[d][0]); rt.cudaFree(bufs[d][1])
            rt.cudaStreamDestroy(streams[d])


try:
    raw_copies()
except Exception as e:  # noqa: BLE001
    log("raw copy failed:", e)

# chunk/channel sweep for all_gather at a few sizes (env is read per call: no recompile)
log("=== all_gather config sweep")
sweep_sizes = [2**20, 2**26, 2**30] if PLATFORM != "cpu" else [2**20]
configs = [
    ("single stream", {"JAX_HOCCL_MULTISTREAM_MIN_BYTES": 2**40}),
    ("default", {}),
    ("chunks2 ch2", {"JAX_HOCCL_CHUNKS": 2, "JAX_HOCCL_CHANNELS": 2}),
    ("chunks3 ch3", {"JAX_HOCCL_CHUNKS": 3, "JAX_HOCCL_CHANNELS": 3}),
    ("chunks4 ch4", {"JAX_HOCCL_CHUNKS": 4, "JAX_HOCCL_CHANNELS": 4}),
]
for nbytes in sweep_sizes:
    x = jax.jit(lambda: jnp.ones((n * nbytes // 4,), jnp.float32), out_shardings=SH)()
    f1, f2 = chained(IMPLS["all_gather"]["hoccl"], K1), chained(IMPLS["all_gather"]["hoccl"], K2)
    for cname, env in configs:
        set_env(**env)
        t = (median_time(f2, x) - median_time(f1, x)) / (K2 - K1)
        log(f"all_gather {nbytes / 2**20:8.3f} MiB/dev  {cname:14s} {t * 1e6:9.1f} us "
            f"({busbw('all_gather', nbytes, t):6.1f} GB/s)")
    set_env()
    del x

# host rendezvous: spin vs. block on the condition variable straight away (small messages)
log("=== spin sweep (JAX_HOCCL_SPIN_US)")
for nbytes in (2**16, 2**20):
    x = jax.jit(lambda: jnp.ones((n * nbytes // 4,), jnp.float32), out_shardings=SH)()
    for opname in ("all_gather", "ppermute"):
        f1, f2 = chained(IMPLS[opname]["hoccl"], K1), chained(IMPLS[opname]["hoccl"], K2)
        for spin in ("0", "50", "200", "1000"):
            os.environ["JAX_HOCCL_SPIN_US"] = spin
            t = (median_time(f2, x) - median_time(f1, x)) / (K2 - K1)
            log(f"{opname:10s} {nbytes / 2**20:8.3f} MiB/dev  spin {spin:>5s} us  {t * 1e6:9.1f} us")
    os.environ.pop("JAX_HOCCL_SPIN_US", None)
    # host-side cost: one launch of K2 ops, wall time per op, without waiting for the device
    del x

bad_group_test()
log("done; correctness failures:", failures or "none")
sys.exit(1 if failures else 0)
