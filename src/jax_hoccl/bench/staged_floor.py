"""The floor of a staged one-hop exchange: raw CUDA driver calls (ctypes on libcuda, no XLA,
no jax_hoccl), n processes sharing GPU 0 under the caller's MPS daemon. Each exchange, on one
stream per rank: copy my input into every peer's staging slot (IPC-mapped once), raise the
peer's flag behind it (a stream memory write), wait for and reset my own flags, copy my slots
out. Slots and flags alternate between two sets, so a peer one exchange ahead never
overwrites what is still to be read. Ten exchanges are captured into one CUDA graph and the
graph is replayed back to back: the time per exchange is device-bound, the floor a staged
collective's device time is judged against (bench --steps' "floor_us").

    floors(n, sizes, env) -> {bytes: us per exchange}  (the slowest rank's, median of REPEATS)
"""
from __future__ import annotations

import os
import statistics
import tempfile
import textwrap

from jax_hoccl.bench import ranks
from jax_hoccl.launch import run_workers

EXCHANGES_PER_GRAPH = 10  # even: every replay starts on slot set 0
LAUNCHES = 200
REPEATS = 5

WORKER = textwrap.dedent("""
    import ctypes, json, os, sys, time
    me, n = int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in os.environ["FLOOR_SIZES"].split(",")]
    per_graph, launches, repeats = (int(os.environ[v]) for v in
                                    ("FLOOR_PER_GRAPH", "FLOOR_LAUNCHES", "FLOOR_REPEATS"))
    folder = os.environ["FLOOR_DIR"]
    cu = ctypes.CDLL("libcuda.so.1")
    u64, c_uint = ctypes.c_uint64, ctypes.c_uint

    def fn(*names):  # the first of these entry points that the driver exports
        for name in names:
            if hasattr(cu, name):
                return getattr(cu, name)
        raise RuntimeError(f"libcuda has none of {names}")

    def check(status, what):
        if status:
            raise RuntimeError(f"{what}: CUDA driver error {status}")

    class IpcHandle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    alloc = fn("cuMemAlloc_v2")
    alloc.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t]
    memset = fn("cuMemsetD8_v2")
    memset.argtypes = [u64, ctypes.c_ubyte, ctypes.c_size_t]
    copy = fn("cuMemcpyDtoDAsync_v2")
    copy.argtypes = [u64, u64, ctypes.c_size_t, ctypes.c_void_p]
    to_host = fn("cuMemcpyDtoH_v2")
    to_host.argtypes = [ctypes.c_void_p, u64, ctypes.c_size_t]
    write = fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    write.argtypes = [ctypes.c_void_p, u64, c_uint, c_uint]
    wait = fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    wait.argtypes = [ctypes.c_void_p, u64, c_uint, c_uint]
    get_handle = fn("cuIpcGetMemHandle")
    get_handle.argtypes = [ctypes.POINTER(IpcHandle), u64]
    open_handle = fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
    open_handle.argtypes = [ctypes.POINTER(u64), IpcHandle, c_uint]
    begin = fn("cuStreamBeginCapture_v2", "cuStreamBeginCapture")
    begin.argtypes = [ctypes.c_void_p, c_uint]
    end = fn("cuStreamEndCapture")
    end.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    instantiate = fn("cuGraphInstantiateWithFlags")
    instantiate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
    launch = fn("cuGraphLaunch")
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    sync = fn("cuStreamSynchronize")
    sync.argtypes = [ctypes.c_void_p]

    # my allocation: flags [set][sender] (4 bytes each, 256 bytes per set), then slots
    # [set][sender] of the largest size; my input and my output beside it
    big = max(sizes)
    flags_bytes = 2 * 256
    def flag(base, s, sender): return base + s * 256 + 4 * sender
    def slot(base, s, sender): return base + flags_bytes + (s * n + sender) * big
    mine, inp, out = u64(), u64(), u64()
    check(alloc(ctypes.byref(mine), flags_bytes + 2 * n * big), "cuMemAlloc")
    check(alloc(ctypes.byref(inp), big), "cuMemAlloc")
    check(alloc(ctypes.byref(out), n * big), "cuMemAlloc")
    check(memset(mine.value, 0, flags_bytes + 2 * n * big), "cuMemset")
    check(memset(inp.value, me + 1, big), "cuMemset")
    handle = IpcHandle()
    check(get_handle(ctypes.byref(handle), mine.value), "cuIpcGetMemHandle")
    with open(os.path.join(folder, f"{me}.tmp"), "wb") as f:
        f.write(ctypes.string_at(ctypes.addressof(handle), 64))
    os.rename(os.path.join(folder, f"{me}.tmp"), os.path.join(folder, f"{me}.handle"))
    base = [None] * n
    base[me] = mine.value
    deadline = time.monotonic() + 60
    for p in range(n):
        path = os.path.join(folder, f"{p}.handle")
        while p != me and not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {me}: no IPC handle from rank {p} within 60 s")
            time.sleep(0.01)
        if p != me:
            h, mapped = IpcHandle(), u64()
            with open(path, "rb") as f:
                ctypes.memmove(ctypes.addressof(h), f.read(64), 64)
            check(open_handle(ctypes.byref(mapped), h, 1), "cuIpcOpenMemHandle")
            base[p] = mapped.value
    stream = ctypes.c_void_p()
    check(cu.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    peers = [(me + k) % n for k in range(1, n)]
    EQ = 1

    def exchange(k, nbytes):
        s = k % 2
        for d in peers:
            check(copy(slot(base[d], s, me), inp.value, nbytes, stream), "copy in")
            check(write(stream, flag(base[d], s, me), 1, 0), "flag")
        for p in peers:
            check(wait(stream, flag(mine.value, s, p), 1, EQ), "wait")
            check(write(stream, flag(mine.value, s, p), 0, 0), "reset")
        for p in peers:
            check(copy(out.value + p * big, slot(mine.value, s, p), nbytes, stream), "copy out")

    floors = {}
    for nbytes in sizes:
        for k in range(20):
            exchange(k, nbytes)
        check(sync(stream), "sync")
        got = (ctypes.c_ubyte * 1)()
        for p in peers:  # the peers' bytes arrived
            check(to_host(got, out.value + p * big + nbytes - 1, 1), "read back")
            assert got[0] == p + 1, (me, p, got[0])
        check(begin(stream, 1), "begin capture")
        for k in range(per_graph):
            exchange(k, nbytes)
        graph, graph_exec = ctypes.c_void_p(), ctypes.c_void_p()
        check(end(stream, ctypes.byref(graph)), "end capture")
        check(instantiate(ctypes.byref(graph_exec), graph, 0), "instantiate")
        times = []
        for _ in range(repeats):
            for _ in range(3):  # the ranks meet: the timed launches start together
                check(launch(graph_exec, stream), "launch")
            check(sync(stream), "sync")
            t0 = time.perf_counter()
            for _ in range(launches):
                check(launch(graph_exec, stream), "launch")
            check(sync(stream), "sync")
            times.append((time.perf_counter() - t0) / (launches * per_graph) * 1e6)
        floors[nbytes] = times
    print("RESULT" + json.dumps({"floors": floors}), flush=True)
    os._exit(0)
""")


def floors(n: int, sizes, env: dict) -> dict[int, float]:
  """{bytes: us per exchange} for n ranks on GPU 0 (env: the MPS daemon's among others): each
  repeat's slowest rank, the median over the repeats."""
  with tempfile.TemporaryDirectory(prefix="staged-floor-") as folder:
    env = {**env, "FLOOR_DIR": folder, "FLOOR_SIZES": ",".join(str(s) for s in sizes),
           "FLOOR_PER_GRAPH": str(EXCHANGES_PER_GRAPH), "FLOOR_LAUNCHES": str(LAUNCHES),
           "FLOOR_REPEATS": str(REPEATS)}
    found = ranks.results(run_workers(WORKER, n, env, 120))
  out = {}
  for nbytes in sizes:
    per_rank = [f["floors"][str(nbytes)] for f in found]
    out[nbytes] = statistics.median(max(r[i] for r in per_rank) for i in range(REPEATS))
  return out


def main() -> None:  # python -m jax_hoccl.bench.staged_floor: 2 and 4 ranks under MPS
  from jax_hoccl.launch import mps_daemon
  for n in (2, 4):
    with mps_daemon() as env:
      for nbytes, us in floors(n, (4096, 65536, 131072, 1 << 20),
                               {**os.environ, **env}).items():
        print(f"ranks {n} {nbytes:>8} bytes: {us:6.2f} us per exchange (floor)")


if __name__ == "__main__":
  main()
