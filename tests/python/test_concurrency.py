"""16 Python threads at once through the public API: gla.chunk_gla forward and backward under
different shapes, backends (the `torch` callback backend included) and policies, gla.explain and
gla.backends(); every result bitwise equal to the same call made serially first. (The C++ side,
with registry churn and under ThreadSanitizer: tests/cpp/test_concurrency.cpp.)"""
import threading

import torch

import gla
from oracle import make_inputs

BACKENDS = ("torch", "cpu", "reference", "")
POLICIES = ("priority", "fastest", "default")


def _jobs():
    jobs = []
    for i in range(8):
        kw = dict(B=1 + i % 2, T=20 + 37 * i, H=1 + i % 3, K=8 + 8 * (i % 3), V=4 + 4 * (i % 2),
                  per_head_gate=i % 4 == 3, seed=500 + i)
        if i == 5:
            kw.update(B=1, cu_seqlens=[0, 7, 7, 90, kw["T"]])
        jobs.append((make_inputs(**kw), BACKENDS[i % 4], POLICIES[i % 3]))
    return jobs


def _run(x, backend, policy):
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "initial_state")]
    with gla.backend(backend), gla.policy(policy):
        o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                              cu_seqlens=x["cu_seqlens"])
        grads = torch.autograd.grad([o, ht], leaves, [x["do"], x["dht"]])
        text = gla.explain(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"],
                           output_final_state=True, cu_seqlens=x["cu_seqlens"])
    decision = next(line for line in text.splitlines() if line.startswith("decision: "))
    return [o.detach(), ht.detach(), *grads], decision


def test_sixteen_threads_equal_serial():
    jobs = _jobs()
    serial = [_run(*job) for job in jobs]
    names = [b.name for b in gla.backends()]
    failures = []
    stop = threading.Event()

    def operators(t):
        try:
            for r in range(2):
                for j in range(len(jobs)):
                    i = (j + t) % len(jobs)
                    tensors, decision = _run(*jobs[i])
                    want, want_decision = serial[i]
                    if decision != want_decision:
                        failures.append(f"job {i}: decision {decision!r}, serially {want_decision!r}")
                    for a, b in zip(tensors, want):
                        if not torch.equal(a, b):
                            failures.append(f"job {i} ({jobs[i][1] or 'default'}, {jobs[i][2]}): differs from serial")
                            break
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"thread {t}: {type(e).__name__}: {e}")

    def listing():
        while not stop.is_set():
            if [b.name for b in gla.backends()] != names:
                failures.append("gla.backends() changed while listing")

    threads = [threading.Thread(target=operators, args=(t,)) for t in range(15)]
    threads.append(threading.Thread(target=listing))
    for th in threads:
        th.start()
    for th in threads[:15]:
        th.join()
    stop.set()
    threads[15].join()
    assert not failures, "\n".join(failures[:10])
