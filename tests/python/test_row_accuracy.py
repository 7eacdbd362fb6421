"""Row accuracy where q . k cancels: the first token of each sequence and head has a small q_0 . k_0
made of two large halves of opposite sign (keys 0..127 against 128..255), so o's row 0 = scale *
(q_0 . k_0) v_0 is small. A backend that forms the score per key half and rounds each half to 16
bits is off there by several percent while its whole-tensor error stays within SPEC §5, and the
gated RMSNorm after the attention in fla's GLA layer scales that row back up, so the error reaches
the model's gradients (src/backends/cuda/chunk_forward_intra.cu). Every backend that serves 16-bit
inputs (cpu, torch; cuda on a GPU, marker cuda) must keep row 0 within bf16 rounding of the fp64
oracle."""
import pytest
import torch

import gla
from oracle import token_loop

# bf16 inputs: A and o rounded once give 0.33 % on these inputs; each key half's score and o rounded
# apart, 3.4 % (emulated in fp64) and 4.3 % (measured on the CUDA key split formed that way)
ROW_TOLERANCE = 1e-2


def _cancelling_inputs(dtype, device, gate_f32=False, per_head=False, seed=0):
    """B2 T200 H2 K256 V128 randn inputs; token 0: q's second key half equal to its first, k's second
    half the negative of its first plus a same-signed part 1/64 of it (q_0 . k_0 ~ 1/40 of a half's)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 2, 200, 2, 256, 128
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.rand(B, T, H, 1 if per_head else K, generator=gen, dtype=torch.float64))
    if per_head:
        g = g[..., 0]
    half = K // 2
    q[:, 0, :, half:] = q[:, 0, :, :half]
    k[:, 0, :, half:] = -k[:, 0, :, :half] + torch.sign(q[:, 0, :, :half]) * k[:, 0, :, :half].abs() / 64
    q, k, v = (x.to(dtype) for x in (q, k, v))
    g = g.to(torch.float32 if gate_f32 else dtype)
    return [x.to(device) for x in (q, k, v, g)]


def _worst_row0_error(backend, device, dtype, **variant):
    q, k, v, g = _cancelling_inputs(dtype, device, **variant)
    with gla.backend(backend):
        o, _ = gla.chunk_gla(q, k, v, g)
    ref = token_loop(q, k, v, g)[0]
    err = (o.double().cpu()[:, 0] - ref[:, 0]).norm(dim=-1) / ref[:, 0].norm(dim=-1)
    return err.max().item()


VARIANTS = [{}, {"gate_f32": True}, {"per_head": True}]
IDS = ["gate bf16", "gate f32", "gate per head"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_row0_where_the_key_halves_cancel(backend, variant):
    assert _worst_row0_error(backend, "cpu", torch.bfloat16, **variant) < ROW_TOLERANCE


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run `pytest tests/python -m cuda`)")
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_cuda_row0_where_the_key_halves_cancel(variant):
    assert _worst_row0_error("cuda", "cuda", torch.bfloat16, **variant) < ROW_TOLERANCE
