"""The recurrent operator's decode step through the Python API, same run, same inputs.

CUDA (--device cuda), issue 15's cases B64 H16 K=V=128, B64 H4 K256 V512, B256 H16 K=V=128: libgla's
gla.fused_recurrent_gla against fla's fused_recurrent_gla called as fla's GLA layer decodes (one
token, bf16 q/k/v/gk, fp32 state in and out, state_v_first where fla's signature has it), each timed
two ways:
  call    back-to-back Python calls between two CUDA events, then a synchronisation; the median
          over ROUNDS rounds of REPS calls (host overhead included: what one decode step costs);
  graph   replay of a CUDA graph holding GRAPH_CALLS calls (device time only), median over ROUNDS.
Then gla.recurrent_state_update on a pool (state in place, device slots), timed both ways too,
against the state read + write floor: 2 * B*H*K*V * 4 bytes over the device-to-device copy
bandwidth measured in the same run on a buffer of that size. fla is imported if installed
(fla-core), else its columns are skipped.

CPU (--device cpu): the decode step (and a short prefill) on the cpu, reference and torch backends.

    GLA_LIBRARY=build/libgla.so python3 bench/recurrent_bench.py --device cpu
    PYTHONPATH=/tmp/site GLA_LIBRARY=build-cuda/libgla.so python3 bench/recurrent_bench.py --device cuda \
        --json bench/results/recurrent_h200.json
"""
import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gla  # noqa: E402
from gla import _ops  # noqa: E402

CUDA_SHAPES = [(64, 16, 128, 128), (64, 4, 256, 512), (256, 16, 128, 128)]
ROUNDS, REPS, GRAPH_CALLS = 21, 50, 20


def decode_inputs(B, H, K, V, device, dtype=torch.bfloat16, T=1, v_first=True, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = (x.to(dtype).to(device) for x in (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)))
    gk = (F.logsigmoid(r(B, T, H, K)) / 16).to(dtype).to(device)
    state = r(B, H, V, K) if v_first else r(B, H, K, V)
    return q, k, v, gk, state.to(device)


def events_ms(fn, calls=REPS, rounds=ROUNDS, warm=20):
    """ms per call of fn: `calls` back-to-back calls between two CUDA events, synchronised; the
    median over `rounds` rounds."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_ms(fn, calls=GRAPH_CALLS):
    """Device ms per call of fn: a CUDA graph of `calls` calls, replayed (events_ms over replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return events_ms(g.replay, calls=5) / calls


def copy_bandwidth(nbytes):
    """Bytes read + written per second by a device copy of nbytes (the floor's bandwidth)."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = graph_ms(lambda: b.copy_(a))
    return 2 * nbytes / (ms * 1e-3), ms


def run_cuda(args):
    try:
        from fla.ops.gla import fused_recurrent_gla as fla_recurrent
        fla_params = inspect.signature(fla_recurrent).parameters
    except ImportError as e:
        fla_recurrent, fla_params = None, {}
        print(f"fla not importable ({e}): fla columns skipped")
    rows = []
    for B, H, K, V in CUDA_SHAPES:
        q, k, v, gk, state = decode_inputs(B, H, K, V, "cuda")
        fla_v_first = "state_v_first" in fla_params
        call_gla = lambda: gla.fused_recurrent_gla(q, k, v, gk, initial_state=state, output_final_state=True,  # noqa: E731
                                                   state_v_first=True)
        row = {"B": B, "H": H, "K": K, "V": V}
        o, ht = call_gla()
        row["gla_call_ms"] = events_ms(call_gla)
        row["gla_graph_ms"] = graph_ms(call_gla)
        if fla_recurrent is not None:
            fla_state = state if fla_v_first else state.transpose(-1, -2).contiguous()
            kw = {"state_v_first": True} if fla_v_first else {}
            call_fla = lambda: fla_recurrent(q, k, v, gk=gk, initial_state=fla_state, output_final_state=True, **kw)  # noqa: E731
            o_f, ht_f = call_fla()
            ht_f = ht_f if fla_v_first else ht_f.transpose(-1, -2)
            row["rel_rms_o_vs_fla"] = ((o.float() - o_f.float()).norm() / o_f.float().norm()).item()
            row["rel_rms_state_vs_fla"] = ((ht - ht_f).norm() / ht_f.norm()).item()
            row["fla_state_v_first"] = fla_v_first
            row["fla_call_ms"] = events_ms(call_fla)
            row["fla_graph_ms"] = graph_ms(call_fla)
            row["speedup_call"] = row["fla_call_ms"] / row["gla_call_ms"]
            row["speedup_graph"] = row["fla_graph_ms"] / row["gla_graph_ms"]
        # The pool update (state in place, slots on the device): calls and graph replay.
        pool = state.clone()
        slots = torch.randperm(B, generator=torch.Generator().manual_seed(1)).to(torch.int32).cuda()
        error = torch.zeros(1, dtype=torch.int32, device="cuda")
        update = lambda: gla.recurrent_state_update(q, k, v, pool, slots, error, gk=gk, state_v_first=True)  # noqa: E731
        row["pool_call_ms"] = events_ms(update)
        row["pool_graph_ms"] = graph_ms(update)
        state_bytes = B * H * K * V * 4
        bandwidth, _ = copy_bandwidth(state_bytes)
        row["copy_bandwidth_TBps"] = bandwidth / 1e12
        row["floor_ms"] = 2 * state_bytes / bandwidth * 1e3
        row["pool_vs_floor"] = row["pool_graph_ms"] / row["floor_ms"]
        assert error.item() == 0
        rows.append(row)
        print(json.dumps(row))
    return rows


def wall_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_cpu(args):
    rows = []
    for B, T, H, K, V in [(8, 1, 4, 128, 128), (2, 1, 4, 256, 512), (2, 64, 4, 64, 128)]:
        q, k, v, gk, state = decode_inputs(B, H, K, V, "cpu", dtype=torch.float32, T=T)
        row = {"B": B, "T": T, "H": H, "K": K, "V": V}
        outs = {}
        for backend, reps in (("cpu", 50), ("torch", 20), ("reference", 3)):
            def call():
                with gla.backend(backend):
                    return gla.fused_recurrent_gla(q, k, v, gk, initial_state=state, output_final_state=True,
                                                   state_v_first=True)
            row[f"{backend}_ms"] = wall_ms(call, reps)
            outs[backend] = call()
        ref_o, ref_ht = outs["reference"]
        for backend in ("cpu", "torch"):
            o, ht = outs[backend]
            row[f"{backend}_rel_rms_o"] = ((o - ref_o).norm() / ref_o.norm()).item()
        row["cpu_vs_reference"] = row["reference_ms"] / row["cpu_ms"]
        row["cpu_vs_torch"] = row["torch_ms"] / row["cpu_ms"]
        rows.append(row)
        print(json.dumps(row))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    info = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": os.environ.get("GLA_NUM_THREADS", str(os.cpu_count())), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    info["operators"] = _ops.native_path or "ctypes fallback"
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    print(json.dumps(info))
    rows = run_cuda(args) if args.device == "cuda" else run_cpu(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
