"""Experiment (H200), which chose round_graph.py's layout: a pinned call's round as ONE graph launch.

[memcpy in] -> [event] -> [FFN graph captured by torch] -> [event] -> [memcpy out], assembled
with the CUDA runtime's graph API through ctypes; per call cudaGraphExecMemcpyNodeSetParams1D
points the copies at the request's region, then one cudaGraphLaunch (`one_graph`). Beside it: the
same without the events (`no_events`); copies and events captured by torch with the FFN, the copy
nodes found by their pointers, replayed by torch (`flat`); and `current`, run_round as it was at
eed627f (copy_, replay, copy_, events). Since c0473d4 run_round takes the one-launch path for
such a call, so `current` now measures that.

Measured at eed627f on two H200 hosts, 64 tokens at Mixtral size, round in us back to back / once
every 200 us: current 207 / - and 190 / 196, one_graph 182 / 178 and 173 / 177, no_events 170 / 172,
flat 182 / 183. The GPU's idle time between the copy in and the FFN's first kernel (torch_trace.py):
current 40 and 18 us, every one-graph variant 10-11. All wrote the same bytes as eager rounds,
re-pointed at two regions in turn. (Since then (a) and (b) are built by one function; not re-run.)

    python benchmarks/experiments/round_graph_probe.py TRACE_DIR   # on the GPU host, ~15 s
"""
import ctypes, json, statistics, sys, tempfile, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torch_trace
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn.batcher import Job, run_round
from kubemoe.expert_fn.graphs import ExpertGraphs
from kubemoe.expert_fn.shm import HEADER_BYTES, Segment

H, I, T = 4096, 14336, 64
dev, dt, act = torch.device("cuda"), torch.bfloat16, torch.nn.functional.silu
g = torch.Generator().manual_seed(0)
w = ExpertWeights((torch.randn(2 * I, H, generator=g) / 64).to(dev, dt), (torch.randn(H, I, generator=g) / 64).to(dev, dt))
x = torch.randn(T, H, generator=g).to(dt)
x2 = torch.randn(T, H, generator=g).to(dt)
ref, ref2 = expert_ffn(x.to(dev), w, act).cpu(), expert_ffn(x2.to(dev), w, act).cpu()
out = {"torch": torch.__version__}

lib = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line)
out["cudart"] = lib
rt = ctypes.CDLL(lib)
P, S = ctypes.c_void_p, ctypes.c_size_t


def check(code, what):
    if code != 0:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {code} {rt.cudaGetErrorString(code).decode()}")


folder = tempfile.mkdtemp(dir="/dev/shm")
seg = Segment.create(folder, 16 << 20)
seg.unlink()
out["pinned"] = seg.pin()
region = seg.view(HEADER_BYTES, dt, [T, H])
region2 = seg.view(HEADER_BYTES + (1 << 20), dt, [T, H])

# --- the FFN graph, as graphs.py captures it, kept as a cudaGraph_t
inp, outp = torch.zeros(T, H, device=dev, dtype=dt), torch.zeros(T, H, device=dev, dtype=dt)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    expert_ffn(inp, w, act, out=outp)
    ffn = torch.cuda.CUDAGraph(keep_graph=True)
    ffn.capture_begin(capture_error_mode="thread_local")
    expert_ffn(inp, w, act, out=outp)
    ffn.capture_end()
torch.cuda.current_stream().wait_stream(side)
torch.cuda.synchronize()

# --- (a) and (b): the round graph, with and without event nodes around the FFN
staging = torch.empty(T, H, dtype=dt, pin_memory=True)
nbytes = T * H * 2
ev0, ev1 = P(), P()
check(rt.cudaEventCreate(ctypes.byref(ev0)), "event")
check(rt.cudaEventCreate(ctypes.byref(ev1)), "event")


def assemble(events: bool) -> tuple[P, P, P]:
    """copy in -> [event] -> FFN -> [event] -> copy out: (its executable graph, copy in, copy out)."""
    graph = P()
    check(rt.cudaGraphCreate(ctypes.byref(graph), 0), "create")

    def add(function, after: P | None, *args) -> P:
        node = P()
        check(function(ctypes.byref(node), graph, None if after is None else ctypes.byref(after),
                       S(0 if after is None else 1), *args), function.__name__)
        return node

    copy_in = after = add(rt.cudaGraphAddMemcpyNode1D, None, P(inp.data_ptr()), P(staging.data_ptr()), S(nbytes), 1)
    if events:
        after = add(rt.cudaGraphAddEventRecordNode, after, ev0)
    after = add(rt.cudaGraphAddChildGraphNode, after, P(ffn.raw_cuda_graph()))
    if events:
        after = add(rt.cudaGraphAddEventRecordNode, after, ev1)
    copy_out = add(rt.cudaGraphAddMemcpyNode1D, after, P(staging.data_ptr()), P(outp.data_ptr()), S(nbytes), 2)
    executable = P()
    check(rt.cudaGraphInstantiate(ctypes.byref(executable), graph, ctypes.c_ulonglong(0)), "instantiate")
    return executable, copy_in, copy_out


exe, n_in, n_out = assemble(events=True)
exe_b, b_in, b_out = assemble(events=False)
stream = torch.cuda.Stream()
sh = P(stream.cuda_stream)
ms = ctypes.c_float()
set1d = rt.cudaGraphExecMemcpyNodeSetParams1D
launch, sync, elapsed = rt.cudaGraphLaunch, rt.cudaStreamSynchronize, rt.cudaEventElapsedTime


def point(executable: P, copy_in: P, copy_out: P, r: torch.Tensor) -> None:
    """Re-point a graph's copies at the region `r` (in, then the reply back over it)."""
    set1d(executable, copy_in, P(inp.data_ptr()), P(r.data_ptr()), S(nbytes), 1)
    set1d(executable, copy_out, P(r.data_ptr()), P(outp.data_ptr()), S(nbytes), 2)


def graph_round(r: torch.Tensor) -> float:
    point(exe, n_in, n_out, r)
    launch(exe, sh)
    sync(sh)
    elapsed(ctypes.byref(ms), ev0, ev1)
    return ms.value / 1e3


def no_events_round(r: torch.Tensor) -> float:
    point(exe_b, b_in, b_out, r)
    launch(exe_b, sh)
    sync(sh)
    return 0.0


# --- (c) flat: copies and events captured by torch with the FFN; memcpy nodes found by their pointers
try:
    staging_out = torch.empty(T, H, dtype=dt, pin_memory=True)
    e0, e1 = torch.cuda.Event(enable_timing=True, external=True), torch.cuda.Event(enable_timing=True, external=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flat = torch.cuda.CUDAGraph(keep_graph=True)
        flat.capture_begin(capture_error_mode="thread_local")
        inp.copy_(staging, non_blocking=True)
        e0.record()
        expert_ffn(inp, w, act, out=outp)
        e1.record()
        staging_out.copy_(outp, non_blocking=True)
        flat.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    flat.instantiate()
    count = S(0)
    check(rt.cudaGraphGetNodes(P(flat.raw_cuda_graph()), None, ctypes.byref(count)), "nodes")
    nodes = (P * count.value)()
    check(rt.cudaGraphGetNodes(P(flat.raw_cuda_graph()), nodes, ctypes.byref(count)), "nodes")
    params = (ctypes.c_ubyte * 256)()
    c_in = c_out = None
    types = []
    for node in nodes:
        kind = ctypes.c_int()
        check(rt.cudaGraphNodeGetType(P(node), ctypes.byref(kind)), "type")
        types.append(kind.value)
        if kind.value == 1:
            check(rt.cudaGraphMemcpyNodeGetParams(P(node), params), "params")
            src = ctypes.c_void_p.from_buffer(params, 32).value
            dst = ctypes.c_void_p.from_buffer(params, 96).value
            if src == staging.data_ptr():
                c_in = P(node)
            if dst == staging_out.data_ptr():
                c_out = P(node)
    out["flat_node_types"] = types
    out["flat_found"] = [c_in is not None, c_out is not None]
    exe_c = P(flat.raw_cuda_graph_exec())
except Exception as e:
    out["flat_error"] = repr(e)
    print("flat failed", repr(e), flush=True)


def flat_round(r: torch.Tensor) -> float:
    point(exe_c, c_in, c_out, r)
    flat.replay()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1e3


def current_round(r: torch.Tensor, graphs=ExpertGraphs(H, act, dev, dt, 64)) -> float:  # noqa: B008 - one set, captured once
    job = Job(r, [((0, 0), T)], out_buffer=r, pinned=True)
    run_round([job], lambda key: w, act, dev, dt, graphs)
    return job.compute_seconds


def err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


for name, fn in (("current", current_round), ("one_graph", graph_round), ("no_events", no_events_round),
                 ("flat", flat_round)):
    if "flat_error" in out and name == "flat":
        continue
    errs = []
    for r, src, want in ((region, x, ref), (region2, x2, ref2), (region, x2, ref2)):
        r.copy_(src)
        fn(r)
        errs.append(err(r, want))
    out[f"{name}_rel_err"] = errs

    for gap_us in (0, 200):
        times, computes = [], []
        for i in range(320):
            if gap_us:
                until = time.perf_counter() + gap_us / 1e6
                while time.perf_counter() < until:
                    pass
            r = region if i % 2 else region2
            r.copy_(x)
            t0 = time.perf_counter()
            computes.append(fn(r))
            times.append(time.perf_counter() - t0)
        out[f"{name}_gap{gap_us}"] = {"round_us": round(statistics.median(times[20:]) * 1e6, 1),
                                     "compute_us": round(statistics.median(computes[20:]) * 1e6, 1),
                                     "p90_us": round(sorted(times[20:])[270] * 1e6, 1)}
    print(name, {k: v for k, v in out.items() if k.startswith(name)}, flush=True)

try:
    import torch_trace
    trace_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")
    for name, fn in (("current", current_round), ("one_graph", graph_round), ("no_events", no_events_round),
                     ("flat", flat_round)):
        if "flat_error" in out and name == "flat":
            continue
        with torch_trace.window(trace_dir / f"probe_{name}.json"):
            for i in range(40):
                fn(region)
        out[f"{name}_trace"] = torch_trace.gaps(trace_dir / f"probe_{name}.json")["gpu_idle_between"]
except Exception as e:
    out["trace_error"] = repr(e)
seg.unpin()
print(json.dumps({k: v for k, v in out.items() if k.endswith("trace")}))
