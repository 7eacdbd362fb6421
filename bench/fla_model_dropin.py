#!/usr/bin/env python3
"""libgla inside fla's own model: fla's GLAForCausalLM run twice with the same weights and data,
once on fla's kernels and once with gla.chunk_gla / gla.fused_recurrent_gla put in their place
inside fla.layers.gla (the two names that module imports from fla.ops.gla). Everything else (the
projections, norms, MLP, fused cross-entropy, transformers' generate) is fla's code in both runs.

Per configuration (default: hidden 1024 / 8 heads and hidden 2048 / 4 heads, 4 layers, vocabulary
32000, B8 T2048, bf16 weights and activations):

1. gradients: one forward + backward on the same batch with each kernel set, and once more with
   fla's kernels on an fp32 copy of the model (TF32 off) as the reference. Per parameter group
   (the layer index folded): the max relative error ‖a − b‖/‖b‖ of libgla against fla, and of
   each against the fp32 reference; "within bf16 noise" = libgla's error against fp32 is at most
   1.5x fla's own (+1e-3). The fp32 model also runs on libgla's kernels (its backward on the
   `torch` backend, which serves fp32): where the two fp32 runs part, the kernel sets differ beyond
   rounding, and --layer-grads says which one is off.
2. training: 50 AdamW steps from the same initial weights on the same batches (a synthetic sparse
   Markov language, learnable, generated here); the two loss curves, their largest gap, and the
   median step time (forward + backward + optimizer, CUDA-synchronised) of each.
3. greedy generate (transformers' generate through fla's cache): both runs from the fla-trained
   weights, a 256-token prompt (chunked prefill), 64 new tokens (recurrent decoding); token
   agreement, and where a sequence first differs, fla's logit margin there (a near-tie or not).
4. decoding throughput at batch 64: generate 128 new tokens after a 128-token prompt, minus the
   time of a 1-token generate (the prefill), in tokens/s; and the host time of the substituted
   fused_recurrent_gla calls during one such generate (their mean and share of its wall time).

fla comes from its wheels, not a dependency of libgla. The GPU machine has transformers (5.17.0,
within flash-linear-attention's transformers<6,>=5.6.2) but no network: download the rest once where
there is one and carry the folder (1.5 MB):
    pip download flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 --no-deps \
        --only-binary=:all: -d .whl-fla
then on the GPU machine (repository root, libgla built with CUDA in build-cuda/):
    pip install -q --no-index --no-deps --target /tmp/site_fla .whl-fla/*.whl   (PYTHONPATH=/tmp/site_fla)
    python3 bench/fla_model_dropin.py --lib build-cuda/libgla.so --out "$OUT"   [--quick]
Writes fla_model_dropin_<configs>.json and ..._loss.png into --out (default $OUT, else
bench/results/) and prints a summary table. --quick: T512, 10 steps, short generations. --decode-only:
step 4 alone on fla's initial weights, with each kernel set's recurrent call timed in the model, alone,
and behind queued GPU work (a hidden synchronisation shows as the queue's time)
(fla_model_dropin_decode_<configs>.json). --layer-grads: every
layer's chunk_gla call captured inside the model on each kernel set; its in-model gradients against
the cpu backend (fp32) and against the same kernel called alone on the same tensors, and the two
runs' inputs against each other (fla_model_dropin_layer_grads_<configs>.json). --grads-only: step 1
alone (fla_model_dropin_grads_<configs>.json). --profile-step: training steps of each kernel set under
torch.profiler, GPU busy time against wall time and the kernels by GPU time
(fla_model_dropin_profile_<configs>.json).
--configs 1024x8 and --configs 2048x4 in two calls keep each call short (each is a same-run
comparison of the two kernel sets on its own).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", help="libgla.so to use (sets GLA_LIBRARY)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results"))
    p.add_argument("--configs", default="1024x8,2048x4", help="hidden x heads, comma separated")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-rounds", type=int, default=4, help="decode-rate rounds per kernel set (--decode-only)")
    p.add_argument("--quick", action="store_true", help="T512, 10 steps, short generations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fla-tune-ms", metavar="WARMUP,REP",
                   help="time Triton's autotune candidates for WARMUP,REP ms instead of 25,100 (fla's first calls "
                        "otherwise take minutes per shape on the GPU machine)")
    p.add_argument("--decode-only", action="store_true",
                   help="only step 4 (decoding throughput and the recurrent calls' host time), on fla's initial "
                        "weights: a short call for the decode ratio alone")
    p.add_argument("--layer-grads", action="store_true",
                   help="only capture every layer's chunk_gla call inside the bf16 model (one batch), once per kernel "
                        "set, and compare its in-model gradients with the cpu backend's (fp32) and with the same "
                        "kernel called alone on those exact tensors")
    p.add_argument("--profile-step", action="store_true",
                   help="only profile training steps on each kernel set (torch.profiler): GPU busy time per "
                        "step against wall time, and the kernels that take the most GPU time")
    p.add_argument("--grads-only", action="store_true",
                   help="only step 1 (gradients of both kernel sets and the fp32 references on one batch)")
    p.add_argument("--plot-only", metavar="JSON", help="only redraw the PNG from a saved JSON (no GPU, no fla)")
    args = p.parse_args()
    if args.quick:
        args.seq_len, args.steps = 512, 10
    return args


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for name, style in (("fla", "-"), ("libgla", "--")):
            ax.plot(r["train"][name]["loss"], style, label=f"{name} kernels ({r['train'][name]['median_step_ms']:.0f} ms/step)")
        ax.set(title=f"fla GLAForCausalLM, hidden {r['hidden']}, {r['heads']} heads, {r['layers']} layers "
                     f"(max gap {r['max_loss_gap']:.3f})", xlabel="step", ylabel="loss")
        ax.title.set_fontsize(9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


ARGS = parse_args()
if ARGS.plot_only:  # matplotlib may be missing on the GPU machine: draw the curves from the JSON later
    with open(ARGS.plot_only) as f:
        plot(json.load(f)["results"], os.path.splitext(ARGS.plot_only)[0] + "_loss.png")
    sys.exit(0)
if ARGS.lib:
    os.environ["GLA_LIBRARY"] = os.path.abspath(ARGS.lib)
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import gla  # noqa: E402

if ARGS.fla_tune_ms:
    sys.path.insert(0, os.path.join(ROOT, "bench", "cuda"))
    import triton_autotune_cache  # noqa: E402

    triton_autotune_cache.shorten_autotune(ARGS.fla_tune_ms)

try:
    import fla.layers.gla as fla_gla_layer  # noqa: E402
    from fla.models import GLAConfig, GLAForCausalLM  # noqa: E402
except ImportError as error:
    sys.exit(f"fla is not installed ({error}); see this script's docstring for the wheels")

VOCAB = 32000


@contextlib.contextmanager
def kernels(name: str):
    """Inside: fla.layers.gla calls libgla ("libgla") or its own kernels ("fla")."""
    saved = fla_gla_layer.chunk_gla, fla_gla_layer.fused_recurrent_gla
    if name == "libgla":
        fla_gla_layer.chunk_gla, fla_gla_layer.fused_recurrent_gla = gla.chunk_gla, gla.fused_recurrent_gla
    try:
        yield
    finally:
        fla_gla_layer.chunk_gla, fla_gla_layer.fused_recurrent_gla = saved


def markov_batches(count, batch, seq_len, seed):
    """A sparse random first-order Markov language over VOCAB tokens (each token has 4 successors):
    learnable, so a few steps lower the loss well below ln(32000) = 10.37."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    rows = count * batch
    seq = torch.empty(rows, seq_len, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
    choice = torch.randint(0, 4, (rows, seq_len), generator=gen)
    for t in range(1, seq_len):
        seq[:, t] = successors[seq[:, t - 1], choice[:, t]]
    return list(seq.view(count, batch, seq_len))


def build(hidden, heads, layers, dtype, state=None):
    config = GLAConfig(hidden_size=hidden, num_heads=heads, num_hidden_layers=layers, vocab_size=VOCAB,
                       use_cache=True)
    torch.manual_seed(ARGS.seed)
    with torch.device("cuda"):
        model = GLAForCausalLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype=dtype)


def grads_of(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def group_of(name):
    return re.sub(r"\.\d+\.", ".*.", name)


def compare_grads(hidden, heads, init_state, batch):
    ref_model = build(hidden, heads, ARGS.layers, torch.float32, init_state)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with kernels("fla"):
        ref_loss, ref = grads_of(ref_model, batch)
    # the same fp32 model on libgla's kernels: the fp32 reference above is fla's kernels, so it
    # agrees with fla's bf16 run even where fla's kernels are wrong; two fp32 runs that part show
    # the kernel sets differ in (near) exact arithmetic
    with kernels("libgla"):
        ref_loss_libgla, ref_libgla = grads_of(ref_model, batch)
    del ref_model
    torch.cuda.empty_cache()
    out = {"loss_fp32": ref_loss, "loss_fp32_libgla": ref_loss_libgla}
    grads = {}
    for name in ("fla", "libgla"):
        model = build(hidden, heads, ARGS.layers, torch.bfloat16, init_state)
        with kernels(name):
            out[f"loss_{name}"], grads[name] = grads_of(model, batch)
        del model
        torch.cuda.empty_cache()
    groups = {}
    for n in ref:
        g = groups.setdefault(group_of(n), {"libgla_vs_fla": 0.0, "libgla_vs_fp32": 0.0, "fla_vs_fp32": 0.0,
                                            "fp32_libgla_vs_fp32": 0.0, "libgla_vs_fp32_libgla": 0.0})
        g["libgla_vs_fla"] = max(g["libgla_vs_fla"], rel(grads["libgla"][n], grads["fla"][n]))
        g["fp32_libgla_vs_fp32"] = max(g["fp32_libgla_vs_fp32"], rel(ref_libgla[n], ref[n]))
        g["libgla_vs_fp32_libgla"] = max(g["libgla_vs_fp32_libgla"], rel(grads["libgla"][n], ref_libgla[n]))
        g["libgla_vs_fp32"] = max(g["libgla_vs_fp32"], rel(grads["libgla"][n], ref[n]))
        g["fla_vs_fp32"] = max(g["fla_vs_fp32"], rel(grads["fla"][n], ref[n]))
    out["groups"] = groups
    out["within_bf16_noise"] = all(g["libgla_vs_fp32"] <= 1.5 * g["fla_vs_fp32"] + 1e-3 for g in groups.values())
    out["loss_within_bf16_noise"] = abs(out["loss_libgla"] - ref_loss) <= 1.5 * abs(out["loss_fla"] - ref_loss) + 1e-2
    return out


def train(name, hidden, heads, init_state, batches):
    model = build(hidden, heads, ARGS.layers, torch.bfloat16, init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=ARGS.lr, weight_decay=0.01)
    losses, times = [], []
    with kernels(name):
        for batch in batches:
            batch = batch.cuda()
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    del model, opt
    torch.cuda.empty_cache()
    warm = times[min(5, len(times) - 1):]  # the first steps include fla's autotune and libgla's plan cache
    return {"loss": losses, "step_ms": [t * 1e3 for t in times], "median_step_ms": statistics.median(warm) * 1e3}, state


@torch.no_grad()
def generate(model, prompt, new_tokens):
    return model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          use_cache=True, pad_token_id=0)[:, prompt.shape[1]:]


def decode_rate(model, name, batch, prompt_len, new_tokens):
    gen = torch.Generator().manual_seed(ARGS.seed + 7)
    prompt = torch.randint(0, VOCAB, (batch, prompt_len), generator=gen).cuda()
    with kernels(name):
        generate(model, prompt, 2)  # warm-up (autotune, plan cache)
        timings = {}
        for n in (1, new_tokens):
            best = math.inf
            for _ in range(2):
                torch.cuda.synchronize()
                start = time.perf_counter()
                generate(model, prompt, n)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            timings[n] = best
    return batch * (new_tokens - 1) / (timings[new_tokens] - timings[1])


def recurrent_host_time(model, name, batch, prompt_len, new_tokens):
    """The decode step's recurrent attention calls, timed on the host: the substituted
    fused_recurrent_gla wrapped in a perf_counter timer during one generate (decoding is host-bound
    at these sizes, so a call's wall time is what it costs the step). Returns the calls, their mean
    time in microseconds, and their share of the generate's wall time."""
    gen = torch.Generator().manual_seed(ARGS.seed + 7)
    prompt = torch.randint(0, VOCAB, (batch, prompt_len), generator=gen).cuda()
    with kernels(name):
        inner, spent, first = fla_gla_layer.fused_recurrent_gla, [], []

        def timed(*args, **kwargs):
            if not first:
                first.append((args, kwargs))
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)
        fla_gla_layer.fused_recurrent_gla = timed
        generate(model, prompt, 2)
        spent.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(model, prompt, new_tokens)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        # the first call's arguments again, alone: its host time outside the model
        args, kwargs = first[0]
        with torch.no_grad():
            for _ in range(10):
                inner(*args, **kwargs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(100):
                inner(*args, **kwargs)
            alone = (time.perf_counter() - start) / 100
            torch.cuda.synchronize()
            # behind ~2 ms of GPU work: a call that waits for the device (a hidden synchronisation)
            # takes the rest of the sleep on the host, one that only queues takes its usual time
            # with a fresh cu_seqlens each time, as each decode step has (libgla copies a new
            # device cu_seqlens to the host once: the first layer's call of a step waits)
            behind, behind_fresh = [], []
            for _ in range(5):
                torch.cuda._sleep(4_000_000)
                start = time.perf_counter()
                inner(*args, **kwargs)
                behind.append(time.perf_counter() - start)
                torch.cuda.synchronize()
            fresh = dict(kwargs)
            for _ in range(5 if torch.is_tensor(kwargs.get("cu_seqlens")) else 0):
                torch.cuda._sleep(4_000_000)
                fresh["cu_seqlens"] = kwargs["cu_seqlens"].clone()
                start = time.perf_counter()
                inner(*args, **fresh)
                behind_fresh.append(time.perf_counter() - start)
                torch.cuda.synchronize()
    layers = ARGS.layers
    by_layer = [1e6 * statistics.median(spent[i::layers]) for i in range(layers)] if len(spent) >= layers else []
    out = {"calls": len(spent), "mean_us": 1e6 * sum(spent) / max(1, len(spent)), "share": sum(spent) / total,
           "median_us_by_layer": by_layer,
           "alone_us": 1e6 * alone, "behind_gpu_work_us": 1e6 * statistics.median(behind),
           "behind_gpu_work_fresh_cu_seqlens_us": 1e6 * statistics.median(behind_fresh) if behind_fresh else None,
           "arguments": {k: (list(v.shape), str(v.dtype), list(v.stride())) if torch.is_tensor(v) else v
                         for k, v in kwargs.items()}}
    if name == "libgla":
        text = gla.explain_recurrent(**{k: v for k, v in kwargs.items() if k != "scale"})
        out["decision"] = [line for line in text.splitlines() if line.startswith(("decision", "plan"))]
    return out


def margin_at_difference(model, prompt, tokens, seq, index):
    """Where greedy decoding first differs: with fla's kernels, the gap between the largest and the
    second-largest logit at that step, and between the largest and libgla's token's (a near-tie
    flipped by bf16 rounding shows a gap of the size of bf16's spacing there)."""
    ids = torch.cat([prompt[seq], torch.tensor(tokens["fla"][seq][:index], dtype=prompt.dtype, device=prompt.device)])[None]
    with torch.no_grad(), kernels("fla"):
        logits = model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return {"top1_minus_top2": float(top[0] - top[1]),
            "top1_minus_libgla_token": float(top[0] - logits[tokens["libgla"][seq][index]]),
            "top1": float(top[0])}


def nn_layer_check(hidden, heads, init_state):
    """gla.nn.GatedLinearAttention loaded with the weights of the model's first fla layer: its
    output (libgla kernels) against fla's layer (fla's kernels) on the same bf16 input."""
    from gla.nn import GatedLinearAttention

    model = build(hidden, heads, 1, torch.bfloat16, {k: v for k, v in init_state.items()
                                                     if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
    theirs = model.model.layers[0].attn
    ours = GatedLinearAttention(hidden_size=hidden, num_heads=heads).cuda().bfloat16()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(ARGS.batch, ARGS.seq_len, hidden, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator("cuda").manual_seed(3))
    with torch.no_grad(), kernels("fla"):
        expected = theirs(x)[0].float()
        torch.backends.cuda.matmul.allow_tf32 = False
        exact_out = copy.deepcopy(theirs).float()(x.float())[0]  # fla's layer and kernels in fp32
        got = ours(x).float()
    del model
    return {"gla_nn_vs_fla_layer": rel(got, expected), "fla_layer_vs_fp32": rel(expected, exact_out),
            "gla_nn_vs_fp32": rel(got, exact_out)}


def run_config(hidden, heads, batches):
    print(f"\n=== hidden {hidden}, {heads} heads, {ARGS.layers} layers, B{ARGS.batch} T{ARGS.seq_len} bf16 ===",
          flush=True)
    init = {k: v.cpu() for k, v in build(hidden, heads, ARGS.layers, torch.float32).state_dict().items()}
    result = {"hidden": hidden, "heads": heads, "layers": ARGS.layers, "batch": ARGS.batch, "seq_len": ARGS.seq_len}

    # which libgla backends serve the layer's calls at this shape
    K, V = hidden // 2 // heads, hidden // heads
    q = torch.randn(ARGS.batch, ARGS.seq_len, heads, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(ARGS.batch, ARGS.seq_len, heads, V, device="cuda", dtype=torch.bfloat16)
    for what, backward in (("forward", False), ("backward", True)):
        text = gla.explain(q, q, v, q, state_v_first=True, backward=backward)
        result[f"libgla_{what}"] = [line for line in text.splitlines() if line.startswith("decision")]
        print(f"libgla {what}: {'; '.join(result[f'libgla_{what}'])}")
    del q, v

    result["nn_layer"] = nn_layer_check(hidden, heads, init)
    e = result["nn_layer"]
    print(f"gla.nn.GatedLinearAttention with fla's layer-0 weights: rel {e['gla_nn_vs_fla_layer']:.2e} to fla's "
          f"layer; to an fp32 run {e['gla_nn_vs_fp32']:.2e} (fla's layer: {e['fla_layer_vs_fp32']:.2e})", flush=True)
    result["grads"] = compare_grads(hidden, heads, init, batches[0].cuda())
    g = result["grads"]
    print(f"loss: fp32 {g['loss_fp32']:.5f} (libgla's kernels: {g['loss_fp32_libgla']:.5f})  fla {g['loss_fla']:.5f}  "
          f"libgla {g['loss_libgla']:.5f}")
    print(f"{'parameter group':44s} {'libgla/fla':>11s} {'libgla/fp32':>11s} {'fla/fp32':>11s} "
          f"{'fp32 l/f':>11s} {'libgla/fp32l':>12s}")
    for name, e in g["groups"].items():
        print(f"{name:44s} {e['libgla_vs_fla']:11.2e} {e['libgla_vs_fp32']:11.2e} {e['fla_vs_fp32']:11.2e} "
              f"{e['fp32_libgla_vs_fp32']:11.2e} {e['libgla_vs_fp32_libgla']:12.2e}")
    print("(fp32 l/f: the fp32 model's gradients on libgla's kernels against fla's; libgla/fp32l: libgla's bf16 run "
          "against that libgla fp32 run)")
    print(f"gradients within bf16 noise: {g['within_bf16_noise']}", flush=True)

    runs, states = {}, {}
    for name in ("fla", "libgla"):
        runs[name], states[name] = train(name, hidden, heads, init, batches)
        print(f"train {name}: loss {runs[name]['loss'][0]:.4f} -> {runs[name]['loss'][-1]:.4f}, "
              f"median step {runs[name]['median_step_ms']:.1f} ms", flush=True)
    result["train"] = runs
    result["max_loss_gap"] = max(abs(a - b) for a, b in zip(runs["fla"]["loss"], runs["libgla"]["loss"]))
    result["train_speedup"] = runs["fla"]["median_step_ms"] / runs["libgla"]["median_step_ms"]

    model = build(hidden, heads, ARGS.layers, torch.bfloat16, states["fla"]).eval()
    prompt = batches[-1][:4, :256 if not ARGS.quick else 128].cuda()
    new = 16 if ARGS.quick else 64
    tokens = {}
    for name in ("fla", "libgla"):
        with kernels(name):
            tokens[name] = generate(model, prompt, new)
    agree = (tokens["fla"] == tokens["libgla"]).float().mean().item()
    differs = (tokens["fla"] != tokens["libgla"]).any(0).nonzero()
    result["generate"] = {"agreement": agree, "first_difference": int(differs[0]) if len(differs) else None,
                          "fla": tokens["fla"].tolist(), "libgla": tokens["libgla"].tolist()}
    print(f"greedy generate: {agree * 100:.1f}% of {tokens['fla'].numel()} tokens agree", flush=True)
    rows = (tokens["fla"] != tokens["libgla"]).any(1).nonzero().flatten().tolist()
    margins = []
    for seq in rows:
        index = int((tokens["fla"][seq] != tokens["libgla"][seq]).nonzero()[0])
        m = margin_at_difference(model, prompt, {k: v.tolist() for k, v in tokens.items()}, seq, index)
        margins.append({"sequence": seq, "token": index, **m})
        print(f"  sequence {seq} first differs at token {index}: fla's logits there, top-1 minus top-2 "
              f"{m['top1_minus_top2']:.4f}, minus libgla's token {m['top1_minus_libgla_token']:.4f} "
              f"(top-1 {m['top1']:.2f})", flush=True)
    result["generate"]["margins_at_first_difference"] = margins

    decode_new = 16 if ARGS.quick else 128
    result["decode_tokens_per_s"] = {name: decode_rate(model, name, ARGS.decode_batch, 128, decode_new)
                                     for name in ("fla", "libgla")}
    r = result["decode_tokens_per_s"]
    result["decode_speedup"] = r["libgla"] / r["fla"]
    print(f"decode at batch {ARGS.decode_batch}: fla {r['fla']:.0f} tok/s, libgla {r['libgla']:.0f} tok/s", flush=True)
    result["decode_recurrent_host"] = {name: recurrent_host_time(model, name, ARGS.decode_batch, 128, decode_new)
                                       for name in ("fla", "libgla")}
    for name, h in result["decode_recurrent_host"].items():
        print(f"  {name} fused_recurrent_gla: {h['calls']} calls, {h['mean_us']:.1f} us each on the host, "
              f"{h['share'] * 100:.1f}% of the generate's wall time", flush=True)
    del model
    torch.cuda.empty_cache()
    return result


def run_decode(hidden, heads):
    """Step 4 alone, on fla's initial weights (the decode rate does not depend on them): both kernel
    sets timed in turn, --decode-rounds rounds, the median rate of each kept (and every round's printed)."""
    print(f"\n=== decode only: hidden {hidden}, {heads} heads, {ARGS.layers} layers, batch {ARGS.decode_batch} ===",
          flush=True)
    model = build(hidden, heads, ARGS.layers, torch.bfloat16).eval()
    new = 16 if ARGS.quick else 128
    rounds = {"fla": [], "libgla": []}
    for _ in range(ARGS.decode_rounds):  # the kernel sets in turn: drift of the machine weighs on both alike
        for name in rounds:
            rounds[name].append(decode_rate(model, name, ARGS.decode_batch, 128, new))
    rates = {name: statistics.median(r) for name, r in rounds.items()}
    print("  rates by round: " + "; ".join(f"{n} " + " ".join(f"{x:.0f}" for x in r) for n, r in rounds.items()))
    host = {name: recurrent_host_time(model, name, ARGS.decode_batch, 128, new) for name in rates}
    del model
    torch.cuda.empty_cache()
    print(f"decode at batch {ARGS.decode_batch}: fla {rates['fla']:.0f} tok/s, libgla {rates['libgla']:.0f} tok/s "
          f"({rates['libgla'] / rates['fla']:.2f}x)")
    for name, h in host.items():
        print(f"  {name} fused_recurrent_gla: {h['calls']} calls, {h['mean_us']:.1f} us each on the host, "
              f"{h['share'] * 100:.1f}% of the generate's wall time; the first call's arguments alone "
              f"{h['alone_us']:.1f} us, behind ~2 ms of queued GPU work {h['behind_gpu_work_us']:.1f} us "
              f"(with a fresh cu_seqlens {h['behind_gpu_work_fresh_cu_seqlens_us'] or float('nan'):.1f} us); "
              f"median by layer {' '.join(f'{x:.0f}' for x in h['median_us_by_layer'])} us "
              f"{h.get('decision', '')}", flush=True)
    print(f"  arguments of the first call: {host['libgla']['arguments']}", flush=True)
    return {"hidden": hidden, "heads": heads, "layers": ARGS.layers, "decode_tokens_per_s": rates,
            "decode_tokens_per_s_rounds": rounds,
            "decode_speedup": rates["libgla"] / rates["fla"], "decode_recurrent_host": host}


def captured_layer_calls(model, batch, name):
    """The chunk_gla calls of one forward + backward of the model on kernel set `name`: each call's
    inputs, keyword arguments, the gradient that reached its o and the gradients it gave its inputs."""
    calls, real = [], (gla.chunk_gla if name == "libgla" else fla_gla_layer.chunk_gla)

    def capturing(q, k, v, g, **kwargs):
        o, ht = real(q, k, v, g, **kwargs)
        call = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(), "g": g.detach().clone(),
                "kwargs": kwargs}
        o.register_hook(lambda grad: call.__setitem__("do", grad.detach().clone()))
        for n, x in (("q", q), ("k", k), ("v", v), ("g", g)):
            x.register_hook(lambda grad, n=n: call.__setitem__("d" + n, grad.detach().clone()))
        calls.append(call)
        return o, ht

    with kernels(name):
        fla_gla_layer.chunk_gla = capturing
        model.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    return calls


def layer_gradients(fn, call, dtype=None, device="cuda"):
    xs = [call[n].to(device=device, dtype=dtype or call[n].dtype).requires_grad_() for n in ("q", "k", "v", "g")]
    kwargs = {n: a for n, a in call["kwargs"].items() if n in ("initial_state", "output_final_state", "state_v_first")}
    kwargs["output_final_state"] = False
    o, _ = fn(*xs, **kwargs)
    return [o.detach()] + list(torch.autograd.grad(o, xs, call["do"].to(device=device, dtype=o.dtype)))


GRAD_NAMES = ("dq", "dk", "dv", "dg")


def run_layer_grads(hidden, heads, batch):
    """Every layer's chunk_gla call inside the model, captured once on fla's kernels and once on
    libgla's (fla's initial weights): per call, the gradients the model's backward got from the
    kernel against the cpu backend (fp32) on the same tensors, the same kernel called alone on them,
    and how far the libgla run's inputs and incoming gradient are from the fla run's."""
    print(f"\n=== layer gradients inside the model: hidden {hidden}, {heads} heads ===", flush=True)
    captured = {}
    for name in ("fla", "libgla"):
        model = build(hidden, heads, ARGS.layers, torch.bfloat16)
        captured[name] = captured_layer_calls(model, batch, name)
        del model
        torch.cuda.empty_cache()
    out = []
    for index in range(len(captured["fla"])):
        row = {"layer": index}
        for name, fn in (("fla", fla_gla_layer.chunk_gla), ("libgla", gla.chunk_gla)):
            call = captured[name][index]
            if call["kwargs"].get("initial_state") is not None or call["kwargs"].get("cu_seqlens") is not None:
                sys.exit("the captured call has an initial state or cu_seqlens: this check does not cover it")
            with gla.backend("cpu"):
                ref = layer_gradients(gla.chunk_gla, call, torch.float32, "cpu")
            alone = layer_gradients(fn, call)
            in_model = [call[n] for n in GRAD_NAMES]
            o_rows = (alone[0].float().cpu() - ref[0]).pow(2).sum(-1).sqrt() / ref[0].pow(2).sum(-1).sqrt().clamp_min(1e-30)
            row[name] = {
                # the first tokens' rows (one to sixteen terms each) show errors the whole-tensor figure hides
                "o_worst_row_first_16_tokens": o_rows[:, :16].max().item(),
                "in_model_vs_cpu": {n: rel(a.float().cpu(), b) for n, a, b in zip(GRAD_NAMES, in_model, ref[1:])},
                "alone_vs_cpu": {n: rel(a.float().cpu(), b) for n, a, b in zip(("o",) + GRAD_NAMES, alone, ref)},
                "in_model_vs_alone": {n: rel(a.float(), b.float()) for n, a, b in zip(GRAD_NAMES, in_model, alone[1:])},
            }
            print(f"layer {index} {name:6s} in the model vs cpu: "
                  + "  ".join(f"{n} {e:.2e}" for n, e in row[name]["in_model_vs_cpu"].items())
                  + " | alone vs cpu: " + "  ".join(f"{n} {e:.2e}" for n, e in row[name]["alone_vs_cpu"].items())
                  + " | in the model vs alone: "
                  + "  ".join(f"{n} {e:.2e}" for n, e in row[name]["in_model_vs_alone"].items())
                  + f" | o's worst row in the first 16 tokens {row[name]['o_worst_row_first_16_tokens']:.2e}", flush=True)
        row["libgla_run_vs_fla_run"] = {n: rel(captured["libgla"][index][n].float(), captured["fla"][index][n].float())
                                        for n in ("q", "k", "v", "g", "do") + GRAD_NAMES}
        print(f"layer {index} libgla run vs fla run: "
              + "  ".join(f"{n} {e:.2e}" for n, e in row["libgla_run_vs_fla_run"].items()), flush=True)
        out.append(row)
    return {"hidden": hidden, "heads": heads, "calls": len(captured["fla"]), "layers": out}


def main_layer_grads():
    batch = markov_batches(1, ARGS.batch, ARGS.seq_len, ARGS.seed)[0].cuda()
    results = [run_layer_grads(*(int(x) for x in spec.split("x")), batch) for spec in ARGS.configs.split(",")]
    stem = os.path.join(ARGS.out, "fla_model_dropin_layer_grads_" + ARGS.configs.replace(",", "_"))
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(ARGS), "results": results}, f, indent=1)
    print(f"\nwrote {stem}.json")


def main_grads_only():
    batch = markov_batches(1, ARGS.batch, ARGS.seq_len, ARGS.seed)[0].cuda()
    results = []
    for spec in ARGS.configs.split(","):
        hidden, heads = (int(x) for x in spec.split("x"))
        g = compare_grads(hidden, heads, None, batch)
        results.append({"hidden": hidden, "heads": heads, "grads": g})
        print(f"\n=== gradients: hidden {hidden}, {heads} heads === within bf16 noise: {g['within_bf16_noise']}")
        print("| group | libgla vs fla | libgla vs fp32 | fla vs fp32 | fp32 on libgla vs fp32 |\n|---|---|---|---|---|")
        for n, x in g["groups"].items():
            print(f"| {n} | {x['libgla_vs_fla']:.2e} | {x['libgla_vs_fp32']:.2e} | {x['fla_vs_fp32']:.2e} "
                  f"| {x['fp32_libgla_vs_fp32']:.2e} |")
    stem = os.path.join(ARGS.out, "fla_model_dropin_grads_" + ARGS.configs.replace(",", "_"))
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(ARGS), "results": results}, f, indent=1)
    print(f"\nwrote {stem}.json")


def profile_step(name, hidden, heads, batches):
    """Training steps of one kernel set under torch.profiler: per step, the wall time, the GPU time
    summed over kernels (and memcpy/memset), and the kernels ranked by total GPU time."""
    from torch.profiler import ProfilerActivity, profile
    model = build(hidden, heads, ARGS.layers, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=ARGS.lr, weight_decay=0.01)

    def step(batch):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    profiled = 3
    with kernels(name):
        for batch in batches[:5]:
            step(batch.cuda())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for batch in batches[5:5 + profiled]:
                step(batch.cuda())
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / profiled
    per_kernel = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = per_kernel.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    busy = sum(t for _, t in per_kernel.values()) / profiled / 1e3
    print(f"\n--- {name}: hidden {hidden}, {heads} heads: wall {wall * 1e3:.1f} ms/step, GPU kernels {busy:.1f} ms/step")
    print(f"{'ms/step':>8} {'calls':>6}  kernel")
    for kname, (count, total) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{total / profiled / 1e3:8.3f} {count // profiled:6d}  {kname[:110]}")
    del model, opt
    torch.cuda.empty_cache()
    return {"wall_ms": wall * 1e3, "gpu_ms": busy,
            "kernels": {k: [c // profiled, t / profiled / 1e3] for k, (c, t) in per_kernel.items()}}


def main_profile_step():
    batches = markov_batches(8, ARGS.batch, ARGS.seq_len, ARGS.seed)
    results = []
    for spec in ARGS.configs.split(","):
        hidden, heads = (int(x) for x in spec.split("x"))
        results.append({"hidden": hidden, "heads": heads,
                        **{name: profile_step(name, hidden, heads, batches) for name in ("fla", "libgla")}})
    stem = os.path.join(ARGS.out, "fla_model_dropin_profile_" + ARGS.configs.replace(",", "_"))
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(ARGS), "results": results}, f, indent=1)
    print(f"\nwrote {stem}.json")


def main_decode_only():
    results = [run_decode(*(int(x) for x in spec.split("x"))) for spec in ARGS.configs.split(",")]
    stem = os.path.join(ARGS.out, "fla_model_dropin_decode_" + ARGS.configs.replace(",", "_"))
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(ARGS), "results": results}, f, indent=1)
    print("\n| config | decode tok/s fla / libgla | speedup | recurrent call host time fla / libgla |")
    print("|---|---|---|---|")
    for r in results:
        d, h = r["decode_tokens_per_s"], r["decode_recurrent_host"]
        print(f"| {r['hidden']}/{r['heads']}h/{r['layers']}L | {d['fla']:.0f} / {d['libgla']:.0f} | "
              f"{r['decode_speedup']:.2f}x | {h['fla']['mean_us']:.0f} / {h['libgla']['mean_us']:.0f} us |")
    print(f"\nwrote {stem}.json")


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if not hasattr(gla, "fused_recurrent_gla"):
        sys.exit("this gla has no gla.fused_recurrent_gla")
    os.makedirs(ARGS.out, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, libgla {gla.version()} ({gla.library_path()}), "
          f"fla {getattr(__import__('fla'), '__version__', '?')}")
    if ARGS.decode_only:
        return main_decode_only()
    if ARGS.layer_grads:
        return main_layer_grads()
    if ARGS.grads_only:
        return main_grads_only()
    if ARGS.profile_step:
        return main_profile_step()
    batches = markov_batches(ARGS.steps, ARGS.batch, ARGS.seq_len, ARGS.seed)
    results = []
    for spec in ARGS.configs.split(","):
        hidden, heads = (int(x) for x in spec.split("x"))
        results.append(run_config(hidden, heads, batches))
    stem = os.path.join(ARGS.out, "fla_model_dropin" + ("_quick" if ARGS.quick else "") + "_" + ARGS.configs.replace(",", "_"))
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(ARGS), "results": results}, f, indent=1)
    try:
        plot(results, stem + "_loss.png")
    except ImportError:
        print(f"no matplotlib here: draw the curves with --plot-only {stem}.json")

    print("\n| config | loss fla / libgla | grads in bf16 noise | max loss gap (curve) | generate agree "
          "| train step fla / libgla | speedup | decode tok/s fla / libgla | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        g, t, d = r["grads"], r["train"], r["decode_tokens_per_s"]
        print(f"| {r['hidden']}/{r['heads']}h/{r['layers']}L | {g['loss_fla']:.4f} / {g['loss_libgla']:.4f} "
              f"| {g['within_bf16_noise']} | {r['max_loss_gap']:.4f} | {r['generate']['agreement'] * 100:.1f}% "
              f"| {t['fla']['median_step_ms']:.1f} / {t['libgla']['median_step_ms']:.1f} ms | {r['train_speedup']:.2f}x "
              f"| {d['fla']:.0f} / {d['libgla']:.0f} | {r['decode_speedup']:.2f}x |")
    print(f"\nwrote {stem}.json and {stem}_loss.png")


if __name__ == "__main__":
    main()
