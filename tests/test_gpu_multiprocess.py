"""One process per GPU on the CUDA engine, run as two JAX processes sharing one GPU (a 2-device
mesh; jax.lax's NCCL refuses two ranks on one GPU, so results are checked against numpy):
every op and dtype on random data of sizes no chunk divides, async pairs and fused ops, 1,000
back-to-back calls without leaks, a peer that never calls, a peer that exits, and calls that
do not match. Skipped without a GPU; this file must run in a pytest process that has not
started JAX on the GPU itself (scripts/gpu_check.sh runs it first)."""
import contextlib
import glob
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import run_processes, shared_memory_left
from jax_hoccl.launch import mps_daemon

HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*")) and any(
    importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
pytestmark = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")

PRELUDE = textwrap.dedent("""
    import os, sys, time
    import jax
    me, n = int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(sys.argv[1], num_processes=n, process_id=me, local_device_ids=[0])
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    from jax_hoccl import _hoccl
    assert jax.devices()[0].platform == "gpu", jax.devices()
    mesh = jax.make_mesh((n,), ("tp",))
    spec = P("tp")

    def shard(local):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)

    def fn(body, out_specs=spec):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_specs))

    def mine(y):
        return np.asarray(y.addressable_shards[0].data).astype(np.float64)
""")

OPS_WORKER = PRELUDE + textwrap.dedent("""
    def data(rank, rows, cols, dtype):
        v = np.random.default_rng(100 + rank).standard_normal((rows, cols)) * 4
        return v.astype(dtype)

    shift = [(i, (i + 1) % n) for i in range(n)]
    cases = {  # name: (ours, numpy reference from every rank's data `xs`)
        "psum": (lambda v: jax_hoccl.psum(v, "tp"), lambda xs: sum(xs)),
        "pmean": (lambda v: jax_hoccl.pmean(v, "tp"), lambda xs: sum(xs) / n),
        "pmax": (lambda v: jax_hoccl.pmax(v, "tp"), lambda xs: np.max(xs, 0)),
        "pmin": (lambda v: jax_hoccl.pmin(v, "tp"), lambda xs: np.min(xs, 0)),
        "all_gather": (lambda v: jax_hoccl.all_gather(v, "tp", tiled=True), lambda xs: np.concatenate(xs)),
        "all_gather axis=1": (lambda v: jax_hoccl.all_gather(v, "tp", axis=1), lambda xs: np.stack(xs, 1)),
        "psum_scatter": (lambda v: jax_hoccl.psum_scatter(v, "tp", tiled=True),
                         lambda xs: np.split(sum(xs), n)[me]),
        "all_to_all": (lambda v: jax_hoccl.all_to_all(v, "tp", 0, 0, tiled=True),
                       lambda xs: np.concatenate([np.split(x, n)[me] for x in xs])),
        "ppermute": (lambda v: jax_hoccl.ppermute(v, "tp", shift), lambda xs: xs[(me - 1) % n]),
        "ppermute partial": (lambda v: jax_hoccl.ppermute(v, "tp", [(0, n - 1)]),
                             lambda xs: xs[0] if me == n - 1 else 0 * xs[0]),
    }
    checked = 0
    for dtype in (np.float32, jnp.bfloat16, np.float16, np.int32, np.int8):
        for rows, cols in ((3 * n, 13), (2 * n, (1 << 18) + 3)):  # 156 B and ~2 MiB per rank
            xs = [data(r, rows, cols, dtype).astype(np.float64) for r in range(n)]
            x = shard(data(me, rows, cols, dtype))
            for name, (ours, ref) in cases.items():
                if name == "pmean" and np.dtype(dtype).kind == "i":
                    continue
                want = ref(xs)
                got = mine(fn(ours)(x))
                tol = 0.1 if dtype in (jnp.bfloat16, np.float16) else 1e-4
                if np.dtype(dtype).kind == "i":  # integer sums wrap like jax.lax's
                    want = want.astype(np.dtype(dtype)).astype(np.float64)
                scale = max(1.0, float(np.abs(want).max()))
                err = float(np.abs(got - want).max()) / scale
                assert got.shape == want.shape and err <= tol, (name, np.dtype(dtype).name, rows, cols, err)
                checked += 1
        print("OK ops", np.dtype(dtype).name, flush=True)

    # The lowered program holds jax_hoccl's calls and no XLA collective.
    text = fn(lambda v: jax_hoccl.psum(v, "tp")).lower(shard(data(me, 2, 8, np.float32))).as_text()
    assert "hoccl_" in text and "stablehlo.all_reduce" not in text and "stablehlo.all_gather" not in text

    # Async pairs with compute between start and done.
    x = shard(data(me, 2 * n, 1000, np.float32))
    xs = [data(r, 2 * n, 1000, np.float32).astype(np.float64) for r in range(n)]
    def pair(start, **kw):
        def body(v):
            pending = start(v, "tp", **kw)
            h = pending.after_start(v @ v.T)
            out, h = jax_hoccl.done(pending, h)
            return out + 0 * h.sum()
        return body
    for name, body, want in (("psum_start", pair(jax_hoccl.psum_start), sum(xs)),
                             ("all_gather_start", pair(jax_hoccl.all_gather_start, tiled=True), np.concatenate(xs)),
                             ("ppermute_start", pair(jax_hoccl.ppermute_start, perm=shift), xs[(me - 1) % n])):
        got = mine(fn(body)(x))
        assert np.abs(got - want).max() < 1e-3, name
    print("OK async", flush=True)

    # Fused ops (f32, small): x [4*n, k] rows; w replicated.
    k = 64
    w = np.random.default_rng(7).standard_normal((k, 32)).astype(np.float32)
    xs = [data(r, 4 * n, k, np.float32).astype(np.float64) for r in range(n)]
    x = shard(data(me, 4 * n, k, np.float32))
    fused = {
        "all_gather_matmul": (lambda v: jax_hoccl.all_gather_matmul(v, w, "tp"), np.concatenate(xs) @ w),
        "matmul_reduce_scatter": (lambda v: jax_hoccl.matmul_reduce_scatter(v, w, "tp"),
                                  np.split(sum(xs) @ w, n)[me]),
        "matmul_psum": (lambda v: jax_hoccl.matmul_psum(v, w, "tp"), sum(xs) @ w),
        "matmul_all_to_all": (lambda v: jax_hoccl.matmul_all_to_all(v.reshape(n, 4, k), w, "tp"),
                              np.stack([np.split(xx, n)[me] @ w for xx in xs])),
    }
    for name, (ours, want) in fused.items():
        got = mine(fn(ours)(x))
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-2 * max(1, np.abs(want).max()), name
    print("OK fused", flush=True)

    # 1,000 back-to-back calls: no fd, mapping or shared memory left over; device time per op.
    f = fn(lambda v: jax_hoccl.psum(v, "tp"))
    y = shard(np.ones((n, 4096), np.float32))  # 16 KiB per rank
    f(y).block_until_ready()
    fds, maps = len(os.listdir("/proc/self/fd")), _hoccl.live_peer_mappings()
    t0 = time.perf_counter()
    for i in range(1000):
        y = f(y) / n
    y.block_until_ready()
    per_call = (time.perf_counter() - t0) / 1000 * 1e6
    assert np.allclose(mine(y), 1.0)
    assert len(os.listdir("/proc/self/fd")) <= fds + 2 and _hoccl.live_peer_mappings() == maps
    assert not _hoccl.linked_shared_memory(), _hoccl.linked_shared_memory()
    K = 100
    def chain(v):
        for _ in range(K):
            v = jax_hoccl.psum(v, "tp") * 0.5
        return v
    for size in (64 << 10, 1 << 20, 16 << 20):
        z = shard(np.ones((n, size // 4), np.float32))
        g = fn(chain)
        g(z).block_until_ready()
        t0 = time.perf_counter()
        g(z).block_until_ready()
        print(f"TIME psum {size} bytes: {(time.perf_counter() - t0) / K * 1e6:.1f} us per op "
              f"(2 processes, 1 GPU, {K} ops in one jit)", flush=True)
    print(f"OK leaks: {per_call:.1f} us per jit call, {checked} op checks, peer mappings {maps}", flush=True)
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")

FAILURE_WORKER = PRELUDE + textwrap.dedent("""
    x = shard(np.ones(4, np.float32))
    psum = fn(lambda v: jax_hoccl.psum(v, "tp"))
    psum(x).block_until_ready()  # the group is set up
    mode = os.environ["MODE"]
    if mode == "absent_fused":  # matmul_reduce_scatter on the flagged GEMM (Hopper, bf16)
        w = jnp.zeros((512, 768), jnp.bfloat16)
        xf = shard(np.ones((2 * 512, 512), jnp.bfloat16))
        fused = fn(lambda v: jax_hoccl.matmul_reduce_scatter(v, w, "tp"))
        fused.lower(xf).compile()
    if mode == "absent_captured":  # a step XLA records into a CUDA graph, replayed from then on
        wc = jnp.eye(4, dtype=jnp.float32)
        def layers(v):
            for _ in range(6):
                v = jax_hoccl.psum(jnp.tanh(v @ wc), "tp") / n
            return v
        captured = jax.jit(jax.shard_map(layers, mesh=mesh, in_specs=spec, out_specs=spec,
                                         check_vma=False))
        xc = shard(np.ones((4, 4), np.float32))
        for _ in range(3):
            captured(xc).block_until_ready()
        assert _hoccl.staged_captured_calls() > 0
    if mode == "absent_gemv":  # decode's GEMV inside the psum (JAX_HOCCL_GEMV_PSUM=1), captured
        wg = jax.make_array_from_process_local_data(NamedSharding(mesh, P("tp")),
                                                    np.ones((256, 512), jnp.bfloat16))
        def decode(v, w):
            for _ in range(6):
                v = jax_hoccl.matmul_psum(v, w, "tp")[:, :w.shape[0]] / 512  # my K
            return v
        gemv = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=(P(None, "tp"), P("tp")),
                                     out_specs=P(None, "tp"), check_vma=False))
        xg = jax.make_array_from_process_local_data(NamedSharding(mesh, P(None, "tp")),
                                                    np.ones((1, 256), jnp.bfloat16))
        assert "hoccl_matmul_psum_staged" in gemv.lower(xg, wg).as_text()
        for _ in range(3):
            gemv(xg, wg).block_until_ready()
        assert _hoccl.staged_captured_calls() > 0
    t0 = time.time()
    try:
        if me == 1 and mode == "exit":
            os._exit(0)
        if me == 1 and mode == "kill":
            os.kill(os.getpid(), 9)
        if me == 1 and mode in ("absent", "absent_fused", "absent_captured", "absent_gemv"):
            time.sleep(20)
            os._exit(0)
        # On the staged path the call that lost its peer is released by the watchdog and the
        # group is broken: the error comes at the next call (a zero-copy call raises itself).
        for _ in range(2):
            if me == 1 and mode == "mismatch":  # the same input, another op at the same point
                fn(lambda v: jax_hoccl.all_to_all(v, "tp", 0, 0, tiled=True))(x).block_until_ready()
            elif mode == "mismatch_type":  # psums of as many bytes, bfloat16 on one rank
                psum(shard(np.ones(4, jnp.bfloat16 if me == 1 else np.float16))).block_until_ready()
            elif mode == "absent_fused":
                fused(xf).block_until_ready()
            elif mode == "absent_captured":  # the replay's wait is released, the next call raises
                captured(xc).block_until_ready()
                psum(x).block_until_ready()
            elif mode == "absent_gemv":
                gemv(xg, wg).block_until_ready()
                psum(x).block_until_ready()
            else:
                psum(x).block_until_ready()
    except Exception as e:
        print("ERROR after %.1f s:" % (time.time() - t0), str(e).replace(chr(10), " "), flush=True)
    else:
        print("NO ERROR", flush=True)
    time.sleep(3)
    os._exit(0)
""")


# The fused ops at shapes the flagged GEMM takes on Hopper (bf16/f16, rows in chunks of 512),
# forward and gradients against numpy. These ranks share one GPU, so the copies between them
# are kernels that need SMs: the fused ops take their row pieces, never a walk that waits
# in-kernel (the lowered programs hold neither the announced gather nor the ring's start).
FLAGGED_WORKER = PRELUDE + textwrap.dedent("""
    from jax_hoccl._src.fused.flagged import flagged_gemm
    if getattr(jax.devices()[0], "compute_capability", "") != "9.0":
        print("SKIP not Hopper", flush=True); os._exit(0)
    assert "share a GPU" in flagged_gemm.peer_wait_reason()
    m, k, nout = 1024, 512, 768
    for dtype in (jnp.bfloat16, np.float16):
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((m, k)).astype(np.float32) for _ in range(n)]
        wf = (rng.standard_normal((k, nout)) / np.sqrt(k)).astype(np.float32)
        cts = [rng.standard_normal((n * m, nout)).astype(np.float32) for _ in range(n)]
        w = jnp.asarray(wf, dtype)
        x = shard(xs[me].astype(dtype))
        ct = shard(cts[me].astype(dtype))
        body = lambda v: jax_hoccl.all_gather_matmul(v, w, "tp")
        text = fn(body).lower(x).as_text()
        assert "hoccl_announced_gather_start" not in text and "mosaic_gpu" not in text, text[:2000]
        want = np.concatenate(xs) @ wf
        got = mine(fn(body)(x))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert got.shape == want.shape and err < 2e-2, ("forward", err)
        def grads(v, c, w):
            _, vjp = jax.vjp(lambda v, w: jax_hoccl.all_gather_matmul(v, w, "tp"), v, w)
            return vjp(c)  # w is invariant: its cotangent is summed over "tp" already
        g = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, P())))
        dx, dw = g(x, ct, w)
        want_dx = np.split(sum(cts) @ wf.T, n)[me]
        want_dw = sum(np.concatenate(xs).T @ c for c in cts)
        for name, gv, wv in (("dx", mine(dx), want_dx), ("dw", mine(dw), want_dw)):
            e = np.abs(gv - wv).max() / np.abs(wv).max()
            assert e < 3e-2, (name, e)
        print("OK all_gather_matmul", np.dtype(dtype).name, f"err {err:.2g}", flush=True)

        # matmul_reduce_scatter: x [n*m, k] per rank (k sharded), the ring walked by one GEMM
        xr = [rng.standard_normal((n * m, k)).astype(np.float32) for _ in range(n)]
        ctr = [rng.standard_normal((m, nout)).astype(np.float32) for _ in range(n)]
        x = shard(xr[me].astype(dtype))
        ct = shard(ctr[me].astype(dtype))
        body = lambda v: jax_hoccl.matmul_reduce_scatter(v, w, "tp")
        text = fn(body).lower(x).as_text()
        assert "hoccl_gemm_ring_start" not in text and "mosaic_gpu" not in text, text[:2000]
        want = np.split(sum(xx @ wf for xx in xr), n)[me]
        got = mine(fn(body)(x))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert got.shape == want.shape and err < 2e-2, ("matmul_reduce_scatter", err)
        def grads_rs(v, c, w):
            _, vjp = jax.vjp(lambda v, w: jax_hoccl.matmul_reduce_scatter(v, w, "tp"), v, w)
            return vjp(c)
        g = jax.jit(jax.shard_map(grads_rs, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, P())))
        dx, dw = g(x, ct, w)
        ct_all = np.concatenate(ctr)
        for name, gv, wv in (("rs dx", mine(dx), ct_all @ wf.T),
                             ("rs dw", mine(dw), sum(xx.T @ ct_all for xx in xr))):
            e = np.abs(gv - wv).max() / np.abs(wv).max()
            assert e < 3e-2, (name, e)
        print("OK matmul_reduce_scatter", np.dtype(dtype).name, f"err {err:.2g}", flush=True)

        # matmul_psum: the same ring, then every summed band gathered as it is stored
        body = lambda v: jax_hoccl.matmul_psum(v, w, "tp")
        text = fn(body, out_specs=P()).lower(x).as_text()
        assert "hoccl_gemm_ring_start" not in text and "mosaic_gpu" not in text, text[:2000]
        want = sum(xx @ wf for xx in xr)
        got = mine(fn(body, out_specs=P())(x))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert got.shape == want.shape and err < 2e-2, ("matmul_psum", err)
        ctp = rng.standard_normal((n * m, nout)).astype(np.float32)
        def grads_ps(v, w):
            _, vjp = jax.vjp(lambda v, w: jax_hoccl.matmul_psum(v, w, "tp"), v, w)
            return vjp(jnp.asarray(ctp, dtype))
        g = jax.jit(jax.shard_map(grads_ps, mesh=mesh, in_specs=(spec, P()), out_specs=(spec, P())))
        dx, dw = g(x, w)
        for name, gv, wv in (("psum dx", mine(dx), ctp @ wf.T),
                             ("psum dw", mine(dw), sum(xx.T @ ctp for xx in xr))):
            e = np.abs(gv - wv).max() / np.abs(wv).max()
            assert e < 3e-2, (name, e)
        print("OK matmul_psum", np.dtype(dtype).name, f"err {err:.2g}", flush=True)
    x = shard(np.ones((100, k), np.float32).astype(jnp.bfloat16))
    text = fn(lambda v: jax_hoccl.all_gather_matmul(v, w, "tp")).lower(x).as_text()
    assert "hoccl_announced_gather_start" not in text

    # jax.lax code, unedited, on jax_hoccl through route_collectives (jax.lax's own NCCL
    # refuses two ranks on one GPU)
    xs = [np.random.default_rng(20 + r).standard_normal((8, 16)).astype(np.float32) for r in range(n)]
    x = shard(xs[me])
    jax_hoccl.route_collectives()
    lax_body = lambda v: (jax.lax.psum(v, "tp") + jax.lax.pmax(v, "tp")
                          + jax.lax.all_gather(v, "tp", tiled=True)[:8] * 0
                          + jax.lax.ppermute(v, "tp", [(i, (i + 1) % n) for i in range(n)]))
    got = mine(fn(lax_body)(x))
    want = sum(xs) + np.max(xs, 0) + xs[(me - 1) % n]
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    # (f32 GEMMs at full precision: XLA:GPU's default TF32 alone missed 1e-3 here)
    loss = lambda w, v: jnp.sum(jnp.tanh(jnp.dot(v, w, precision="highest")))
    grads = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), spec),
                                  out_specs=P()))
    w16 = np.random.default_rng(9).standard_normal((16, 4)).astype(np.float32)
    text = grads.lower(w16, x).as_text()
    assert "hoccl_" in text and "all_reduce" not in text, text[:1500]
    want = sum((1 - np.tanh(xx @ w16) ** 2).T @ xx for xx in xs).T
    assert np.abs(mine(grads(w16, x)) - want).max() < 1e-3 * max(1.0, np.abs(want).max())
    print("OK routed jax.lax collectives", flush=True)
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")


# The three GEMM fused ops at realistic sizes (K = 8192, N = 2048, ROWS rows of x per rank),
# 10 calls back to back on the same inputs, each call's result against XLA's f32 dot of every
# rank's data (made on each rank from the same seeds); gradients at the first size.
SIZES_WORKER = PRELUDE + textwrap.dedent("""
    k, nout = 8192, 2048
    w = (jax.random.normal(jax.random.key(99), (k, nout), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    wf = w.astype(jnp.float32)
    ref_dot = jax.jit(lambda a, b: jnp.dot(a.astype(jnp.float32), b, precision="highest"))
    def rel_err(got, want):
        got = jnp.asarray(got.addressable_shards[0].data, jnp.float32)
        return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    for rows in [int(r) for r in os.environ["ROWS"].split(",")]:
        xs = [jax.random.normal(jax.random.key(r), (rows, k), jnp.bfloat16) for r in range(n)]
        x = shard(xs[me])
        products = [ref_dot(v, wf) for v in xs]
        cases = {
            "all_gather_matmul": (lambda v: jax_hoccl.all_gather_matmul(v, w, "tp"), spec,
                                  jnp.concatenate([ref_dot(v, wf) for v in xs])),
            "matmul_reduce_scatter": (lambda v: jax_hoccl.matmul_reduce_scatter(v, w, "tp"), spec,
                                      jnp.split(sum(products), n)[me]),
            "matmul_psum": (lambda v: jax_hoccl.matmul_psum(v, w, "tp"), P(), sum(products)),
        }
        for name, (body, out_spec, want) in cases.items():
            f = fn(body, out_specs=out_spec)
            t0 = time.monotonic()
            outs = [f(x) for _ in range(10)]
            jax.block_until_ready(outs)
            errs = [rel_err(o, want) for o in outs]
            assert max(errs) < 2e-2, (name, rows, errs)
            print(f"OK {name} rows {rows}: 10 calls in {time.monotonic() - t0:.2f} s, "
                  f"err {max(errs):.2g}", flush=True)
            del outs
        if rows == int(os.environ["ROWS"].split(",")[0]):
            ct = jax.random.normal(jax.random.key(50), (rows, nout), jnp.bfloat16)
            for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_psum"):
                op = getattr(jax_hoccl, name)
                cts = {"all_gather_matmul": [jax.random.normal(jax.random.key(60 + r), (n * rows, nout), jnp.bfloat16) for r in range(n)],
                       "matmul_reduce_scatter": [jax.random.normal(jax.random.key(70 + r), (rows // n, nout), jnp.bfloat16) for r in range(n)],
                       "matmul_psum": [jax.random.normal(jax.random.key(80), (rows, nout), jnp.bfloat16)] * n}[name]
                def grads(v, c, w, op=op):
                    _, vjp = jax.vjp(lambda v, w: op(v, w, "tp"), v, w)
                    return vjp(c)
                c_spec = P() if name == "matmul_psum" else spec
                g = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(spec, c_spec, P()), out_specs=(spec, P())))
                c_in = (jax.make_array_from_process_local_data(NamedSharding(mesh, P()), cts[0])
                        if name == "matmul_psum" else shard(cts[me]))
                dx, dw = g(x, c_in, w)
                cf = [c.astype(jnp.float32) for c in cts]
                xf = [v.astype(jnp.float32) for v in xs]
                if name == "all_gather_matmul":  # dx = my rows of sum(ct) @ w.T; dw = sum(X.T @ ct)
                    want_dx = jnp.split(sum(cf) @ wf.T, n)[me]
                    want_dw = sum(jnp.concatenate(xf).T @ c for c in cf)
                elif name == "matmul_reduce_scatter":  # every rank's ct gathered
                    want_dx = jnp.concatenate(cf) @ wf.T
                    want_dw = sum(v.T @ jnp.concatenate(cf) for v in xf)
                else:
                    want_dx = cf[0] @ wf.T
                    want_dw = sum(v.T @ cf[0] for v in xf)
                for what, got, want in (("dx", dx, want_dx), ("dw", dw, want_dw)):
                    e = rel_err(got, want)
                    assert e < 3e-2, (name, what, e)
                print(f"OK {name} gradients rows {rows}", flush=True)
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")


# The packed exchange at the sizes that stress it: blocks of 1 MiB (32 CTAs a call, each
# taking its lines in passes; 4 ranks' CTAs all resident at once), blocks that end inside an
# 8-byte word, summed in the kernel bit for bit; 20 calls each, so both slot sets are reused
# and every word read is zeroed before its next writer.
PACKED_WORKER = PRELUDE + textwrap.dedent("""
    assert os.environ["JAX_HOCCL_STAGED_PACKED_BYTES"] == "1048576"
    before = _hoccl.staged_packed_calls()
    for dtype, shape in ((jnp.bfloat16, (64, 8192)), (np.float32, (n, 7)), (jnp.bfloat16, (1, 3)),
                         (np.float16, (n, 40000))):
        xs = [(np.random.default_rng(7 + r).standard_normal(shape) * 4).astype(dtype)
              for r in range(n)]
        acc = xs[0].astype(np.float32)
        for v in xs[1:]:
            acc = acc + v.astype(np.float32)
        fold = acc.astype(dtype)  # sum_leading's order: bit for bit
        ops = [(lambda v: jax_hoccl.psum(v, "tp"), fold),
               (lambda v: jax_hoccl.all_gather(v, "tp", tiled=True), np.concatenate(xs))]
        if shape[0] % n == 0:
            ops += [(lambda v: jax_hoccl.psum_scatter(v, "tp", tiled=True), np.split(fold, n)[me]),
                    (lambda v: jax_hoccl.all_to_all(v, "tp", 0, 0, tiled=True),
                     np.concatenate([np.split(x, n)[me] for x in xs]))]
        x = shard(xs[me])
        for op, want in ops:
            f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=spec,
                                      check_vma=False))
            for call in range(20):
                got = np.asarray(f(x).addressable_shards[0].data)
                assert got.dtype == want.dtype and np.array_equal(got, want), (
                    shape, np.dtype(dtype).name, call)
        print(f"OK packed {np.dtype(dtype).name} {shape}", flush=True)
    assert _hoccl.staged_packed_calls() > before
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")


# The staged path (blocks up to JAX_HOCCL_STAGED_BYTES, here 4 KiB) beside the zero-copy path
# in one program and one lane, a collective in a loop (the slots' two parities reused), a sync
# call between an async pair's start and done (two lanes), and 10,000 calls with nothing left
# over; every result against numpy.
STAGED_WORKER = PRELUDE + textwrap.dedent("""
    assert os.environ["JAX_HOCCL_STAGED_BYTES"] == "4096"
    rng = np.random.default_rng(3)
    shift = [(i, (i + 1) % n) for i in range(n)]
    for dtype in (np.float32, jnp.bfloat16, np.float16, np.int32):
        small = [(rng.standard_normal((n, 64)) * 4).astype(dtype) for _ in range(n)]  # 256 B/row
        big = [(rng.standard_normal((n, 8192)) * 4).astype(dtype) for _ in range(n)]  # 32 KiB/row
        def body(a, b):
            return (jax_hoccl.psum(a, "tp"), jax_hoccl.psum(b, "tp"),
                    jax_hoccl.all_gather(a, "tp", tiled=True), jax_hoccl.all_gather(b, "tp", tiled=True),
                    jax_hoccl.all_to_all(a, "tp", 0, 0, tiled=True),
                    jax_hoccl.psum_scatter(b, "tp", tiled=True),
                    jax_hoccl.ppermute(a, "tp", shift), jax_hoccl.ppermute(b, "tp", [(0, n - 1)]),
                    jax_hoccl.pmax(a, "tp"), jax_hoccl.psum_scatter(a, "tp", tiled=True))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
        if dtype != np.int32:  # staged sums of floats run inside the exchange kernel
            summed = (os.environ.get("JAX_HOCCL_STAGED_KERNEL", "1") != "0"
                      and os.environ.get("JAX_HOCCL_STAGED_SUM", "1") != "0")
            text = f.lower(shard(small[me]), shard(big[me])).as_text()
            assert ("hoccl_psum_staged" in text and "hoccl_psum_scatter_staged" in text) == summed
        outs = f(shard(small[me]), shard(big[me]))
        s64 = [v.astype(np.float64) for v in small]
        b64 = [v.astype(np.float64) for v in big]
        wants = (sum(s64), sum(b64), np.concatenate(s64), np.concatenate(b64),
                 np.concatenate([np.split(v, n)[me] for v in s64]), np.split(sum(b64), n)[me],
                 s64[(me - 1) % n], b64[0] if me == n - 1 else 0 * b64[0], np.max(s64, 0),
                 np.split(sum(s64), n)[me])
        for i, (got, want) in enumerate(zip(outs, wants)):
            got = mine(got)
            if np.dtype(dtype).kind == "i":
                want = want.astype(np.dtype(dtype)).astype(np.float64)
            tol = 0.1 if np.dtype(dtype).itemsize == 2 else 1e-4
            err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
            assert got.shape == want.shape and err <= tol, (i, np.dtype(dtype).name, err)
        # Both sums of the staged blocks bit for bit: a left fold in rank order in float32,
        # rounded once (ops/common.py, sum_leading), whichever engine adds.
        acc = small[0].astype(np.float32)
        for v in small[1:]:
            acc = acc + v.astype(np.float32)
        fold = acc.astype(dtype)
        for i, want in ((0, fold), (9, np.split(fold, n)[me])):
            got = np.asarray(outs[i].addressable_shards[0].data)
            assert got.dtype == want.dtype and np.array_equal(got, want), (i, np.dtype(dtype).name)
    print("OK staged beside zero copy", flush=True)

    # a loop of ppermutes: the lane's calls alternate parities across iterations
    x = np.full((n, 32), me + 1.0, np.float32)
    loop = fn(lambda v: jax.lax.fori_loop(0, 37, lambda i, a: jax_hoccl.ppermute(a, "tp", shift) + 1, v))
    got = mine(loop(shard(x)))
    assert np.allclose(got, (me - 37) % n + 1 + 37), got[0, :4]
    # async pairs around a staged sync call on XLA's stream (lane 0): staged on an async
    # stream's lane where the exchange kernel serves, else zero copy
    def pair(v):
        pending = jax_hoccl.psum_start(v, "tp")
        later = jax_hoccl.all_gather_start(v * 3, "tp", tiled=True)
        w = jax_hoccl.all_gather(pending.after_start(v) * 2, "tp", tiled=True)
        out, w = jax_hoccl.done(pending, w)
        return out, w, jax_hoccl.done(later)[0]
    calls = lambda: {lane: e for _, lane, e, _ in _hoccl.staged_lanes()}
    before = calls()
    out, w, g = jax.jit(jax.shard_map(pair, mesh=mesh, in_specs=spec,
                                      out_specs=(spec, spec, spec)))(shard(x))
    assert np.allclose(mine(out), sum(range(1, n + 1))) and mine(w).shape == (n * n, 32)
    assert np.allclose(mine(g), np.repeat(3.0 * np.arange(1, n + 1), n)[:, None]), mine(g)[:, 0]
    grew = {lane for lane, e in calls().items() if e > before.get(lane, 0)}
    lanes_on = os.environ.get("JAX_HOCCL_STAGED_KERNEL", "1") != "0"
    assert 0 in grew and bool(grew - {0}) == lanes_on, (before, calls())
    print("OK staged loop and lanes", flush=True)

    f = fn(lambda v: jax_hoccl.psum(v, "tp") / n)
    y = shard(np.ones((n, 256), np.float32))
    y = f(y).block_until_ready()
    fds, maps = len(os.listdir("/proc/self/fd")), _hoccl.live_peer_mappings()
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(10000):
        y = f(y)
    y.block_until_ready()
    assert np.allclose(mine(y), 1.0)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert len(os.listdir("/proc/self/fd")) <= fds + 2 and _hoccl.live_peer_mappings() == maps
    assert grown < 64 * 1024, grown  # KiB
    lanes = _hoccl.staged_lanes()  # the watchdog's view: the GPU got past every call
    assert lanes and all(enq == done for _, _, enq, done in lanes), lanes
    print(f"OK staged 10000 calls, max RSS grew {grown} KiB", flush=True)
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")

# A step of 12 small layers with a staged psum after each, jitted: XLA captures the staged
# calls into its CUDA graphs (command buffers) with the layers around them. Replays do not run
# the handlers: over 1,000 steps the handlers ran only while XLA recorded (their calls are
# counted). Right against numpy on every checked replay, with fresh input buffers at every
# call (XLA records again) and when only one rank's buffers change.
CAPTURE_WORKER = PRELUDE + textwrap.dedent("""
    L, rows, width = 12, 16, 512  # 32 KiB f32 per psum
    rng = np.random.default_rng(11)
    ws = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(L)]
    wj = [jnp.asarray(w) for w in ws]
    def step(h):
        for w in wj:
            h = jax.nn.gelu(jnp.dot(h, w, precision="highest"))
            h = jax_hoccl.psum(h, "tp") / n
        return h
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    def reference(xs):
        gelu = lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))
        hs = [x.astype(np.float64) for x in xs]
        for w in ws:
            hs = [gelu(h @ w) for h in hs]
            hs = [sum(hs) / n] * n
        return hs[me]
    def data(seed):
        return [np.random.default_rng(seed + r).standard_normal((rows, width)).astype(np.float32) for r in range(n)]
    def check(y, xs, what):
        got, want = mine(y), reference(xs)
        err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
        assert err < 1e-4, (what, err)
    xs = data(0)
    x = shard(xs[me])
    text = f.lower(x).as_text()
    summed = (os.environ.get("JAX_HOCCL_STAGED_KERNEL", "1") != "0"
              and os.environ.get("JAX_HOCCL_STAGED_SUM", "1") != "0")
    assert ("hoccl_psum_staged" if summed else "hoccl_all_gather_staged") in text, text[:3000]
    check(f(x), xs, "first")
    before = _hoccl.staged_lanes()
    ys = []
    t0 = time.perf_counter()
    for i in range(1000):
        ys.append(f(x))
        if i % 100 == 99:
            jax.block_until_ready(ys)
            ys = ys[-1:]
    jax.block_until_ready(ys)
    per_step = (time.perf_counter() - t0) / 1000 * 1e6
    check(ys[-1], xs, "after 1000 replays")
    eager = sum(e for _, lane, e, _ in _hoccl.staged_lanes() if lane == 0) - sum(
        e for _, lane, e, _ in before if lane == 0)
    captured = _hoccl.staged_captured_calls()
    print(f"TIME step of {L} layers with a psum each: {per_step:.1f} us; handler calls outside "
          f"graphs in 1000 steps: {eager}, recorded into graphs: {captured}", flush=True)
    if os.environ.get("CAPTURE") == "on":
        assert captured >= L and eager < 1000, (eager, captured)
    else:
        assert captured == 0 and eager == 1000 * L, (eager, captured)
    for i in range(20):  # fresh buffers on every rank
        xs = data(100 + 7 * i)
        check(f(shard(xs[me])), xs, f"fresh {i}")
    xs = data(500)
    mine_x = shard(xs[me])
    for i in range(20):  # only rank 0's buffers change
        check(f(shard(xs[me]) if me == 0 else mine_x), xs, f"rank 0 fresh {i}")
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")

# matmul_psum of decode's few rows: one kernel multiplies inside the packed exchange
# (cc/cuda/staged/gemv_psum_kernel.h). Every result against numpy, the same bits on every rank,
# slabs beyond the CTAs, ragged K, and a step of layers captured into CUDA graphs.
GEMV_WORKER = PRELUDE + textwrap.dedent("""
    import hashlib
    def operands(seed, m, k, cols, dtype):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((m, n * k)).astype(dtype)
        w = (rng.standard_normal((n * k, cols)) / np.sqrt(n * k)).astype(dtype)
        return x, w
    def reference(x, w, k, dtype):
        # each rank's product rounded to the type, added in float32 in rank order
        parts = [(x[:, r * k:(r + 1) * k].astype(np.float64) @ w[r * k:(r + 1) * k].astype(np.float64)
                  ).astype(dtype).astype(np.float32) for r in range(n)]
        return sum(parts[1:], parts[0]).astype(np.float64)
    cols_spec, rows_spec = P(None, "tp"), P("tp")
    def place(x, w, k):
        return (jax.make_array_from_process_local_data(NamedSharding(mesh, cols_spec), x[:, me * k:(me + 1) * k]),
                jax.make_array_from_process_local_data(NamedSharding(mesh, rows_spec), w[me * k:(me + 1) * k]))
    f = jax.jit(jax.shard_map(lambda a, b: jax_hoccl.matmul_psum(a, b, "tp"), mesh=mesh,
                              in_specs=(cols_spec, rows_spec), out_specs=P()))
    before = _hoccl.staged_packed_calls()
    digests = []
    for dtype in (jnp.bfloat16, np.float16):
        for m, k, cols in ((1, 1024, 4096), (3, 1028, 192), (8, 1024, 4096), (1, 512, 16384)):
            for seed in range(3):
                x, w = operands(seed + 10 * m, m, k, cols, dtype)
                xa, wa = place(x, w, k)
                if seed == 0:
                    text = f.lower(xa, wa).as_text()
                    assert "hoccl_matmul_psum_staged" in text, text[:3000]
                got = np.asarray(f(xa, wa).addressable_shards[0].data)
                want = reference(x, w, k, dtype)
                err = np.abs(got.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
                assert got.dtype == np.dtype(dtype) and err < 2e-2, (np.dtype(dtype).name, m, k, cols, err)
                digests.append(hashlib.sha1(got.tobytes()).hexdigest()[:12])
            print(f"OK gemv {np.dtype(dtype).name} {m}x{k}x{cols}", flush=True)
    assert _hoccl.staged_packed_calls() - before >= 24
    print("DIGESTS " + " ".join(digests), flush=True)
    # A decode step: L layers, each one's summed result sliced to the next one's columns.
    L, m, k = 6, 4, 512
    rng = np.random.default_rng(5)
    ws = [(rng.standard_normal((n * k, n * k)) / np.sqrt(n * k)).astype(jnp.bfloat16) for _ in range(L)]
    def step(h, *wl):
        for wi in wl:
            y = jax_hoccl.matmul_psum(h, wi, "tp")
            h = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("tp") * k, k, 1)
        return y
    g = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(cols_spec,) + (rows_spec,) * L,
                              out_specs=P(), check_vma=False))
    x0 = rng.standard_normal((m, n * k)).astype(jnp.bfloat16)
    want = x0
    for wi in ws:
        want = reference(want.astype(jnp.bfloat16), wi, k, jnp.bfloat16).astype(jnp.bfloat16)
    args = [jax.make_array_from_process_local_data(NamedSharding(mesh, cols_spec), x0[:, me * k:(me + 1) * k])]
    args += [jax.make_array_from_process_local_data(NamedSharding(mesh, rows_spec), wi[me * k:(me + 1) * k]) for wi in ws]
    captured = _hoccl.staged_captured_calls()
    ys = [g(*args) for _ in range(200)]
    jax.block_until_ready(ys)
    for y in (ys[0], ys[-1]):
        got = np.asarray(y.addressable_shards[0].data).astype(np.float64)
        err = np.abs(got - want.astype(np.float64)).max() / max(1.0, np.abs(want.astype(np.float64)).max())
        assert err < 5e-2, err
    print(f"OK decode step, {_hoccl.staged_captured_calls() - captured} calls recorded into graphs", flush=True)
    print("GPU_MP_OK", flush=True)
    os._exit(0)
""")


def _run(tmp_path, worker, timeout, env=None, n=2):
  """n processes sharing GPU 0, each with 0.6 / n of its memory (JAX_PLATFORMS dropped: they
  must see the GPU)."""
  return run_processes(tmp_path, worker, timeout, n,
                       env={"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.6 / n:.2f}", **(env or {})},
                       drop=("XLA_FLAGS", "JAX_PLATFORMS"))


def test_two_processes_on_one_gpu_every_op(tmp_path):
  outs = _run(tmp_path, OPS_WORKER, timeout=400, env={"JAX_HOCCL_TIMEOUT_S": "60"})
  for out in outs:
    print(out[-1500:])
  for out in outs:
    assert "GPU_MP_OK" in out, out[-4000:]
  assert not shared_memory_left()


def test_two_processes_on_one_gpu_without_preallocation(tmp_path):
  """XLA_PYTHON_CLIENT_PREALLOCATE=false: XLA makes many allocations, and new ones appear
  while the program runs; each is mapped by the peer on first sight and cached."""
  outs = _run(tmp_path, OPS_WORKER, timeout=400,
              env={"JAX_HOCCL_TIMEOUT_S": "60", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  for out in outs:
    assert "GPU_MP_OK" in out, out[-4000:]
  maps = [int(o.split("peer mappings ")[1].split()[0]) for o in outs]
  assert max(maps) > 2, maps  # more than the one pool and the flags: several allocations


# How a staged call moves its blocks: the exchange kernel (flags per chunk), copy calls and
# stream memory operations, or the packed exchange (every staged call but ppermute's); and
# the packed exchange with its psums summed by XLA after it (JAX_HOCCL_STAGED_SUM=0).
MOVERS = {mover: {"JAX_HOCCL_STAGED_KERNEL": kernel, "JAX_HOCCL_STAGED_PACKED_BYTES": packed,
                  "JAX_HOCCL_STAGED_SUM": summed}
          for mover, kernel, packed, summed in (
              ("exchange_kernel", "1", "0", "1"), ("copy_calls", "0", "0", "1"),
              ("packed", "1", "1048576", "1"), ("packed_xla_sum", "1", "1048576", "0"))}


@pytest.mark.parametrize("mover", ["exchange_kernel", "copy_calls", "packed", "packed_xla_sum"])
@pytest.mark.parametrize("n", [2, 4])
def test_staged_path_under_mps(tmp_path, n, mover):
  """exchange_kernel and packed: async starts staged on their lanes too, and psum /
  psum_scatter of floats summed inside the kernel (bit for bit); packed_xla_sum: summed by XLA
  after the exchange (JAX_HOCCL_STAGED_SUM=0); copy_calls (JAX_HOCCL_STAGED_KERNEL=0): staged
  on XLA's stream only, async starts zero copy, sums by XLA."""
  env = {"JAX_HOCCL_TIMEOUT_S": "60", "JAX_HOCCL_STAGED_BYTES": "4096", **MOVERS[mover]}
  with mps_daemon() as mps:
    outs = _run(tmp_path, STAGED_WORKER, timeout=300, env={**env, **mps}, n=n)
  for out in outs:
    print(out[-800:])
  for out in outs:
    assert "GPU_MP_OK" in out, out[-4000:]
  assert not shared_memory_left()


@pytest.mark.parametrize("n", [2, 4])
def test_packed_exchange_at_large_and_ragged_blocks(tmp_path, n):
  """Blocks of 1 MiB and blocks ending inside a packed word, every result against numpy bit for
  bit, with the packed exchange up to 1 MiB."""
  env = {"JAX_HOCCL_TIMEOUT_S": "60", **MOVERS["packed"],
         "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"}
  with mps_daemon() as mps:
    outs = _run(tmp_path, PACKED_WORKER, timeout=300, env={**env, **mps}, n=n)
  for out in outs:
    print(out[-800:])
  for out in outs:
    assert "GPU_MP_OK" in out, out[-4000:]


@pytest.mark.parametrize("capture,mover", [("on", "exchange_kernel"), ("on", "copy_calls"),
                                           ("on", "packed"), ("on", "packed_xla_sum"),
                                           ("off", "exchange_kernel"), ("off", "packed")])
def test_staged_calls_inside_cuda_graphs(tmp_path, capture, mover):
  """on: XLA's default command buffers; off: --xla_gpu_enable_command_buffer= (none). The
  exchange kernel's captured calls alternate two slot sets by a count on the device; copy
  calls (JAX_HOCCL_STAGED_KERNEL=0) meet their peers' arrival first. psums are summed inside
  the kernel, except by XLA with copy calls and packed_xla_sum."""
  env = {"JAX_HOCCL_TIMEOUT_S": "60", "CAPTURE": capture, **MOVERS[mover],
         "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"
         + (" --xla_gpu_enable_command_buffer=" if capture == "off" else "")}
  with mps_daemon() as mps:
    outs = _run(tmp_path, CAPTURE_WORKER, timeout=300, env={**env, **mps})
  for out in outs:
    print(out[-1500:])
  for out in outs:
    assert "GPU_MP_OK" in out, out[-4000:]


@pytest.mark.parametrize("n", [2, 4])
def test_decode_gemv_inside_the_packed_exchange(tmp_path, n):
  """matmul_psum of 1..8 rows (bf16, f16) as one kernel under MPS: right against numpy, the
  same bits on every rank, and a step of layers captured into XLA's CUDA graphs."""
  env = {"JAX_HOCCL_TIMEOUT_S": "60", "XLA_FLAGS": "--xla_gpu_shard_autotuning=false",
         "JAX_HOCCL_GEMV_PSUM": "1"}
  with mps_daemon() as mps:
    outs = _run(tmp_path, GEMV_WORKER, timeout=300, env={**env, **mps}, n=n)
  for out in outs:
    print(out[-1500:])
  for out in outs:
    assert "GPU_MP_OK" in out, out[-4000:]
  digests = {out.split("DIGESTS ")[1].split("\n")[0] for out in outs}
  assert len(digests) == 1, digests  # every rank holds the same bits


@pytest.mark.parametrize("n", [2, 4])
def test_processes_fused_ops_on_a_shared_gpu(tmp_path, n):
  """n = 4: the ring's partial sums also pass through recv, summed in place on the way."""
  outs = _run(tmp_path, FLAGGED_WORKER, timeout=450, env={"JAX_HOCCL_TIMEOUT_S": "120"}, n=n)
  for out in outs:
    assert "GPU_MP_OK" in out or "SKIP not Hopper" in out, out[-3000:]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("sharing", ["time-sliced", "mps", "mps-split"])
def test_fused_ops_at_realistic_sizes_never_hang(tmp_path, n, sharing):
  """Ranks sharing the GPU in turns (time-sliced), at once under MPS, or under MPS with the
  SMs split evenly between them (a stand-in for a GPU each)."""
  rows = "1024,4096,16384" if n == 2 or sharing == "mps" else "1024,4096"
  env = {"JAX_HOCCL_TIMEOUT_S": "120", "ROWS": rows,
         "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"}
  with contextlib.ExitStack() as stack:
    if sharing != "time-sliced":
      env.update(stack.enter_context(mps_daemon()))
    if sharing == "mps-split":
      env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // n)
    outs = _run(tmp_path, SIZES_WORKER, timeout=500, env=env, n=n)
  for out in outs:
    print(out[-1200:])
  for out in outs:
    assert "GPU_MP_OK" in out, out[-3000:]


def test_peer_that_never_calls(tmp_path):
  out = _run(tmp_path, FAILURE_WORKER, 120, {"MODE": "absent", "JAX_HOCCL_TIMEOUT_S": "5"})[0]
  assert "ERROR after" in out and "timed out after 5 s" in out, out[-3000:]
  assert "jax_hoccl psum (all_gather)" in out and "rank 1 (device" in out, out[-3000:]


@pytest.mark.parametrize("mover", ["exchange_kernel", "copy_calls"])
def test_peer_that_never_calls_the_flagged_gemm_op(tmp_path, mover):
  """exchange_kernel: the fused op's pipeline of staged async starts waits on the GPU (lanes
  1..), its handler thread behind them in the row GEMMs' tuning; the watchdog ends it all the
  same. copy_calls: the starts are zero copy and meet on the host."""
  env = {"MODE": "absent_fused", "JAX_HOCCL_TIMEOUT_S": "5",
         "JAX_HOCCL_STAGED_KERNEL": "1" if mover == "exchange_kernel" else "0"}
  out = _run(tmp_path, FAILURE_WORKER, 120, env)[0]
  assert "ERROR after" in out and "timed out after 5 s" in out, out[-3000:]
  assert "jax_hoccl matmul_reduce_scatter" in out and "rank 1 (device" in out, out[-3000:]


@pytest.mark.parametrize("mover", ["exchange_kernel", "packed"])
def test_peer_that_never_comes_to_a_captured_call(tmp_path, mover):
  """The wait is inside a replayed CUDA graph: no handler runs, the exchange kernel reports its
  own stall, and the watchdog ends it."""
  env = {"MODE": "absent_captured", "JAX_HOCCL_TIMEOUT_S": "5", **MOVERS[mover],
         "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"}
  with mps_daemon() as mps:
    out = _run(tmp_path, FAILURE_WORKER, 120, {**env, **mps})[0]
  assert "ERROR after" in out and "timed out after 5 s" in out, out[-3000:]
  assert "inside a CUDA graph" in out and "rank 1 (device" in out, out[-3000:]
  assert float(out.split("ERROR after ")[1].split(" s")[0]) < 15, out[-3000:]


def test_peer_that_never_comes_to_decodes_gemv(tmp_path):
  """Decode's GEMV inside the psum (JAX_HOCCL_GEMV_PSUM=1), replayed in a CUDA graph: its
  summing CTAs report their stall, the watchdog ends their waits and names matmul_psum."""
  env = {"MODE": "absent_gemv", "JAX_HOCCL_TIMEOUT_S": "5", "JAX_HOCCL_GEMV_PSUM": "1",
         "XLA_FLAGS": "--xla_gpu_shard_autotuning=false"}
  with mps_daemon() as mps:
    out = _run(tmp_path, FAILURE_WORKER, 120, {**env, **mps})[0]
  assert "ERROR after" in out and "timed out after 5 s" in out, out[-3000:]
  assert "inside a CUDA graph" in out and "matmul_psum" in out, out[-3000:]
  assert float(out.split("ERROR after ")[1].split(" s")[0]) < 15, out[-3000:]


def test_peer_that_exits(tmp_path):
  out = _run(tmp_path, FAILURE_WORKER, 120, {"MODE": "exit", "JAX_HOCCL_TIMEOUT_S": "30"})[0]
  assert "ERROR after" in out and "exited" in out, out[-3000:]
  assert float(out.split("ERROR after ")[1].split(" s")[0]) < 30
  assert not shared_memory_left()


@pytest.mark.parametrize("path", ["staged", "staged_packed", "zero_copy"])
def test_mismatched_calls_are_an_immediate_error(tmp_path, path):
  """Zero copy: the host rendezvous compares the calls. Staged: the flag values (packed: the
  flags beside the data) name the op and size, and the watchdog reads them within a second or
  two of standing still."""
  env = {"MODE": "mismatch", "JAX_HOCCL_TIMEOUT_S": "30",
         **MOVERS["packed" if path == "staged_packed" else "exchange_kernel"]}
  if path == "zero_copy":
    env["JAX_HOCCL_STAGED_BYTES"] = "0"
  outs = _run(tmp_path, FAILURE_WORKER, 120, env)
  for out in outs:
    print(out[-2000:])
  for out in outs:
    assert "ERROR after" in out and "mismatched collectives" in out, out[-3000:]
    if path == "zero_copy":
      assert "psum (all_gather) of 16 bytes" in out and "all_to_all of 16 bytes" in out, out[-3000:]
    else:
      # psum's float32 blocks are summed inside the exchange: its flags say psum
      assert "psum of 16-byte blocks of float32" in out, out[-3000:]
      assert "all_to_all of 8-byte blocks" in out, out[-3000:]
    assert float(out.split("ERROR after ")[1].split(" s")[0]) < 30


@pytest.mark.parametrize("path", ["staged", "staged_packed", "zero_copy"])
def test_sums_of_two_types_of_one_size_are_a_mismatch(tmp_path, path):
  """bfloat16 on one rank, float16 on the other: as many bytes, but the flags (staged) or the
  rendezvous's descriptions (zero copy) name the type, so the ranks do not add each other's
  bits as their own type. (The ranks compile different programs: XLA's sharded autotuning
  would wait for the other's.)"""
  env = {"MODE": "mismatch_type", "JAX_HOCCL_TIMEOUT_S": "30",
         "XLA_FLAGS": "--xla_gpu_shard_autotuning=false",
         **MOVERS["packed" if path == "staged_packed" else "exchange_kernel"]}
  if path == "zero_copy":
    env["JAX_HOCCL_STAGED_BYTES"] = "0"
  outs = _run(tmp_path, FAILURE_WORKER, 120, env)
  for out in outs:
    assert "ERROR after" in out and "mismatched collectives" in out, out[-3000:]
    if path == "zero_copy":
      assert "psum (all_gather) of 8 bytes of bfloat16" in out, out[-3000:]
      assert "psum (all_gather) of 8 bytes of float16" in out, out[-3000:]
    else:
      assert "psum of 8-byte blocks of bfloat16" in out, out[-3000:]
      assert "psum of 8-byte blocks of float16" in out, out[-3000:]
    assert float(out.split("ERROR after ")[1].split(" s")[0]) < 30


def test_peer_killed(tmp_path):
  out = _run(tmp_path, FAILURE_WORKER, 120, {"MODE": "kill", "JAX_HOCCL_TIMEOUT_S": "30"})[0]
  assert "ERROR after" in out and "exited" in out, out[-3000:]
  assert float(out.split("ERROR after ")[1].split(" s")[0]) < 30
  assert not shared_memory_left()


LAUNCHED = textwrap.dedent("""
    import os, signal, time
    from jax_hoccl import launch
    launch.initialize()
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_hoccl
    assert jax.devices()[0].platform == "gpu", jax.devices()
    print("SECRET", os.environ["JAX_HOCCL_JOB_SECRET"], flush=True)
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    f = jax.jit(jax.shard_map(lambda v: jax_hoccl.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    def ones(rows):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                                      np.ones(rows, np.float32))
    y = f(ones(1024))
    assert float(np.asarray(y.addressable_shards[0].data)[0]) == jax.device_count()
    print("FIRST OK", flush=True)
    mode = os.environ["MODE"]
    if jax.process_index() == 1:
        if mode == "exit":
            os._exit(0)
        if mode == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            time.sleep(1000)
    f(ones(1 << 16)).block_until_ready()
    print("SECOND OK", flush=True)
""")


def _launch(tmp_path, n, mode, timeout_s=3):
  script = tmp_path / "prog.py"
  script.write_text(LAUNCHED)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(MODE=mode, JAX_HOCCL_TIMEOUT_S=str(timeout_s),
             XLA_FLAGS="--xla_gpu_shard_autotuning=false")
  # The bound: the timeout, plus 10 s, plus the processes' start (jax on the GPU, MPS).
  out = subprocess.run([sys.executable, "-P", "-m", "jax_hoccl.launch", "-n", str(n),
                        str(script)], env=env, capture_output=True, text=True,
                       timeout=timeout_s + 10 + 30)
  text = out.stdout + out.stderr
  secret = {line.split()[-1] for line in text.splitlines() if " SECRET " in line}
  assert len(secret) == 1, text[-3000:]
  assert not [f for f in os.listdir("/dev/shm") if secret.pop() in f], text[-3000:]
  return out.returncode, text


@pytest.mark.parametrize("n", [2, 4])
def test_launcher_ends_a_failing_job_under_mps(tmp_path, n):
  """n ranks sharing the GPU under the launcher's MPS daemon: a peer that exits, one that is
  SIGKILLed and one that hangs each end the job within the timeout plus 10 s, with the
  summary and the failing process's code, and leave nothing in /dev/shm; a job launched
  after them still runs under MPS (the daemon was quit after its clients were ended)."""
  for mode, code, what in [("exit", 1, "gave up: jax_hoccl psum"),
                           ("SIGKILL", 137, "1 (pid"),
                           ("hang", 1, "timed out after 3 s")]:
    rc, text = _launch(tmp_path, n, mode)
    assert rc == code and "jax_hoccl.launch: process" in text, (mode, rc, text[-3000:])
    assert what in text.split("jax_hoccl.launch: process", 1)[1], (mode, text[-3000:])
    assert "no MPS daemon" not in text, text[-3000:]
  rc, text = _launch(tmp_path, n, "clean")
  assert rc == 0 and all(f"[{i}] SECOND OK" in text for i in range(n)), text[-3000:]
  assert "no MPS daemon" not in text, text[-3000:]
