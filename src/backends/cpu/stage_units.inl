// Work items of the stage units: item = (sequence, head), chunks per problem.chunk_size. Part of
// kernels.inl.

inline void run_stage(const gla_problem& p, int64_t item, const Tiles& t) {
  const int64_t h = item % p.H, n = item / p.H;
  const Span sp = span_of(p, n);
  const int64_t K = p.K, V = p.V, C = p.chunk_size;
  const float scale = static_cast<float>(p.scale);
  const Gates gates{t.b, t.blo, K};
  const int64_t nchunks = (sp.length + C - 1) / C;
  const int64_t first_chunk = p.chunk_offsets ? p.chunk_offsets[n] : 0;
  const auto rows = [&](int64_t c) { return std::min(C, sp.length - c * C); };
  switch (p.unit) {
    case GLA_UNIT_CUMSUM: {
      const int64_t kg = p.gcum.sizes[3];
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        gate_cumsum(p, sp.batch, t0, L, h, t.b, t.blo, t.rund);
        for (int64_t r = 0; r < L; ++r) {
          float* dst = static_cast<float*>(p.gcum.data) + off4(p.gcum, sp.batch, t0 + r, h, 0);
          for (int64_t i = 0; i < kg; ++i) dst[i * p.gcum.strides[3]] = t.b[r * K + i];
        }
      }
      break;
    }
    case GLA_UNIT_FWD_H: {
      load_initial_state(p, n, h, 0, V, t.S);
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        copy_to_chunk_state(p, p.h, first_chunk + c, h, t.S);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        state_step(L, K, V, t.k, gates, t.v, t.S, t.S, t.kl, t.run);
      }
      if (has(p.final_state)) store_state(p, p.final_state, n, h, 0, V, t.S);
      break;
    }
    case GLA_UNIT_FWD_INTRA: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        intra_attention(L, K, C, scale, t.q, t.k, gates, t.A, C, nullptr, t.intra);
        store_tile(p.A, sp.batch, t0, L, h, 0, C, t.A, C);
      }
      break;
    }
    case GLA_UNIT_FWD_O: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        load_tile(p.A, sp.batch, t0, L, h, 0, C, t.A, C);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        copy_from_chunk_state(p, p.h, first_chunk + c, h, t.S);
        chunk_output(L, K, V, C, scale, t.q, gates, t.S, t.A, t.v, t.o, t.kl);
        store_tile(p.o, sp.batch, t0, L, h, 0, V, t.o, V);
      }
      break;
    }
    case GLA_UNIT_BWD_DH: {
      if (has(p.dht)) {
        load_state(p, p.dht, n, h, 0, V, t.dS);
      } else {
        std::memset(t.dS, 0, static_cast<size_t>(K * V) * 4);
      }
      for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        copy_to_chunk_state(p, p.dh, first_chunk + c, h, t.dS);
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        dstate_step(L, K, V, scale, t.q, gates, t.dout, t.dS, t.kl, t.run);
      }
      if (has(p.dh0)) store_state(p, p.dh0, n, h, 0, V, t.dS);
      break;
    }
    case GLA_UNIT_BWD_DA: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        intra_dA(L, V, C, scale, t.dout, t.v, t.dA, C, t.vt);
        store_tile(p.dA, sp.batch, t0, L, h, 0, C, t.dA, C);
      }
      break;
    }
    case GLA_UNIT_BWD_DV: {
      if (!has(p.dv)) break;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        load_tile(p.A, sp.batch, t0, L, h, 0, C, t.A, C);
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        copy_from_chunk_state(p, p.dh, first_chunk + c, h, t.dS);
        chunk_dv(L, K, V, C, t.k, gates, t.A, t.dout, t.dS, t.dv, t.kl);
        store_tile(p.dv, sp.batch, t0, L, h, 0, V, t.dv, V);
      }
      break;
    }
    case GLA_UNIT_BWD_DQK_INTRA: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        load_tile(p.dA, sp.batch, t0, L, h, 0, C, t.dA, C);
        std::memset(t.dq, 0, static_cast<size_t>(L * K) * 4);
        std::memset(t.dk, 0, static_cast<size_t>(L * K) * 4);
        intra_dqk(L, K, C, t.q, t.k, gates, t.dA, nullptr, t.dq, t.dk, t.dqk);
        add_self_terms(L, K, C, t.q, t.k, t.dA, t.dq, t.dk);
        store_tile(p.dq_intra, sp.batch, t0, L, h, 0, K, t.dq, K);
        store_tile(p.dk_intra, sp.batch, t0, L, h, 0, K, t.dk, K);
      }
      break;
    }
    case GLA_UNIT_BWD_DQKG: {
      if (!has(p.dq) && !has(p.dk) && !has(p.dg)) break;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        copy_from_chunk_state(p, p.h, first_chunk + c, h, t.S);
        copy_from_chunk_state(p, p.dh, first_chunk + c, h, t.dS);
        load_tile(p.dq_intra, sp.batch, t0, L, h, 0, K, t.dq, K);
        load_tile(p.dk_intra, sp.batch, t0, L, h, 0, K, t.dk, K);
        transpose(K, V, t.S, V, t.inter.st, K);
        inter_dqkg(L, K, V, scale, t.q, t.k, t.v, gates, t.dout, t.inter.st, t.dS, t.dq, t.dk, has(p.dg) ? t.dg : nullptr,
                   t.inter);
        if (has(p.dq)) store_tile(p.dq, sp.batch, t0, L, h, 0, K, t.dq, K);
        if (has(p.dk)) store_tile(p.dk, sp.batch, t0, L, h, 0, K, t.dk, K);
        if (has(p.dg)) store_dg(p, sp.batch, t0, L, h, t.dg);
      }
      break;
    }
    default:
      break;
  }
}
