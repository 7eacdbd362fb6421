// The workspace contract: the size query sees the real sequence offsets (host cu_seqlens), and a
// caller-supplied buffer of that size serves the call (pre-filled with NaN: nothing may be read
// before it is written).
#include <gtest/gtest.h>

#include <cmath>

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

}  // namespace
