// The forward's plan: which chunk kernel, its tiling and the segment split of long sequences.
// Plain C++ (no device code), so the unit tests compile it without nvcc (tests/cpp/test_cuda_plan.cpp).
#include <algorithm>
#include <functional>
#include <queue>
#include <vector>

#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/chunk_layout.hpp"

namespace gla::cuda {

namespace {

// Makespan (in chunk units) of blocks dispatched in launch order onto `slots` resident CTAs.
double simulate(const std::vector<double>& costs, int slots) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < slots; ++i) free_at.push(0.0);
  double end = 0.0;
  for (double c : costs) {
    double t = free_at.top();
    free_at.pop();
    t += c;
    end = std::max(end, t);
    free_at.push(t);
  }
  return end;
}

// The model's costs in chunk units: a full-pass block of len chunks that folds the m earlier
// segments' states, and a local-state (pass 1) block, whose state-only chunks cost about half.
double full_block_cost(int64_t len, int64_t m) { return double(len) + 0.3 + 0.15 * double(m); }
double local_block_cost(int64_t len) { return 0.5 * double(len) + 0.3; }

// fn(n, m, len, segments) for every full-pass block (sequence n, segment m of `segments`, len
// chunks) at segment length seg, sequences of at most `whole` chunks unsplit. An empty sequence
// still has its one block (it writes final_state = initial_state), of length 0.
template <typename Fn>
void for_each_block(const std::vector<int64_t>& chunks, int64_t seg, int64_t whole, Fn&& fn) {
  for (int64_t n = 0; n < static_cast<int64_t>(chunks.size()); ++n) {
    const int64_t len_n = detail::sequence_segment_chunks(seg, whole, chunks[n]);
    const int64_t ns = detail::sequence_segments(seg, whole, chunks[n]);
    for (int64_t m = 0; m < ns; ++m) fn(n, m, chunks[n] == 0 ? 0 : std::min(len_n, chunks[n] - m * len_n), ns);
  }
}

// The full pass's blocks (n, m) of one head tile with their modeled cost: longest first, among
// equal lengths the one folding more states first, then in (n, m) order.
struct BlockItem {
  double cost;
  int64_t len, n, m;
};
std::vector<BlockItem> blocks_longest_first(const std::vector<int64_t>& chunks, int64_t seg, int64_t whole) {
  std::vector<BlockItem> items;
  for_each_block(chunks, seg, whole, [&](int64_t n, int64_t m, int64_t len, int64_t) {
    items.push_back({full_block_cost(len, m), len, n, m});
  });
  std::stable_sort(items.begin(), items.end(), [](const BlockItem& a, const BlockItem& b) {
    return a.len != b.len ? a.len > b.len : a.m > b.m;
  });
  return items;
}

// A lower bound of modeled_cost: each pass lasts at least its work over the slots and its longest
// block. Cheap (no schedule), so candidates it rules out are not simulated.
double cost_lower_bound(const std::vector<int64_t>& chunks, int64_t seg, int64_t whole, int64_t copies, int slots) {
  double work2 = 0, longest2 = 0, work1 = 0, longest1 = 0;
  for_each_block(chunks, seg, whole, [&](int64_t, int64_t m, int64_t len, int64_t segments) {
    work2 += full_block_cost(len, m);
    longest2 = std::max(longest2, full_block_cost(len, m));
    if (m < segments - 1) {
      work1 += local_block_cost(len);
      longest1 = std::max(longest1, local_block_cost(len));
    }
  });
  double bound = std::max(work2 * double(copies) / slots, longest2);
  if (work1 > 0) bound += std::max(work1 * double(copies) / slots, longest1) + 1.0;
  return bound;
}

// The modeled time of a split (chunk units): pass-2 makespan + pass-1 makespan + one chunk of
// overhead for folding the earlier states. ordered: the full pass launches longest first
// (order_blocks), heads innermost; else in the natural grid, per head tile every sequence's
// max_seg blocks (those past its segments return at once).
double modeled_cost(const std::vector<int64_t>& chunks, int64_t seg, int64_t whole, int64_t max_seg, int64_t copies,
                    int slots, bool ordered) {
  std::vector<double> pass2, pass1;
  if (ordered) {
    for (const BlockItem& b : blocks_longest_first(chunks, seg, whole)) pass2.insert(pass2.end(), size_t(copies), b.cost);
  }
  for (int64_t y = 0; y < copies; ++y) {
    for_each_block(chunks, seg, whole, [&](int64_t, int64_t m, int64_t len, int64_t segments) {
      if (!ordered) pass2.push_back(full_block_cost(len, m));
      if (m < segments - 1) pass1.push_back(local_block_cost(len));
      if (!ordered && m == segments - 1) pass2.insert(pass2.end(), size_t(max_seg - segments), 0.02);
    });
  }
  double cost = simulate(pass2, slots);
  if (!pass1.empty()) cost += simulate(pass1, slots) + 1.0;
  return cost;
}

}  // namespace

const KernelName& kernel_name(ForwardKernel kernel) {
  static const KernelName names[] = {
      {"recurrent", "recurrent kernel (token loop in IEEE fp32 FMA: fp32 inputs, or K > 256)"},
      {"chunk-mmadiag", "chunk kernel with tensor-core diagonal blocks"},
      {"chunk-ws", "warp-specialised chunk kernel (prep and state warp groups, tensor cores)"},
      {"chunk-ws-split",
       "warp-specialised chunk kernel with element-wise items split two ways (prep and state warp groups, tensor "
       "cores)"},
  };
  return names[static_cast<int>(kernel)];
}

void order_blocks(ForwardPlan& plan, const int64_t* seq_offsets, int64_t N) {
  plan.block_order_count = 0;
  if (!is_warp_specialised(plan.kernel) || N < 2) return;
  std::vector<int64_t> chunks(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) chunks[n] = (seq_offsets[n + 1] - seq_offsets[n] + 63) / 64;
  const std::vector<BlockItem> items = blocks_longest_first(chunks, plan.segment_chunks, plan.whole_chunks);
  if (items.size() > size_t(detail::kMaxBlockOrder)) return;
  // Equal lengths throughout (and no segments): the natural order is already longest first.
  if (items.front().len == items.back().len && plan.max_segments == 1) return;
  for (size_t i = 0; i < items.size(); ++i) {
    plan.block_order[i] = static_cast<int32_t>(items[i].n * plan.max_segments + items[i].m);
  }
  plan.block_order_count = static_cast<int32_t>(items.size());
}

std::optional<std::string> shared_memory_shortfall(size_t need, int available, bool backward) {
  if (available < 0 || need <= static_cast<size_t>(available)) return std::nullopt;
  return std::string(backward ? "the chunk backward's kernels need " : "the chunk forward's kernel needs ") +
         std::to_string(need) + " bytes of shared memory per block, the device allows " + std::to_string(available);
}

namespace {

// What a plan has that does not depend on the sequence lengths: the kernel, the padded K, the value
// tiling and the kernel's shared memory (of one K = 128 half for 128 < K <= 256).
ForwardPlan kernel_plan(const ForwardParams& p) {
  ForwardPlan plan;
  const bool tensor_core = (p.dtype == kBF16 || p.dtype == kF16) && p.K <= 128 && p.K >= 1 && p.V >= 1;
  if (!tensor_core) {  // the recurrent kernel
    plan.shared_bytes = detail::recurrent_smem_bytes(p.K);
    return plan;
  }
  plan.head_dim_k = p.K <= 64 ? 64 : 128;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  // Kernel choice: the warp-specialised kernel needs cp.async rows and a 16-bit per-key gate or a
  // per-head gate (an fp32 per-key gate does not fit its shared memory); the single-role kernel
  // takes anything. At K <= 64 the warp-specialised kernel runs two prep threads per element-wise
  // item (1.50x faster than one at B4 T8192 H32 D64 on the H200, 0.888 -> 0.586 ms); at K = 128
  // that needs 768 threads and was slower (0.639 against 0.578 ms), so one thread per item there.
  const bool ws_ok = p.vector_loads && (p.gate_per_head || gate_bytes == 2);
  plan.kernel = !ws_ok ? ForwardKernel::kChunk
                : plan.head_dim_k == 64 ? ForwardKernel::kChunkWsSplit
                                        : ForwardKernel::kChunkWs;
  plan.value_tile = plan.head_dim_k;
  plan.value_tiles = static_cast<int32_t>((p.V + plan.value_tile - 1) / plan.value_tile);
  plan.shared_bytes =
      plan.kernel == ForwardKernel::kChunk
          ? size_t(detail::chunk_smem_layout(plan.head_dim_k, plan.value_tile, gate_bytes, p.gate_per_head != 0).total)
          : size_t(detail::ws_smem_layout(plan.head_dim_k, plan.kernel == ForwardKernel::kChunkWsSplit ? 2 : 1).total);
  return plan;
}

bool key_halves(const ForwardParams& p) { return (p.dtype == kBF16 || p.dtype == kF16) && p.K > 128 && p.K <= 256 && p.V >= 1; }

}  // namespace

PreparedLayout prepared_layout(const ForwardParams& p) {
  PreparedLayout l{};
  l.decays = size_t(prepared_chunk_slots(p.B, p.T, p.N)) * p.H * p.K;
  l.inputs = (2 * l.decays * sizeof(float) + 255) / 256 * 256;
  const bool placed = p.prepared_qg != nullptr && p.prepared_kg != nullptr;
  l.bytes = l.inputs + (placed ? 0 : size_t(p.B) * p.T * p.H * p.K * 2 * 2);
  return l;
}

size_t forward_shared_bytes(const ForwardParams& p) {
  ForwardParams half = p;
  if (key_halves(p)) half.K = 128;
  return kernel_plan(half).shared_bytes;
}

ForwardPlan plan_forward(const ForwardParams& p, const int64_t* seq_offsets, int sm_count) {
  // 128 < K <= 256 on tensor cores: two K = 128 halves (ForwardPlan::key_split).
  if (key_halves(p)) {
    ForwardParams half = p;
    half.K = 128;
    ForwardPlan plan = plan_forward(half, seq_offsets, sm_count);
    plan.key_split = plan.kernel == ForwardKernel::kChunkWs ? 2 : 1;
    if (plan.key_split == 1) {
      plan.partial_offset = (plan.workspace_bytes + 255) / 256 * 256;
      plan.workspace_bytes = plan.partial_offset + size_t(p.B) * p.T * p.H * p.V * 2;
    }
    plan.intra_offset = (plan.workspace_bytes + 255) / 256 * 256;
    plan.workspace_bytes = plan.intra_offset + size_t(p.B) * p.T * p.H * detail::kChunk * 2;
    // Prepared inputs where four or more value tiles would each form qg and kg: the halves' state
    // group then shares its SM with a prep group that only copies (H100 harness, B8 T2048 H4 K256
    // V512: intra 105 -> 139 us, halves 142 / 162 -> 111 / 134 us, 0.415 -> 0.394 ms; K = V = 256,
    // two value tiles: 1.815 -> 1.884 ms, slower).
    if (plan.key_split == 2 && plan.value_tiles >= 4) {
      plan.prepared = 1;
      plan.prepared_offset = (plan.workspace_bytes + 255) / 256 * 256;
      plan.workspace_bytes = plan.prepared_offset + prepared_layout(p).bytes;
    }
    return plan;
  }
  ForwardPlan plan = kernel_plan(p);
  if (plan.kernel == ForwardKernel::kRecurrent) return plan;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const detail::ChunkSmem L =
      detail::chunk_smem_layout(plan.head_dim_k, plan.value_tile, gate_bytes, p.gate_per_head != 0);
  const int per_sm = plan.kernel == ForwardKernel::kChunk && L.total * 2 + 2048 <= 228 * 1024 ? 2 : 1;
  const int slots = std::max(1, sm_count) * per_sm;

  std::vector<int64_t> chunks(static_cast<size_t>(p.N));
  int64_t max_chunks = 0;
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t len = seq_offsets[n + 1] - seq_offsets[n];
    chunks[n] = (len + 63) / 64;
    max_chunks = std::max(max_chunks, chunks[n]);
  }
  const int64_t copies = p.H * plan.value_tiles;
  plan.segment_chunks = std::max<int64_t>(1, max_chunks);
  plan.whole_chunks = 0;
  plan.max_segments = 1;
  // Candidate splits (segment length, and the longest sequences that stay whole), each costed by
  // modeled_cost; the first within 3% of the best stays.
  const int64_t blocks_at_8 = p.N * copies * std::max<int64_t>(1, max_chunks / 8);
  if (blocks_at_8 <= 400000 && max_chunks > 8) {
    // Uneven lengths: besides splitting every sequence, keep the sequences up to one of the two
    // longest lengths below the longest whole and split only the longer ones (varlen 16 sequences
    // of 1..110 chunks, H16 D128: the model's makespan 84.3 chunks at segments of 32 for all,
    // 77.1 at 16 for the 110-chunk sequence alone). Fewer candidates where the model is costly.
    std::vector<int64_t> wholes{0};
    if (blocks_at_8 <= 100000) {
      std::vector<int64_t> lengths(chunks);
      std::sort(lengths.begin(), lengths.end(), std::greater<int64_t>());
      for (int64_t len : lengths) {
        if (len > 0 && len < max_chunks && len != wholes.back() && wholes.size() < 3) wholes.push_back(len);
      }
    }
    double best = -1.0;
    for (int64_t seg : {max_chunks, int64_t(96), int64_t(64), int64_t(48), int64_t(32), int64_t(24),
                        int64_t(16), int64_t(12), int64_t(8)}) {
      if (seg > max_chunks) continue;
      const int64_t max_seg = (max_chunks + seg - 1) / seg;
      for (int64_t whole : wholes) {
        if (whole != 0 && whole <= seg) continue;  // every sequence up to seg chunks is whole anyway
        // The bound first: same choices, less host time (200 uneven sequences, H16: 1.66 ms of
        // planning without it).
        if (best >= 0 && cost_lower_bound(chunks, seg, whole, copies, slots) >= best * 0.97) continue;
        // The warp-specialised kernels launch the full pass longest first when the blocks fit the
        // order table (order_blocks).
        int64_t blocks = 0;
        for (int64_t c : chunks) blocks += detail::sequence_segments(seg, whole, c);
        const bool ordered = is_warp_specialised(plan.kernel) && p.N > 1 && blocks <= detail::kMaxBlockOrder;
        const double cost = modeled_cost(chunks, seg, whole, max_seg, copies, slots, ordered);
        if (best < 0 || cost < best * 0.97) {
          best = cost;
          plan.segment_chunks = seg;
          plan.whole_chunks = whole;  // nonzero only above seg, so only where max_seg > 1
          plan.max_segments = max_seg;
        }
      }
    }
  }
  if (plan.max_segments > 1) {
    const size_t per = size_t(plan.value_tiles) * plan.value_tile * plan.head_dim_k + plan.head_dim_k;
    plan.workspace_bytes = size_t(p.N) * plan.max_segments * p.H * per * sizeof(float);
  }
  order_blocks(plan, seq_offsets, p.N);
  return plan;
}

}  // namespace gla::cuda
