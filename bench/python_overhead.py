"""Host overhead per call of gla.chunk_gla and of the recurrent decode step (issue 20): a tiny
problem (chunk: B=1 T=64 H=1 K=V=64; decode: B=1 T=1 H=1 K=V=64, fp32 state in and out,
state_v_first), calls back to back, wall time and process CPU time per call.

    python3 bench/python_overhead.py [--device cpu|cuda|all] [--calls 2000] [--repeats 7]

Rows, per device:
  forward, no_grad          gla.chunk_gla under torch.no_grad()
  forward, requires_grad    q, k, v, g require grad (the autograd node is built, no backward)
  forward + backward        forward, then o.sum().backward()
  recurrent decode, ...     gla.fused_recurrent_gla(q, k, v, gk, initial_state=h, output_final_state=True,
                            state_v_first=True) on one token: no_grad and requires_grad
  pool update               gla.recurrent_state_update on a pool of 4 states, 1 sequence, 1 token
  C call (kernel)           CPU: gla_chunk_forward / gla_chunk_backward / gla_recurrent_forward /
                            gla_recurrent_state_update through ctypes on descriptors built once, i.e.
                            libgla's validation + dispatch + the cpu kernel, with no PyTorch in the
                            loop: the part of the rows above that is not overhead.
                            CUDA: GPU time per call of the same calls replayed from a CUDA graph.
  fla                       fla's chunk_gla and fused_recurrent_gla the same way, when fla is
                            importable (CUDA only).
Also the ctypes fallback (GLA_NATIVE_OPS=0, in a child process) for comparison, with --fallback.

Each figure is the best over the repeats of (time of `calls` calls) / calls. On a loaded machine
the process CPU time is the steadier figure; the wall time is what issue 20's targets are about.

Instructions per call (load-independent): one row, CPU, under callgrind with instrumentation on for
the measured calls only (bench/callgrind_toggle.c, built as its header says):

    valgrind --tool=callgrind --instr-atstart=no python3 bench/python_overhead.py --device cpu \
        --row "forward, requires_grad" --calls 1000 --callgrind-toggle /tmp/callgrind_toggle.so

then the dump's `totals:` line (callgrind.out.<pid>.1) / 1000. The C call rows count too
("C call (kernel): forward").
"""
from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
import gla  # noqa: E402
from gla import _lib, _ops, _recurrent_ctypes, _tensors  # noqa: E402

B, T, H, D = 1, 64, 1, 64
P = 4  # states in the pool of the decode rows (B=1 T=1 H=1 K=V=D)


def inputs(device, dtype, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.rand(B, T, H, D, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, generator=gen)) / 16
    return [t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
            for t in (q, k, v, g)]


def decode_inputs(device, dtype, requires_grad=False):
    """One token of one sequence: q, k, v, gk [1, 1, 1, D], its fp32 state [1, 1, D, D] (V-first),
    a pool [P, 1, D, D] with the sequence in slot 2, and the error flag."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.rand(1, 1, 1, D, generator=gen) for _ in range(3))
    gk = torch.nn.functional.logsigmoid(torch.randn(1, 1, 1, D, generator=gen)) / 16
    tokens = [t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v, gk)]
    state = torch.randn(1, 1, D, D, generator=gen).to(device)
    pool = torch.randn(P, 1, D, D, generator=gen).to(device)
    slots = torch.tensor([2], dtype=torch.int32, device=device)
    return tokens + [state, pool, slots, torch.zeros(1, dtype=torch.int32, device=device)]


def decode_calls(x):
    """The decode step and the pool update on decode_inputs' tensors (fla's layer's call)."""
    q, k, v, gk, state, pool, slots, error = x
    return (lambda: gla.fused_recurrent_gla(q, k, v, gk, initial_state=state, output_final_state=True,
                                            state_v_first=True),
            lambda: gla.recurrent_state_update(q, k, v, pool, slots, error, gk=gk, state_v_first=True))


def measure(fn, calls, repeats, sync=None):
    """(wall us, CPU us) per call: the best of `repeats` rounds of `calls` calls each (the least
    disturbed round; on a shared machine the median mostly measures the neighbours)."""
    for _ in range(max(50, calls // 10)):
        fn()
    if sync:
        sync()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        walls.append((time.perf_counter() - w) / calls * 1e6)
        cpus.append((time.process_time() - c) / calls * 1e6)
    return min(walls), min(cpus)


def gla_calls(device):
    """{row: (callable, calls divisor, grad mode)} of the gla rows on `device`: the divisor shortens
    the slow rows; grad mode False runs the whole loop under one torch.no_grad()."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, g = inputs(device, dtype)
    lq, lk, lv, lg = inputs(device, dtype, requires_grad=True)

    def step():
        o, _ = gla.chunk_gla(lq, lk, lv, lg)
        o.sum().backward()
    decode, update = decode_calls(decode_inputs(device, dtype))
    decode_grad, _ = decode_calls(decode_inputs(device, dtype, requires_grad=True))
    return {"forward, no_grad": (lambda: gla.chunk_gla(q, k, v, g), 1, False),
            "forward, requires_grad": (lambda: gla.chunk_gla(lq, lk, lv, lg), 1, True),
            "forward + backward": (step, 4, True),
            "recurrent decode, no_grad": (decode, 1, False),
            "recurrent decode, requires_grad": (decode_grad, 1, True),
            "pool update": (update, 1, True)}


def gla_rows(device, calls, repeats):
    sync = torch.cuda.synchronize if device == "cuda" else None
    rows = {}
    for name, (fn, div, grad) in gla_calls(device).items():
        with torch.set_grad_enabled(grad):
            rows[name] = measure(fn, max(1, calls // div), repeats, sync)
    return rows


def count_row(device, name, calls, toggle):
    """--row: only `name`, 50 warm-up calls then `calls` calls, no timing. `toggle`: the library
    built from bench/callgrind_toggle.c; under `valgrind --tool=callgrind --instr-atstart=no` it
    switches instrumentation on for the `calls` calls only, so the dump's total over `calls` is the
    instructions per call."""
    if name in ("C call (kernel): forward", "C call (kernel): backward"):
        fn, grad = c_calls()[name], False
    else:
        fn, _, grad = gla_calls(device)[name]
    lib = ctypes.CDLL(toggle) if toggle else None
    with torch.set_grad_enabled(grad):
        for _ in range(50):
            fn()
        if lib:
            lib.callgrind_start()
        for _ in range(calls):
            fn()
        if lib:
            lib.callgrind_stop()
    if device == "cuda":
        torch.cuda.synchronize()


def c_calls():
    """libgla alone on CPU: descriptors built once, gla_chunk_forward / gla_chunk_backward through
    ctypes."""
    lib = _lib.library()
    q, k, v, g = inputs("cpu", torch.float32)
    o, do = torch.empty_like(v), torch.rand_like(v)
    grads = [torch.empty_like(t) for t in (q, k, v, g)]
    keep = (q, k, v, g, o, do, grads)
    d = {n: _tensors.describe(n, t) for n, t in zip(("q", "k", "v", "g", "o", "do", "dq", "dk", "dv", "dg"),
                                                     (q, k, v, g, o, do, *grads))}
    p = {n: ctypes.pointer(x) for n, x in d.items()}
    opts = _lib.make_options(D ** -0.5, False, "", 0)
    fwd = _lib.ForwardArgs(p["q"], p["k"], p["v"], p["g"], None, None, None, p["o"], None)
    bwd = _lib.BackwardArgs(p["q"], p["k"], p["v"], p["g"], None, None, None, p["do"], None, p["dq"], p["dk"],
                            p["dv"], p["dg"], None)
    f, b, ro = ctypes.byref(fwd), ctypes.byref(bwd), ctypes.byref(opts)
    return {"C call (kernel): forward": lambda: (keep, lib.gla_chunk_forward(f, ro))[1],
            "C call (kernel): backward": lambda: (keep, lib.gla_chunk_backward(b, ro))[1]}


def c_call_rows(calls, repeats):
    fns = c_calls()
    rows = {"C call (kernel): forward": measure(fns["C call (kernel): forward"], calls, repeats),
            "C call (kernel): backward": measure(fns["C call (kernel): backward"], max(1, calls // 4), repeats)}
    rows.update(recurrent_c_call_rows(calls, repeats))
    return rows


def recurrent_c_call_rows(calls, repeats):
    """gla_recurrent_forward and gla_recurrent_state_update alone on the decode rows' problem."""
    lib = _recurrent_ctypes.library()
    q, k, v, gk, state, pool, slots, error = decode_inputs("cpu", torch.float32)
    o, final = torch.empty_like(v), torch.empty_like(state)
    fwd_ptrs = _recurrent_ctypes.pointers([("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", None),
                                           ("initial_state", state), ("cu_seqlens", None), ("cu_seqlens_host", None),
                                           ("o", o), ("final_state", final)])
    update_ptrs = _recurrent_ctypes.pointers([("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", None),
                                              ("state_pool", pool), ("state_slots", slots), ("slot_error", error),
                                              ("o", o), ("token_states", None)])
    fwd = _recurrent_ctypes.RecurrentForwardArgs(*fwd_ptrs, 0)
    update = _recurrent_ctypes.StateUpdateArgs(*update_ptrs, 0)
    opts = ctypes.byref(_lib.make_options(D ** -0.5, True, "", 0))
    f, u = ctypes.byref(fwd), ctypes.byref(update)
    return {"C call (kernel): recurrent decode": measure(lambda: lib.gla_recurrent_forward(f, opts), calls, repeats),
            "C call (kernel): pool update": measure(lambda: lib.gla_recurrent_state_update(u, opts), calls, repeats)}


def cuda_graph_rows(calls):
    """GPU time per call: the same forward / forward + backward / decode step / pool update captured
    `calls` times in a CUDA graph and replayed (no host work in the replay)."""
    q, k, v, g = inputs("cuda", torch.bfloat16)
    lq, lk, lv, lg = inputs("cuda", torch.bfloat16, requires_grad=True)
    decode, update = decode_calls(decode_inputs("cuda", torch.bfloat16))
    rows = {}
    for name, body in (("forward", lambda: gla.chunk_gla(q, k, v, g)),
                       ("forward + backward", lambda: torch.autograd.grad(gla.chunk_gla(lq, lk, lv, lg)[0].sum(),
                                                                          [lq, lk, lv, lg])),
                       ("recurrent decode", decode), ("pool update", update)):
        with torch.enable_grad() if name == "forward + backward" else torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            n = min(calls, 200)
            with torch.cuda.graph(graph):
                for _ in range(n):
                    body()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / n
        rows[f"GPU time (graph replay): {name}"] = (us, us)
    return rows


def fla_rows(calls, repeats):
    try:
        from fla.ops.gla import chunk_gla as fla_chunk_gla
    except Exception as e:  # noqa: BLE001 - any import failure means: no fla here
        return {}, f"fla not importable ({type(e).__name__}: {e})"
    sync = torch.cuda.synchronize
    q, k, v, g = inputs("cuda", torch.bfloat16)
    rows = {}
    with torch.no_grad():
        rows["fla forward, no_grad"] = measure(lambda: fla_chunk_gla(q, k, v, g), calls, repeats, sync)
    lq, lk, lv, lg = inputs("cuda", torch.bfloat16, requires_grad=True)
    rows["fla forward, requires_grad"] = measure(lambda: fla_chunk_gla(lq, lk, lv, lg), calls, repeats, sync)

    def step():
        o, _ = fla_chunk_gla(lq, lk, lv, lg)
        o.sum().backward()
    rows["fla forward + backward"] = measure(step, max(1, calls // 4), repeats, sync)
    try:
        from fla.ops.gla import fused_recurrent_gla as fla_recurrent
    except Exception as e:  # noqa: BLE001
        return rows, f"fla's fused_recurrent_gla not importable ({type(e).__name__}: {e})"
    q, k, v, gk, state, *_ = decode_inputs("cuda", torch.bfloat16)
    kw = {"state_v_first": True} if "state_v_first" in inspect.signature(fla_recurrent).parameters else {}
    with torch.no_grad():
        rows["fla recurrent decode, no_grad"] = measure(
            lambda: fla_recurrent(q, k, v, gk=gk, initial_state=state, output_final_state=True, **kw), calls, repeats,
            sync)
    return rows, ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--fallback", action="store_true", help="also time the ctypes fallback (child process)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (used for --fallback)")
    parser.add_argument("--row", help="only run this row (no timing; see count_row), e.g. 'forward, no_grad'")
    parser.add_argument("--callgrind-toggle", metavar="LIB", help="with --row: bench/callgrind_toggle.c built")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny problem: PyTorch's own thread pool only adds noise
    if args.row:
        count_row("cpu" if args.device == "all" else args.device, args.row, args.calls, args.callgrind_toggle)
        return

    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        devices.remove("cuda")
        if not args.json:
            print("no CUDA device: CUDA rows skipped")
    results = {}
    for device in devices:
        rows = gla_rows(device, args.calls, args.repeats)
        if device == "cpu":
            rows.update(c_call_rows(args.calls, args.repeats))
        else:
            rows.update(cuda_graph_rows(args.calls))
            fla, why = fla_rows(args.calls, args.repeats)
            rows.update(fla)
            if why and not args.json:
                print(why)
        results[device] = rows
    if args.json:
        print(json.dumps(results))
        return
    if args.fallback:
        env = dict(os.environ, GLA_NATIVE_OPS="0")
        out = subprocess.run([sys.executable, "-W", "ignore", __file__, "--json", "--device", args.device, "--calls",
                              str(args.calls), "--repeats", str(args.repeats)], env=env, capture_output=True,
                             text=True, check=True).stdout
        for device, rows in json.loads(out.strip().splitlines()[-1]).items():
            for name, value in rows.items():
                if not name.startswith(("C call", "GPU time", "fla")):
                    results[device][f"ctypes fallback: {name}"] = value

    print(f"gla {gla.version()} ({'native operators ' + _ops.native_path if _ops.native_path else 'ctypes fallback'})"
          f", torch {torch.__version__}, Python {sys.version.split()[0]}; B={B} T={T} H={H} K=V={D}, "
          f"{args.calls} calls x {args.repeats} repeats")
    for device, rows in results.items():
        print(f"\n{device} ({'float32' if device == 'cpu' else 'bfloat16'}):")
        print(f"  {'':50s} {'wall us/call':>13s} {'CPU us/call':>12s}")
        for name, (wall, cpu) in rows.items():
            print(f"  {name:50s} {wall:13.1f} {cpu:12.1f}")


if __name__ == "__main__":
    main()
