// The workspace contract: the size query sees the real sequence offsets (host cu_seqlens), and a
// caller-supplied buffer of that size serves the call (pre-filled with NaN: nothing may be read
// before it is written); the *_with_allocator calls ask the caller's allocator for that size once.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"

using namespace gla::test;

namespace {

TEST(Workspace, PipelineSizeFollowsSequenceOffsets) {
  Case c;
  c.B = 1; c.H = 2; c.K = 16; c.V = 8; c.cu_seqlens = {0, 15, 100, 300, 1200, 2000}; c.T = 2000; c.seed = 21;
  Inputs in = make_inputs(c);
  HostTensor o(c.dtype, {c.B, c.T, c.H, c.V});
  gla_chunk_forward_args a{in.q.desc(), in.k.desc(), in.v.desc(), in.g.desc(), in.h0.desc(), in.cu.desc(), nullptr,
                           o.desc(), nullptr};
  gla_options opts;
  gla_options_init(&opts);
  opts.backend = "reference";
  opts.force_stage_pipeline = 1;
  size_t bytes = 0;
  ASSERT_EQ(gla_chunk_forward_workspace_size(&a, &opts, &bytes), GLA_STATUS_OK) << gla_last_error();
  // 1 + 2 + 4 + 15 + 13 = 35 chunks of 64: the chunk-start states alone take 35 * H * K * V floats.
  EXPECT_GE(bytes, size_t{35} * 2 * 16 * 8 * 4);

  // Same through a separate host copy of cu_seqlens and no readable device copy.
  size_t via_host_copy = 0;
  gla_tensor device_cu = in.cu.t;
  device_cu.data = nullptr;  // metadata only: the host copy must be what is read
  a.cu_seqlens = &device_cu;
  a.cu_seqlens_host = in.cu.desc();
  ASSERT_EQ(gla_chunk_forward_workspace_size(&a, &opts, &via_host_copy), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(via_host_copy, bytes);
}

TEST(Workspace, CallerBufferServesThePipeline) {
  Case c;
  c.B = 2; c.T = 150; c.H = 2; c.K = 8; c.V = 8; c.seed = 22;
  Inputs in = make_inputs(c);
  Outputs ref;
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK);

  HostTensor o(c.dtype, {c.B, c.T, c.H, c.V});
  poison(o);
  gla_chunk_forward_args a{in.q.desc(), in.k.desc(), in.v.desc(), in.g.desc(), in.h0.desc(), nullptr, nullptr,
                           o.desc(), nullptr};
  gla_options opts;
  gla_options_init(&opts);
  opts.backend = "reference";
  opts.force_stage_pipeline = 1;
  size_t bytes = 0;
  ASSERT_EQ(gla_chunk_forward_workspace_size(&a, &opts, &bytes), GLA_STATUS_OK);
  ASSERT_GT(bytes, 0u);
  std::vector<float> workspace(bytes / 4 + 1, NAN);
  opts.workspace = workspace.data();
  opts.workspace_bytes = bytes;
  ASSERT_EQ(gla_chunk_forward(&a, &opts), GLA_STATUS_OK) << gla_last_error();
  EXPECT_LT(rel_rms(o, ref.o), 1e-5);
  // The buffer was used: the cumulative gates sit at its start.
  EXPECT_FALSE(std::isnan(workspace[0]));
}

// A caller's allocator that records what it was asked for and hands out NaN-filled host memory
// (or nothing, when `fail`).
struct CountingAllocator {
  int calls = 0;
  size_t bytes = 0;
  bool fail = false;
  std::vector<float> memory;
  gla_allocator allocator() {
    return {[](void* context, size_t n) -> void* {
              auto& self = *static_cast<CountingAllocator*>(context);
              ++self.calls;
              self.bytes = n;
              if (self.fail) return nullptr;
              self.memory.assign(n / 4 + 1, NAN);
              return self.memory.data();
            },
            this};
  }
};

// The stage pipeline on `reference` needs a workspace (its intermediates), so the allocator is asked.
gla_options pipeline_options() {
  gla_options opts;
  gla_options_init(&opts);
  opts.backend = "reference";
  opts.force_stage_pipeline = 1;
  return opts;
}

Inputs allocator_inputs() {
  Case c;
  c.B = 2; c.T = 150; c.H = 2; c.K = 8; c.V = 8; c.seed = 23;
  return make_inputs(c);
}

TEST(Workspace, ForwardWithAllocatorAsksOnceForWhatTheQueryReports) {
  Inputs in = allocator_inputs();
  Outputs ref, out;
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
  const gla_chunk_forward_args a = forward_args(in, out);
  const gla_options opts = pipeline_options();
  size_t bytes = 0;
  ASSERT_EQ(gla_chunk_forward_workspace_size(&a, &opts, &bytes), GLA_STATUS_OK) << gla_last_error();
  ASSERT_GT(bytes, 0u);
  CountingAllocator counting;
  const gla_allocator allocator = counting.allocator();
  ASSERT_EQ(gla_chunk_forward_with_allocator(&a, &opts, &allocator), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(counting.calls, 1);
  EXPECT_EQ(counting.bytes, bytes);
  EXPECT_FALSE(std::isnan(counting.memory[0]));  // the cumulative gates sit at its start
  EXPECT_LT(rel_rms(out.o, ref.o), 1e-5);
  EXPECT_LT(rel_rms(out.ht, ref.ht), 1e-5);
}

TEST(Workspace, BackwardWithAllocatorMatchesTheBackward) {
  Inputs in = allocator_inputs();
  Outputs ref, out;
  ASSERT_EQ(run_backward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
  const gla_chunk_backward_args a = backward_args(in, out);
  const gla_options opts = pipeline_options();
  CountingAllocator counting;
  const gla_allocator allocator = counting.allocator();
  ASSERT_EQ(gla_chunk_backward_with_allocator(&a, &opts, &allocator), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(counting.calls, 1);
  EXPECT_GT(counting.bytes, 0u);
  for (const auto& [got, want] : {std::pair{&out.dq, &ref.dq}, {&out.dk, &ref.dk}, {&out.dv, &ref.dv},
                                  {&out.dg, &ref.dg}, {&out.dh0, &ref.dh0}}) {
    EXPECT_LT(rel_rms(*got, *want), 1e-5);
  }
}

TEST(Workspace, AllocatorNotAskedWhenTheCallersWorkspaceCovers) {
  Inputs in = allocator_inputs();
  Outputs out;
  const gla_chunk_forward_args a = forward_args(in, out);
  gla_options opts = pipeline_options();
  size_t bytes = 0;
  ASSERT_EQ(gla_chunk_forward_workspace_size(&a, &opts, &bytes), GLA_STATUS_OK) << gla_last_error();
  std::vector<float> workspace(bytes / 4 + 1, NAN);
  opts.workspace = workspace.data();
  opts.workspace_bytes = bytes;
  CountingAllocator counting;
  const gla_allocator allocator = counting.allocator();
  ASSERT_EQ(gla_chunk_forward_with_allocator(&a, &opts, &allocator), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(counting.calls, 0);
  EXPECT_FALSE(std::isnan(workspace[0]));
}

TEST(Workspace, AllocatorReturningNullFailsBeforeAnythingIsWritten) {
  Inputs in = allocator_inputs();
  Outputs out;
  const gla_chunk_forward_args a = forward_args(in, out);
  const gla_options opts = pipeline_options();
  CountingAllocator counting;
  counting.fail = true;
  const gla_allocator allocator = counting.allocator();
  ASSERT_EQ(gla_chunk_forward_with_allocator(&a, &opts, &allocator), GLA_STATUS_OUT_OF_MEMORY);
  EXPECT_EQ(counting.calls, 1);
  EXPECT_NE(std::string(gla_last_error()).find("workspace: the caller's allocator returned NULL for " +
                                               std::to_string(counting.bytes) + " bytes"),
            std::string::npos)
      << gla_last_error();
  for (int64_t i = 0; i < out.o.size(); ++i) ASSERT_TRUE(std::isnan(out.o.get(i))) << "o[" << i << "] written";
}

TEST(Workspace, AllocatorWithoutAFunctionIsRejected) {
  Inputs in = allocator_inputs();
  Outputs out;
  const gla_chunk_forward_args a = forward_args(in, out);
  const gla_options opts = pipeline_options();
  const gla_allocator none{nullptr, nullptr};
  ASSERT_EQ(gla_chunk_forward_with_allocator(&a, &opts, &none), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("allocator.allocate: expected a function, got NULL"), std::string::npos)
      << gla_last_error();
  // No allocator at all: gla_chunk_forward itself.
  ASSERT_EQ(gla_chunk_forward_with_allocator(&a, &opts, nullptr), GLA_STATUS_OK) << gla_last_error();
}

}  // namespace
