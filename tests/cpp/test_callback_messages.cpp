// Callback backends write their reasons into a buffer the library owns (gla_backend_desc): the
// library terminates it itself, so a plugin that fills every byte without a NUL is read up to the
// capacity and no further (this was a stack-buffer-overflow read).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "test_support.hpp"

using namespace gla::test;

namespace {

size_t g_capacity = 0;

void fill_without_nul(char* message, size_t capacity) {
  g_capacity = capacity;
  std::memset(message, 'x', capacity);
}
int32_t unavailable_unterminated(void*, char* message, size_t capacity) {
  fill_without_nul(message, capacity);
  return 0;
}
int32_t verify_unterminated(void*, const gla_problem*, char* message, size_t capacity) {
  fill_without_nul(message, capacity);
  return 0;
}
int32_t run_unterminated(void*, const gla_problem*, char* message, size_t capacity) {
  fill_without_nul(message, capacity);
  return GLA_STATUS_BACKEND_ERROR;
}

gla_backend_desc describe(const char* name) {
  gla_backend_desc d{};
  d.abi_version = GLA_ABI_VERSION;
  d.name = name;
  d.priority = 0;
  d.device_mask = 1ull << GLA_DEVICE_CPU;
  d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  d.run = run_unterminated;
  return d;
}

// Length of the longest run of 'x' in text.
size_t longest_x_run(const std::string& text) {
  size_t best = 0, run = 0;
  for (char ch : text) {
    run = ch == 'x' ? run + 1 : 0;
    best = std::max(best, run);
  }
  return best;
}

Inputs small_inputs() {
  Case c;
  c.B = 1; c.T = 10; c.H = 1; c.K = 8; c.V = 8; c.seed = 3;
  return make_inputs(c);
}

TEST(CallbackMessages, UnterminatedRunMessageIsCutAtCapacity) {
  auto d = describe("unterminated_run");
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK) << gla_last_error();
  Inputs in = small_inputs();
  Outputs out;
  EXPECT_EQ(run_forward(in, out, {"unterminated_run"}), GLA_STATUS_BACKEND_ERROR);
  ASSERT_GT(g_capacity, 1u);
  EXPECT_EQ(longest_x_run(gla_last_error()), g_capacity - 1);
  EXPECT_EQ(gla_unregister_backend("unterminated_run"), GLA_STATUS_OK);
}

TEST(CallbackMessages, UnterminatedVerifyAndAvailableReasonsAreCutAtCapacity) {
  auto v = describe("unterminated_verify");
  v.verify = verify_unterminated;
  ASSERT_EQ(gla_register_backend(&v), GLA_STATUS_OK) << gla_last_error();
  Inputs in = small_inputs();
  Outputs out;
  EXPECT_EQ(run_forward(in, out, {"unterminated_verify"}), GLA_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(longest_x_run(gla_last_error()), g_capacity - 1);
  EXPECT_EQ(gla_unregister_backend("unterminated_verify"), GLA_STATUS_OK);

  auto a = describe("unterminated_available");
  a.available = unavailable_unterminated;
  ASSERT_EQ(gla_register_backend(&a), GLA_STATUS_OK) << gla_last_error();
  bool seen = false;
  for (int32_t i = 0; i < gla_backend_count(); ++i) {
    const char *name = nullptr, *reason = nullptr;
    int32_t available = 1;
    ASSERT_EQ(gla_backend_info(i, &name, nullptr, &available, &reason), GLA_STATUS_OK);
    if (std::string(name) != "unterminated_available") continue;
    seen = true;
    EXPECT_EQ(available, 0);
    EXPECT_EQ(std::strlen(reason), g_capacity - 1);
  }
  EXPECT_TRUE(seen);
  EXPECT_EQ(gla_unregister_backend("unterminated_available"), GLA_STATUS_OK);
}

}  // namespace
