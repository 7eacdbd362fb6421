#!/usr/bin/env python3
"""Incremental decoding with gla.nn: a prompt, then one token at a time through the layers' caches,
checked token by token against one full-sequence forward.

The prompt goes through ``gla.chunk_gla`` (it is longer than the 64 tokens the layer sends to the
recurrent path); each new token is one call per layer through ``gla.fused_recurrent_gla``, starting
from the state (and short-convolution inputs) the previous call left in the layer's LayerCache.
Afterwards the whole sequence, prompt plus generated tokens, is run in one chunked call: at every
generated position its logits must equal the incremental ones (relative error below 1e-4 in fp32)
and its argmax must be the token that was generated.

    python3 examples/generate.py [--new-tokens 48] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

try:
    import gla
except ImportError:  # a source checkout: the package is in python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import gla
from gla.nn import GLALanguageModel


@torch.no_grad()
def decode(model: GLALanguageModel, prompt: torch.Tensor, new_tokens: int):
    """Greedy decoding, returning the new tokens and the logits each incremental step produced."""
    caches = model.new_caches()
    logits = model(prompt, caches)[:, -1]
    tokens, step_logits = [], []
    for step in range(new_tokens):
        step_logits.append(logits)
        tokens.append(logits.argmax(-1, keepdim=True))
        if step + 1 < new_tokens:
            logits = model(tokens[-1], caches)[:, -1]
    return torch.cat(tokens, 1), torch.stack(step_logits, 1)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    vocab = 256
    model = GLALanguageModel(vocab, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             use_short_conv=True).to(device).eval()
    # Spread the logits so that greedy choices are clear (a fresh model's are all near zero).
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(args.seed + 1))

    new, incremental = decode(model, prompt, args.new_tokens)
    with torch.no_grad():
        full = model(torch.cat([prompt, new], 1))[:, args.prompt_len - 1:-1]
    err = ((incremental - full).norm(dim=-1) / full.norm(dim=-1)).double()  # [B, new]
    chosen = full.argmax(-1) == new
    print(f"libgla {gla.version()} on {device}: prompt {args.prompt_len} tokens (chunked prefill), "
          f"{args.new_tokens} tokens decoded one at a time (recurrent), batch {args.batch}")
    print(f"{'step':>4s}  {'tokens':>12s}  {'rel. error of logits':>20s}  full-sequence argmax")
    for t in range(args.new_tokens):
        toks = ",".join(str(int(x)) for x in new[:, t])
        print(f"{t:4d}  {toks:>12s}  {err[:, t].max().item():20.2e}  {'same' if chosen[:, t].all() else 'DIFFERENT'}")
    max_err = err.max().item()
    agree = bool(chosen.all()) and max_err < 1e-4
    print(f"{'agree' if agree else 'DISAGREE'}: {int(chosen.sum())}/{chosen.numel()} tokens are the full "
          f"forward's argmax, largest relative logit error {max_err:.2e} (bar 1e-4)")
    return {"agree": agree, "checked": chosen.numel(), "max_rel_error": max_err, "tokens": new.tolist()}


if __name__ == "__main__":
    sys.exit(0 if main()["agree"] else 1)
