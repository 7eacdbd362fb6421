"""gla.nn: the GatedLinearAttention layer (against an fp64 re-derivation of its equations), its
cache, grouped-query attention, the chunked and recurrent paths, the small language model, and the
two examples."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import gla
from gla.nn import GatedLinearAttention, GLALanguageModel, LayerCache
from gla.nn import attention as attention_module
from oracle import rel, token_loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_RECURRENT = hasattr(gla, "fused_recurrent_gla")


def _token_loop_recurrent(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                          reverse=False, cu_seqlens=None, state_v_first=False):
    """fused_recurrent_gla's documented call as a differentiable PyTorch token loop (the forms the
    layer uses: per-key gate, forward time order, K-first state), standing in where the installed
    gla predates gla.fused_recurrent_gla."""
    assert gv is None and not reverse and not state_v_first, "the stand-in covers the layer's calls only"
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in range(cu_seqlens.numel() - 1)]
    rows, finals = [], []
    for n, (b, start, end) in enumerate(bounds):
        S = q.new_zeros(H, K, v.shape[-1], dtype=acc) if initial_state is None else initial_state[n].to(acc)
        for t in range(start, end):
            S = gk[b, t].to(acc).exp()[..., None] * S + k[b, t].to(acc)[..., None] * v[b, t].to(acc)[:, None, :]
            rows.append(scale * torch.einsum("hk,hkv->hv", q[b, t].to(acc), S))
        finals.append(S)
    o = torch.stack(rows).reshape(*q.shape[:2], H, -1).to(v.dtype)
    return o, (torch.stack(finals).float() if acc == torch.float32 else torch.stack(finals)) if output_final_state else None


@pytest.fixture(autouse=True)
def recurrent_op(monkeypatch):
    """gla.fused_recurrent_gla, or the token-loop stand-in where this gla has none yet."""
    if not HAS_RECURRENT:
        monkeypatch.setattr(gla, "fused_recurrent_gla", _token_loop_recurrent, raising=False)
    return gla.fused_recurrent_gla


def test_token_loop_matches_the_oracle():
    """The stand-in itself, against the fp64 oracle (tests/python/oracle.py), packed sequences included."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, d, generator=gen) for d in (8, 8, 16))
    gk = F.logsigmoid(torch.randn(1, 40, 4, 8, generator=gen)) / 16
    h0 = torch.randn(3, 4, 8, 16, generator=gen)
    o, state = _token_loop_recurrent(q, k, v, gk=gk, initial_state=h0, output_final_state=True,
                                     cu_seqlens=torch.tensor([0, 7, 8, 40]))
    want_o, want_state = token_loop(q, k, v, gk, initial_state=h0, cu_seqlens=[0, 7, 8, 40])[:2]
    assert rel(o, want_o) < 1e-6 and rel(state, want_state) < 1e-6


def test_recurrent_op_matches_the_token_loop():
    """gla.fused_recurrent_gla in the layer's call form (per-key fp32 gate, initial state, final
    state, packed sequences) against the token loop above."""
    if not HAS_RECURRENT:
        pytest.skip("gla.fused_recurrent_gla is not in this gla: the recurrent path runs a PyTorch token-loop "
                    "stand-in in these tests")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, d, generator=gen) for d in (8, 8, 16))
    gk = F.logsigmoid(torch.randn(1, 40, 4, 8, generator=gen)) / 16
    h0 = torch.randn(3, 4, 8, 16, generator=gen)
    cu = torch.tensor([0, 7, 8, 40])
    for cu_seqlens, state in ((None, h0[:1]), (cu, h0)):
        got = gla.fused_recurrent_gla(q, k, v, gk=gk, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens)
        want = _token_loop_recurrent(q, k, v, gk=gk, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens)
        assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5


def _layer(seed=0, dtype=torch.float32, **options):
    torch.manual_seed(seed)
    options = {"hidden_size": 64, "num_heads": 4, **options}
    layer = GatedLinearAttention(**options)
    with torch.no_grad():  # non-trivial norm weights and gate biases
        for name, p in layer.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return layer.to(dtype)


def _input(B=2, T=100, hidden=64, seed=1, dtype=torch.float32):
    return torch.randn(B, T, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _expected(layer: GatedLinearAttention, x, initial_state=None):
    """The layer's equations written out in fp64, the attention by the fp64 oracle (tests/python/oracle.py)."""
    P = {name: p.detach().double() for name, p in layer.named_parameters()}
    x = x.detach().double()
    B, T, _ = x.shape
    H, dk, dv, groups = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.num_kv_groups

    def heads(y, width):
        y = y.reshape(B, T, -1, width)
        return y.repeat_interleave(groups, dim=2)

    q, k, v = x @ P["q_proj.weight"].T, x @ P["k_proj.weight"].T, x @ P["v_proj.weight"].T
    if layer.use_short_conv:  # y_t = silu(b + sum_j w_j x_{t-(W-1)+j}), zeros before the start
        def conv(y, name):
            w, W = P[name + ".weight"][:, 0], P[name + ".weight"].shape[-1]
            out = torch.zeros_like(y) + P.get(name + ".bias", 0)
            for j in range(W):
                shift = W - 1 - j
                out[:, shift:] += w[:, j] * y[:, :T - shift]
            return F.silu(out)
        q, k, v = conv(q, "q_conv1d"), conv(k, "k_conv1d"), conv(v, "v_conv1d")
    q = q.reshape(B, T, H, dk)
    k, v = heads(k, dk), heads(v, dv)
    gk = heads((x @ P["gk_proj.0.weight"].T) @ P["gk_proj.1.weight"].T + P["gk_proj.1.bias"], dk)
    gk = F.logsigmoid(gk) / layer.gate_logit_normalizer
    if layer.clamp_min is not None:
        gk = gk.clamp_min(layer.clamp_min)
    if layer.feature_map is not None:
        fm = gla.nn.ACTIVATIONS[layer.feature_map]
        q, k = fm(q), fm(k)
    o, final = token_loop(q, k, v, gk, initial_state=initial_state)[:2]
    norm_name = layer._out_norm_name
    eps = getattr(layer, norm_name).eps
    o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + eps)
    if norm_name + ".weight" in P:
        o = o * P[norm_name + ".weight"]
    if layer.use_output_gate:
        act = getattr(layer, norm_name).act
        o = o * act((x @ P["g_proj.weight"].T).reshape(B, T, H, dv))
    return o.reshape(B, T, -1) @ P["o_proj.weight"].T, final


# ---- the layer ----
def test_defaults_match_fla_config():
    layer = GatedLinearAttention()
    assert (layer.hidden_size, layer.num_heads, layer.num_kv_heads) == (2048, 4, 4)
    assert (layer.key_dim, layer.value_dim, layer.head_k_dim, layer.head_v_dim) == (1024, 2048, 256, 512)
    assert layer.gate_logit_normalizer == 16 and layer.gk_proj[0].out_features == 16
    assert layer.use_output_gate and layer.feature_map is None and layer.clamp_min is None
    assert layer.g_norm_swish_gate.eps == 1e-6
    # fla's GatedLinearAttention parameter names and shapes for GLAConfig's defaults
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == {
        "q_proj.weight": (1024, 2048), "k_proj.weight": (1024, 2048), "v_proj.weight": (2048, 2048),
        "g_proj.weight": (2048, 2048), "gk_proj.0.weight": (16, 2048), "gk_proj.1.weight": (1024, 16),
        "gk_proj.1.bias": (1024,), "g_norm_swish_gate.weight": (512,), "o_proj.weight": (2048, 2048)}


OPTIONS = [
    {},
    {"expand_k": 1.0, "expand_v": 2.0},
    {"num_kv_heads": 2},
    {"num_kv_heads": 1, "expand_k": 1.0},
    {"use_output_gate": False},
    {"gate_fn": "sigmoid", "elementwise_affine": False},
    {"feature_map": "relu"},
    {"clamp_min": -0.05, "gate_logit_normalizer": 1},
    {"use_short_conv": True, "num_kv_heads": 2},
    {"use_short_conv": True, "conv_size": 2, "conv_bias": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_layer_matches_its_equations(options, mode):
    layer = _layer(mode=mode, **options)
    x = _input(T=70 if mode == "chunk" else 20)
    expected, _ = _expected(layer, x)
    got = layer(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel(got, expected) < 1e-5


def test_options_change_the_output():
    """Every option is real: each gives a different output from the default with the same weights."""
    x = _input(T=40)
    base = _layer()(x)
    for options in OPTIONS[4:]:
        layer = _layer(**options)
        own = layer.state_dict()
        state = {n: p for n, p in _layer().state_dict().items() if n in own and own[n].shape == p.shape}
        layer.load_state_dict(state, strict=False)
        assert rel(layer(x), base) > 1e-3, options


def test_gradients_gradcheck():
    """float64 end to end (gla.chunk_gla's float64 path): autograd's gradient of every input."""
    layer = _layer(hidden_size=16, num_heads=2, num_kv_heads=1, mode="chunk").double()
    x = _input(B=1, T=20, hidden=16).double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,), eps=1e-6, atol=1e-5, fast_mode=True)


def test_parameter_gradients_match_fp64():
    layer = _layer(num_kv_heads=2)
    ref = _layer(num_kv_heads=2).double()
    x = _input(T=80)
    target = torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(5))
    (layer(x) * target).sum().backward()
    (ref(x.double()) * target.double()).sum().backward()
    for (name, p), (_, r) in zip(layer.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert rel(p.grad, r.grad) < 1e-4, name


def test_gqa_is_repeated_kv_heads():
    """A layer with 2 k/v heads for 4 query heads equals a 4-k/v-head layer whose k, v and gate
    weights repeat each k/v head for its two query heads."""
    gqa = _layer(num_kv_heads=2)
    full = _layer(num_kv_heads=4)
    dk, dv = gqa.head_k_dim, gqa.head_v_dim

    def repeated(w, width):  # rows of each k/v head, repeated per query head
        return w.unflatten(0, (2, width)).repeat_interleave(2, dim=0).flatten(0, 1)

    state = gqa.state_dict()
    state["k_proj.weight"] = repeated(state["k_proj.weight"], dk)
    state["v_proj.weight"] = repeated(state["v_proj.weight"], dv)
    state["gk_proj.1.weight"] = repeated(state["gk_proj.1.weight"], dk)
    state["gk_proj.1.bias"] = repeated(state["gk_proj.1.bias"], dk)
    full.load_state_dict(state)
    assert gqa.k_proj.out_features == 2 * dk and gqa.v_proj.out_features == 2 * dv
    x = _input(T=90)
    assert rel(gqa(x), full(x)) < 1e-6


def test_chunk_and_recurrent_agree():
    chunk = _layer(num_kv_heads=2, mode="chunk")
    recurrent = _layer(num_kv_heads=2, mode="fused_recurrent")
    x = _input(T=50)
    c1, c2 = LayerCache(), LayerCache()
    assert rel(recurrent(x, cache=c2), chunk(x, cache=c1)) < 1e-5
    assert rel(c2.state, c1.state) < 1e-5


def test_auto_mode_picks_the_path(monkeypatch):
    calls = []
    for name in ("chunked_gla", "recurrent_gla"):
        real = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    layer = _layer()
    layer(_input(T=10))  # autograd records it: training
    layer(_input(T=65))
    with torch.no_grad():
        layer(_input(T=64))  # decoding / short prefill
        layer(_input(T=65))  # long prefill
    assert calls == ["chunked_gla", "chunked_gla", "recurrent_gla", "chunked_gla"]


def test_dtypes_bf16_close_to_fp32():
    layer = _layer()
    x = _input(T=130)
    ref = layer(x)
    got = _layer(dtype=torch.bfloat16)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert rel(got, ref) < 3e-2  # bf16 weights and activations: 8-bit mantissas through 4 matmuls


# ---- the cache ----
@pytest.mark.parametrize("options", [{}, {"use_short_conv": True}], ids=["plain", "short_conv"])
def test_cache_continues_a_sequence(options):
    layer = _layer(mode="chunk", **options)
    x = _input(T=150)
    full_cache = LayerCache()
    full = layer(x, cache=full_cache)
    cache = LayerCache()
    parts = [layer(x[:, :70], cache=cache), layer(x[:, 70:71], cache=cache), layer(x[:, 71:], cache=cache)]
    assert cache.seen_tokens == 150 and tuple(cache.state.shape) == (2, 4, 8, 16)
    assert cache.state.dtype == torch.float32
    if layer.use_short_conv:
        assert [tuple(c.shape) for c in cache.conv_state] == [(2, 32, 3), (2, 32, 3), (2, 64, 3)]
        assert all(torch.equal(a, b) for a, b in zip(cache.conv_state, full_cache.conv_state))
    assert rel(torch.cat(parts, 1), full) < 1e-5
    assert rel(cache.state, full_cache.state) < 1e-5
    _, expected_state = _expected(layer, x)
    assert rel(cache.state, expected_state) < 1e-5


def test_cache_reset_and_initial_state():
    layer = _layer()  # (no short convolution: the expected second call starts from the state alone)
    x = _input(T=80)
    cache = LayerCache()
    first = layer(x, cache=cache)
    second = layer(x, cache=cache)
    assert rel(second, first) > 1e-2  # the carried state changes the answer
    expected, _ = _expected(layer, x, initial_state=_expected(layer, x)[1])
    assert rel(second, expected) < 1e-5
    cache.reset()
    assert cache.state is None and cache.seen_tokens == 0
    assert rel(layer(x, cache=cache), first) < 1e-6


def test_cache_detach_cuts_the_graph():
    layer = _layer(mode="chunk", use_short_conv=True)
    x1 = _input(T=30).requires_grad_(True)
    x2 = _input(T=30, seed=3).requires_grad_(True)
    cache = LayerCache()
    layer(x1, cache=cache)
    assert cache.state.requires_grad and all(c.requires_grad for c in cache.conv_state)
    cache.detach()
    assert not cache.state.requires_grad and not any(c.requires_grad for c in cache.conv_state)
    layer(x2, cache=cache).sum().backward()
    assert x1.grad is None and x2.grad is not None


def test_cache_state_gets_gradient_through_calls():
    layer = _layer(mode="chunk", use_short_conv=True)
    x1 = _input(T=30).requires_grad_(True)
    cache = LayerCache()
    layer(x1, cache=cache)
    layer(_input(T=30, seed=3), cache=cache).sum().backward()
    assert x1.grad is not None and x1.grad.abs().sum() > 0


@pytest.mark.parametrize("options", [{}, {"use_short_conv": True}], ids=["plain", "short_conv"])
def test_varlen_packed_sequences(options):
    layer = _layer(mode="chunk", **options)
    x = _input(B=1, T=150)
    cu = torch.tensor([0, 40, 41, 150])
    cache = LayerCache()
    packed = layer(x, cache=cache, cu_seqlens=cu)
    assert tuple(cache.state.shape) == (3, 4, 8, 16)
    for n in range(3):
        s, e = int(cu[n]), int(cu[n + 1])
        one = LayerCache()
        assert rel(packed[:, s:e], layer(x[:, s:e], cache=one)) < 1e-5
        assert rel(cache.state[n:n + 1], one.state) < 1e-5


def test_bad_input_is_named():
    layer = _layer()
    with pytest.raises(ValueError, match=r"hidden_states: expected \[B, T, 64\], got \[2, 10, 32\]"):
        layer(torch.randn(2, 10, 32))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(10, 64))
    with pytest.raises(TypeError, match="cache: expected a gla.nn.LayerCache, got dict"):
        layer(torch.randn(2, 10, 64), cache={})
    with pytest.raises(ValueError, match=r"cache.state: expected \[2, 4, 8, 16\].*got \[3, 4, 8, 16\]"):
        layer(torch.randn(2, 10, 64), cache=LayerCache(torch.zeros(3, 4, 8, 16)))
    conv = _layer(use_short_conv=True)
    bad = (torch.zeros(2, 32, 3), torch.zeros(1, 32, 3), torch.zeros(2, 64, 3))
    with pytest.raises(ValueError, match=r"cache.conv_state\[1\]: expected \[2, 32, 3\], got \[1, 32, 3\]"):
        conv(torch.randn(2, 10, 64), cache=LayerCache(conv_state=bad))
    for options, message in [({"num_heads": 3, "num_kv_heads": 2}, "num_kv_heads: expected a divisor"),
                             ({"expand_k": 0.3}, "expand_k"), ({"num_heads": 5}, "num_heads: expected a divisor"),
                             ({"mode": "fast"}, "mode: expected one of"), ({"feature_map": "exp"}, "feature_map"),
                             ({"gate_fn": "nope"}, "gate_fn"), ({"gate_logit_normalizer": 0}, "gate_logit_normalizer"),
                             ({"hidden_size": 0}, "hidden_size"), ({"use_short_conv": True, "conv_size": 0}, "conv_size")]:
        with pytest.raises(ValueError, match=message):
            GatedLinearAttention(**{"hidden_size": 64, "num_heads": 4, **options})


# ---- the model and the examples ----
def _model(**options):
    torch.manual_seed(0)
    return GLALanguageModel(50, hidden_size=64, num_layers=2, num_heads=4, **options)


def test_model_generate_matches_full_forward():
    model = _model(num_kv_heads=2, use_short_conv=True).eval()
    prompt = torch.randint(0, 50, (3, 70), generator=torch.Generator().manual_seed(0))
    new = model.generate(prompt, 12)
    assert new.shape == (3, 12)
    with torch.no_grad():
        full = model(torch.cat([prompt, new], 1))
    assert torch.equal(full[:, 69:-1].argmax(-1), new)


def test_model_caches_validated():
    model = _model()
    with pytest.raises(ValueError, match="caches: expected 2 LayerCache objects"):
        model(torch.zeros(1, 3, dtype=torch.long), caches=[LayerCache()])


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_example_generate_agrees_token_by_token(capsys, monkeypatch):
    paths = []
    for name in ("chunked_gla", "recurrent_gla"):
        real = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name,
                            lambda *a, _real=real, _name=name, **kw: paths.append(_name) or _real(*a, **kw))
    result = _example("generate").main(["--device", "cpu", "--new-tokens", "24"])
    assert result["agree"] and result["checked"] == 48 and result["max_rel_error"] < 1e-4
    # 2 layers: the prompt and the full forward chunked, the 23 single-token steps recurrent
    assert paths.count("chunked_gla") == 4 and paths.count("recurrent_gla") == 2 * 23
    assert "agree: 48/48" in capsys.readouterr().out


def test_example_train_mqar_quick(tmp_path):
    start = time.perf_counter()
    history = _example("train_mqar").main(["--quick", "--no-progress", "--device", "cpu",
                                           "--plot", str(tmp_path / "mqar.png")])
    assert history["accuracy"] >= 0.9, history["eval_accuracy"]
    assert (tmp_path / "mqar.png").stat().st_size > 10_000
    print(f"train_mqar --quick: accuracy {history['accuracy']:.3f} in {time.perf_counter() - start:.1f} s")
