#!/usr/bin/env python3
"""Trains a small GLA language model on multi-query associative recall (MQAR) and reports its
accuracy.

MQAR (Arora et al., 2023, "Zoology") is the recall test for sub-quadratic sequence models: a
sequence lists key-value pairs, then asks for some of the keys again; the model must answer each
with the value that followed that key. Here a sequence is

    k1 v1 k2 v2 ... kP vP  q1 a1 q2 a2 ... qQ aQ

with keys and values drawn without repetition from two disjoint halves of the vocabulary, the
queries q a random subset of the keys, and a the matching values. The loss and the accuracy count
only the answers (the prediction at each q); chance is 1 / (number of values). Data is generated
here, nothing is downloaded.

    pip install .[examples]                 # tqdm, matplotlib
    python3 examples/train_mqar.py          # ~3 min of CPU time: held-out accuracy 1.000; CUDA on a GPU
    python3 examples/train_mqar.py --quick  # the CI run: 4 pairs, ~30 s of CPU time, accuracy 0.998

Prints the held-out accuracy and writes the loss/accuracy curves to a PNG (``--plot``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

try:
    import gla
except ImportError:  # a source checkout: the package is in python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import gla
from gla.nn import GLALanguageModel

IGNORE = -100


@dataclass
class Task:
    num_keys: int = 32  # keys are tokens [0, num_keys), values [num_keys, num_keys + num_values)
    num_values: int = 32
    pairs: int = 8
    queries: int = 8

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 2 * (self.pairs + self.queries)


def make_batch(task: Task, batch_size: int, generator: torch.Generator):
    """``(inputs [B, T], targets [B, T])``: targets hold the answer at each query and IGNORE elsewhere."""
    B, P, Q = batch_size, task.pairs, task.queries
    keys = torch.rand(B, task.num_keys, generator=generator).argsort(-1)[:, :P]
    values = task.num_keys + torch.rand(B, task.num_values, generator=generator).argsort(-1)[:, :P]
    asked = torch.rand(B, P, generator=generator).argsort(-1)[:, :Q]
    answers = values.gather(1, asked)
    context = torch.stack([keys, values], -1).flatten(1)
    probe = torch.stack([keys.gather(1, asked), answers], -1).flatten(1)
    inputs = torch.cat([context, probe], 1)
    targets = torch.full_like(inputs, IGNORE)
    targets[:, 2 * P::2] = answers  # predicted at each query position
    return inputs, targets


def loss_and_accuracy(model, inputs, targets):
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    mask = targets != IGNORE
    accuracy = (logits.argmax(-1)[mask] == targets[mask]).float().mean()
    return loss, accuracy


@dataclass
class Config:
    task: Task
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    gate_logit_normalizer: float = 16
    use_short_conv: bool = True
    steps: int = 600
    batch_size: int = 256
    lr: float = 3e-3
    warmup: int = 50
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0


FULL = Config(Task())
QUICK = Config(Task(num_keys=16, num_values=16, pairs=4, queries=4), hidden_size=64, steps=200, batch_size=128,
               eval_every=25)


def train(config: Config, device: torch.device, progress: bool = True) -> dict:
    """Trains from scratch; returns the history (step, train loss/accuracy, eval accuracy)."""
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    task = config.task
    model = GLALanguageModel(task.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_layers,
                             num_heads=config.num_heads,
                             gate_logit_normalizer=config.gate_logit_normalizer,
                             use_short_conv=config.use_short_conv).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.1, betas=(0.9, 0.98))

    def lr_at(step):  # linear warmup, cosine decay to 10 %
        if step < config.warmup:
            return (step + 1) / config.warmup
        t = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * t))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    train_gen = torch.Generator().manual_seed(config.seed + 1)
    eval_gen = torch.Generator().manual_seed(config.seed + 2)  # held out: a stream training never sees
    eval_set = [tuple(t.to(device) for t in make_batch(task, config.batch_size, eval_gen))
                for _ in range(config.eval_batches)]

    def evaluate():
        model.eval()
        with torch.no_grad():
            acc = sum(loss_and_accuracy(model, x, y)[1].item() for x, y in eval_set) / len(eval_set)
        model.train()
        return acc

    history = {"step": [], "loss": [], "train_accuracy": [], "eval_step": [], "eval_accuracy": []}
    start, cpu_start = time.perf_counter(), time.process_time()
    bar = tqdm(range(config.steps), desc="mqar", disable=not progress, dynamic_ncols=True)
    for step in bar:
        inputs, targets = (t.to(device) for t in make_batch(task, config.batch_size, train_gen))
        loss, accuracy = loss_and_accuracy(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        history["step"].append(step)
        history["loss"].append(loss.item())
        history["train_accuracy"].append(accuracy.item())
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            history["eval_step"].append(step + 1)
            history["eval_accuracy"].append(evaluate())
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy.item():.2f}",
                        eval=f"{history['eval_accuracy'][-1]:.2f}" if history["eval_accuracy"] else "-")
    bar.close()
    history["seconds"] = time.perf_counter() - start
    history["cpu_seconds"] = time.process_time() - cpu_start
    history["accuracy"] = history["eval_accuracy"][-1]
    history["chance"] = 1 / task.num_values
    history["config"] = asdict(config)
    history["device"] = str(device)
    return history


def plot(history: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(history["step"], history["loss"], lw=0.8)
    left.set(xlabel="step", ylabel="cross-entropy (answers)", title="training loss", yscale="log")
    right.plot(history["step"], history["train_accuracy"], lw=0.6, alpha=0.5, label="train batch")
    right.plot(history["eval_step"], history["eval_accuracy"], "o-", ms=3, label="held out")
    right.axhline(history["chance"], color="grey", ls=":", label="chance")
    right.set(xlabel="step", ylabel="accuracy", title="MQAR recall accuracy", ylim=(0, 1.02))
    right.legend(loc="lower right")
    task = history["config"]["task"]
    fig.suptitle(f"GLA on MQAR ({task['pairs']} pairs, {task['queries']} queries, "
                 f"{history['device']}, {history['seconds']:.0f} s): accuracy {history['accuracy']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short CI run (smaller task and model)")
    parser.add_argument("--steps", type=int, help="training steps (default: 600, quick 200)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot", default="mqar.png", help="PNG of the loss and accuracy curves")
    parser.add_argument("--json", help="also write the history as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--normalizer", type=float)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    config = QUICK if args.quick else FULL
    config = Config(**{**asdict(config), "task": config.task, "seed": args.seed,
                       **({"steps": args.steps} if args.steps else {}),
                       **({"lr": args.lr} if args.lr else {}),
                       **({"gate_logit_normalizer": args.normalizer} if args.normalizer else {})})
    device = torch.device(args.device)
    print(f"MQAR: {config.task.pairs} key-value pairs, {config.task.queries} queries, vocabulary "
          f"{config.task.vocab_size}, length {config.task.seq_len}; model hidden {config.hidden_size}, "
          f"{config.num_layers} GLA layers; {config.steps} steps of {config.batch_size} on {device} "
          f"(libgla {gla.version()})")
    history = train(config, device, progress=not args.no_progress)
    print(f"held-out accuracy {history['accuracy']:.3f} (chance {history['chance']:.3f}) after "
          f"{config.steps} steps, {history['seconds']:.1f} s ({history['cpu_seconds']:.1f} s of CPU time)")
    if args.plot:
        plot(history, args.plot)
        print(f"curves: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(history, f)
    return history


if __name__ == "__main__":
    main()
