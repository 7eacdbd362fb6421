// Work items of the whole operations (forward, backward): the chunk walk of one (sequence, head
// group, value tile). Part of kernels.inl.

inline void load_initial_state(const gla_problem& p, int64_t n, int64_t h, int64_t v0, int64_t bv, float* S,
                               int64_t ld = -1) {
  if (ld < 0) ld = bv;
  if (has(p.initial_state)) {
    load_state(p, p.initial_state, n, h, v0, bv, S, ld);
  } else {
    std::memset(S, 0, static_cast<size_t>(p.K * ld) * 4);
  }
}

// Whole forward: item = (sequence, group of heads, value tile); the group walks its chunks together.
inline void run_forward(const gla_problem& p, int64_t item, int64_t group, const Tiles& t) {
  const int64_t nt = value_tiles(p), bw = value_tile_width(p), ngroups = (p.H + group - 1) / group;
  const int64_t vt = item % nt, hg = (item / nt) % ngroups, n = item / nt / ngroups;
  const int64_t h0 = hg * group, G = std::min(group, p.H - h0);
  const int64_t v0 = vt * bw, bv = std::min(bw, p.V - v0);
  const Span sp = span_of(p, n);
  const int64_t K = p.K, C = kChunk;
  const int64_t lds = padded_ld(bv);
  const int64_t ldv = lds;  // v rows padded like S's (they are the B operand of A v and of the state update)
  const int64_t ck = C * K, cv = C * bv, cvp = C * ldv, kv = K * lds;
  const float scale = static_cast<float>(p.scale);
  for (int64_t j = 0; j < G; ++j) load_initial_state(p, n, h0 + j, v0, bv, t.S + j * kv, lds);
  const int64_t first_chunk = has(p.h) ? first_saved_chunk(p, n, C) : 0;
  for (int64_t c0 = 0; c0 < sp.length; c0 += C) {
    const int64_t L = std::min(C, sp.length - c0), t0 = sp.start + c0;
    load_tiles(p.q, sp.batch, t0, L, h0, G, 0, K, t.q, ck, K);
    load_tiles(p.k, sp.batch, t0, L, h0, G, 0, K, t.k, ck, K);
    load_tiles(p.v, sp.batch, t0, L, h0, G, v0, bv, t.v, cvp, ldv);
    load_tiles(p.g, sp.batch, t0, L, h0, G, 0, p.gate_per_head ? 1 : K, t.b, ck, K);
    if (has(p.h)) {  // the state at this chunk's start, for a later backward (streamed: read much later)
      for (int64_t j = 0; j < G; ++j) {
        float* dst = static_cast<float*>(p.h.data) + ((first_chunk + c0 / C) * p.H + h0 + j) * K * p.V + v0;
        for (int64_t i = 0; i < K; ++i) copy_out_rows(t.S + j * kv + i * lds, bv, dst + i * p.V);
      }
      end_copy_out();
    }
    for (int64_t j = 0; j < G; ++j) {
      float *q = t.q + j * ck, *k = t.k + j * ck, *b = t.b + j * ck, *blo = t.blo + j * ck;
      float *v = t.v + j * cvp, *o = t.o + j * cv, *S = t.S + j * kv;
      cumsum_gate_rows(p.gate_per_head, L, K, b, blo, t.rund);
      const Gates gates{b, blo, K};
      forward_chunk(L, K, bv, C, scale, q, k, gates, v, ldv, S, lds, o, t.A, t.intra, t.kl, t.run, t.wd);
    }
    store_tiles(p.o, sp.batch, t0, L, h0, G, v0, bv, t.o, cv, bv);
  }
  if (has(p.final_state)) {
    for (int64_t j = 0; j < G; ++j) store_state(p, p.final_state, n, h0 + j, v0, bv, t.S + j * kv, lds);
  }
}

// Whole backward: item = (sequence, head). A forward pass recomputes the chunk-start states, then a
// reverse pass carries dS and finishes each chunk's dq, dk, dv, dg while its tiles are in cache.
inline void run_backward(const gla_problem& p, int64_t item, int64_t group, const Tiles& t) {
  const int64_t ngroups = (p.H + group - 1) / group;
  const int64_t hg = item % ngroups, n = item / ngroups;
  const int64_t h0 = hg * group, G = std::min(group, p.H - h0);
  const Span sp = span_of(p, n);
  const int64_t K = p.K, V = p.V, C = kChunk;
  const int64_t ck = C * K, cv = C * V, kv = K * V;
  const int64_t gk = p.gate_per_head ? 1 : K;
  const float scale = static_cast<float>(p.scale);
  const bool want_dqk = has(p.dq) || has(p.dk) || has(p.dg);
  const int64_t nchunks = (sp.length + C - 1) / C;
  const int64_t states_per_head = max_chunks_per_sequence(p, C) * kv;
  // Pass 1: the chunk-start states of every head in the group, kept transposed (V x K): see
  // state_step_transposed. Each head's running state stays in a cache-resident tile (t.S) and is
  // copied out to `states` with streaming stores: stepping it in place in `states` read every
  // 64 KiB destination from memory first (read for ownership). The last state is read from the
  // tile in pass 2.
  const auto hot = [&](int64_t j) { return t.S + j * kv; };
  // With the caller's saved states (p.h, written by the forward) there is no pass 1: pass 2
  // transposes each chunk's state from there into the hot tile.
  const bool saved = has(p.h);
  const int64_t first_chunk = saved ? first_saved_chunk(p, n, C) : 0;
  if ((want_dqk || has(p.dv)) && !saved) {
    if (nchunks > 0) {
      for (int64_t j = 0; j < G; ++j) {
        load_initial_state(p, n, h0 + j, 0, V, t.dS);  // dS is free until pass 2
        transpose(K, V, t.dS, V, hot(j), K);
        if (nchunks > 1) copy_out(hot(j), kv, t.states + j * states_per_head);
      }
    }
    for (int64_t c = 0; c + 1 < nchunks; ++c) {
      const int64_t c0 = c * C, L = std::min(C, sp.length - c0), t0 = sp.start + c0;
      load_tiles(p.k, sp.batch, t0, L, h0, G, 0, K, t.k, ck, K);
      load_tiles(p.v, sp.batch, t0, L, h0, G, 0, V, t.v, cv, V);
      load_tiles(p.g, sp.batch, t0, L, h0, G, 0, gk, t.b, ck, K);
      for (int64_t j = 0; j < G; ++j) {
        float *b = t.b + j * ck, *blo = t.blo + j * ck;
        cumsum_gate_rows(p.gate_per_head, L, K, b, blo, t.rund);
        state_step_transposed(L, K, V, t.k + j * ck, Gates{b, blo, K}, t.v + j * cv, hot(j), hot(j), t.kl, t.run);
        if (c + 2 < nchunks) copy_out(hot(j), kv, t.states + j * states_per_head + (c + 1) * kv);
      }
    }
  }
  // Pass 2, in reverse: carry dS and finish each chunk's gradients.
  for (int64_t j = 0; j < G; ++j) {
    if (has(p.dht)) {
      load_state(p, p.dht, n, h0 + j, 0, V, t.dS + j * kv);
    } else {
      std::memset(t.dS + j * kv, 0, static_cast<size_t>(kv) * 4);
    }
  }
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t c0 = c * C, L = std::min(C, sp.length - c0), t0 = sp.start + c0;
    load_tiles(p.q, sp.batch, t0, L, h0, G, 0, K, t.q, ck, K);
    load_tiles(p.g, sp.batch, t0, L, h0, G, 0, gk, t.b, ck, K);
    if (has(p.do_)) {
      load_tiles(p.do_, sp.batch, t0, L, h0, G, 0, V, t.dout, cv, V);
    } else {
      for (int64_t j = 0; j < G; ++j) std::memset(t.dout + j * cv, 0, static_cast<size_t>(L * V) * 4);
    }
    if (want_dqk || has(p.dv)) {
      load_tiles(p.k, sp.batch, t0, L, h0, G, 0, K, t.k, ck, K);
      load_tiles(p.v, sp.batch, t0, L, h0, G, 0, V, t.v, cv, V);
    }
    for (int64_t j = 0; j < G; ++j) {
      const float *q = t.q + j * ck, *kt = t.k + j * ck, *v = t.v + j * cv, *dout = t.dout + j * cv;
      float *b = t.b + j * ck, *blo = t.blo + j * ck, *dS = t.dS + j * kv;
      float *dq = t.dq + j * ck, *dk = t.dk + j * ck, *dg = t.dg + j * ck, *dv = t.dv + j * cv;
      cumsum_gate_rows(p.gate_per_head, L, K, b, blo, t.rund);
      const Gates gates{b, blo, K};
      // 2^(b_t) and 2^(b_last - b_t) once for dv, dq, dk and the dS step
      for (int64_t r = 0; r < L; ++r) {
        exp2_rows(gates, r, -1, t.es + r * K);
        exp2_rows(gates, L - 1, r, t.ee + r * K);
      }
      const DecayRows decay{t.es, t.ee};
      if (want_dqk || has(p.dv)) {
        intra_attention(L, K, C, scale, q, kt, gates, t.A, L, want_dqk ? t.wd : nullptr, t.intra);
        if (has(p.dv)) chunk_dv(L, K, V, C, kt, gates, t.A, dout, dS, dv, t.kl, decay);
        if (want_dqk) {
          intra_dA(L, V, C, scale, dout, v, t.dA, L, t.vt);
          std::memset(dq, 0, static_cast<size_t>(L * K) * 4);
          std::memset(dk, 0, static_cast<size_t>(L * K) * 4);
          intra_dqk(L, K, C, q, kt, gates, t.dA, t.wd, dq, dk, t.dqk);
          if (saved) {
            transpose(K, V, static_cast<const float*>(p.h.data) + ((first_chunk + c) * p.H + h0 + j) * kv, V, hot(j), K);
          }
          const float* St = saved || c == nchunks - 1 ? hot(j) : t.states + j * states_per_head + c * kv;
          inter_dqkg(L, K, V, scale, q, kt, v, gates, dout, St, dS, dq, dk,
                     has(p.dg) ? dg : nullptr, t.inter, decay);
          add_self_terms(L, K, C, q, kt, t.dA, dq, dk);
          if (has(p.dg) && p.gate_per_head) {  // dg of a per-head gate: the sum over K, into column 0
            for (int64_t r = 0; r < L; ++r) {
              float acc = 0.0f;
              for (int64_t i = 0; i < K; ++i) acc += dg[r * K + i];
              dg[r * K] = acc;
            }
          }
        }
      }
      dstate_step(L, K, V, scale, q, gates, dout, dS, t.kl, t.run, decay);
    }
    if (has(p.dv)) store_tiles(p.dv, sp.batch, t0, L, h0, G, 0, V, t.dv, cv, V);
    if (has(p.dq)) store_tiles(p.dq, sp.batch, t0, L, h0, G, 0, K, t.dq, ck, K);
    if (has(p.dk)) store_tiles(p.dk, sp.batch, t0, L, h0, G, 0, K, t.dk, ck, K);
    if (has(p.dg)) store_tiles(p.dg, sp.batch, t0, L, h0, G, 0, gk, t.dg, ck, K);
  }
  if (has(p.dh0)) {
    for (int64_t j = 0; j < G; ++j) store_state(p, p.dh0, n, h0 + j, 0, V, t.dS + j * kv);
  }
}
