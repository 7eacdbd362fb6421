#include <gtest/gtest.h>

#include "test_support.hpp"

using namespace gla::test;

TEST(Smoke, ReferenceForwardRuns) {
  Case c;
  Inputs in = make_inputs(c);
  Outputs out;
  ASSERT_EQ(run_forward(in, out, {"reference"}), GLA_STATUS_OK) << gla_last_error();
  EXPECT_TRUE(all_finite(out.o));
}
