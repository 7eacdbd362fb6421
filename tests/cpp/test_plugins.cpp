// Out-of-tree backends from shared libraries: gla_load_plugin and GLA_PLUGINS, with the example
// plugin written in C (tests/cpp/example_plugin.c).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "test_support.hpp"

using namespace gla::test;

namespace {

bool listed(const std::string& name) {
  for (int32_t i = 0; i < gla_backend_count(); ++i) {
    const char* n = nullptr;
    if (gla_backend_info(i, &n, nullptr, nullptr, nullptr) == GLA_STATUS_OK && name == n) return true;
  }
  return false;
}

TEST(Plugins, LoadedPluginServesWhenForcedAndDeclinesWithItsReason) {
  ASSERT_EQ(gla_load_plugin(GLA_EXAMPLE_PLUGIN), GLA_STATUS_OK) << gla_last_error();
  EXPECT_TRUE(listed("example_plugin"));
  Case c;
  c.B = 2; c.T = 90; c.H = 2; c.K = 32; c.V = 16; c.seed = 31;
  Inputs in = make_inputs(c);
  Outputs got, want;
  ASSERT_EQ(run_forward(in, got, {"example_plugin"}), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK);
  EXPECT_EQ(rel_rms(got.o, want.o), 0.0);
  EXPECT_EQ(rel_rms(got.ht, want.ht), 0.0);

  c.K = 128;
  Inputs wide = make_inputs(c);
  EXPECT_EQ(run_forward(wide, got, {"example_plugin"}), GLA_STATUS_NOT_SUPPORTED);
  EXPECT_NE(std::string(gla_last_error()).find("K=128 > 64 supported by the example plugin"), std::string::npos)
      << gla_last_error();
  EXPECT_EQ(gla_unregister_backend("example_plugin"), GLA_STATUS_OK);
}

TEST(Plugins, BadPluginsAreErrorsWithReasons) {
  EXPECT_EQ(gla_load_plugin("/nonexistent/libnothing.so"), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("cannot load plugin '/nonexistent/libnothing.so'"), std::string::npos)
      << gla_last_error();
  // A real shared library without the entry points: libgla itself.
  EXPECT_EQ(gla_load_plugin(GLA_LIBRARY_FILE), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("does not export gla_plugin_abi_version()"), std::string::npos)
      << gla_last_error();
  EXPECT_EQ(gla_load_plugin(nullptr), GLA_STATUS_INVALID_ARGUMENT);
}

TEST(Plugins, WrongVersionMissingSymbolAndFailedRegistrationAreRefusedAndTheLibraryCarriesOn) {
  const int32_t before = gla_backend_count();
  EXPECT_EQ(gla_load_plugin(GLA_BROKEN_PLUGIN_VERSION), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("was built for ABI version " + std::to_string(GLA_ABI_VERSION + 7) +
                                               "; this libgla reads versions 1 to " + std::to_string(GLA_ABI_VERSION)),
            std::string::npos)
      << gla_last_error();
  EXPECT_EQ(gla_load_plugin(GLA_BROKEN_PLUGIN_SYMBOL), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("does not export gla_plugin_abi_version()"), std::string::npos)
      << gla_last_error();
  EXPECT_EQ(gla_load_plugin(GLA_BROKEN_PLUGIN_REGISTRATION), GLA_STATUS_BACKEND_ERROR);
  const std::string why = gla_last_error();
  EXPECT_NE(why.find("failed to register: invalid argument: desc.name: expected a non-empty backend name"),
            std::string::npos) << why;
  EXPECT_NE(why.find("(removed again: broken_half_registered)"), std::string::npos) << why;
  EXPECT_FALSE(listed("broken_half_registered"));
  EXPECT_EQ(gla_backend_count(), before);
  // The library carries on.
  Case c;
  c.K = 16; c.V = 8;
  Inputs in = make_inputs(c);
  Outputs got, want;
  ASSERT_EQ(run_forward(in, got), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK);
  EXPECT_LT(rel_rms(got.o, want.o), 1e-5);
  // GLA_PLUGINS: the bad ones reported and skipped, the good one loaded.
  const std::string out = run_command("GLA_PLUGINS=" + std::string(GLA_BROKEN_PLUGIN_VERSION) + ":" + GLA_EXAMPLE_PLUGIN +
                                      ":" + GLA_BROKEN_PLUGIN_REGISTRATION + " " + GLA_CLI + " backends 2>&1");
  EXPECT_NE(out.find("was built for ABI version"), std::string::npos) << out;
  EXPECT_NE(out.find("failed to register"), std::string::npos) << out;
  EXPECT_NE(out.find("example_plugin"), std::string::npos) << out;
  EXPECT_EQ(out.find("broken_half_registered "), std::string::npos) << out;
}

TEST(Plugins, EnvironmentLoadsPluginsAtStartAndReportsFailures) {
  const std::string cli = GLA_CLI;
  const std::string ok = run_command("GLA_PLUGINS=" + std::string(GLA_EXAMPLE_PLUGIN) + " " + cli + " backends 2>&1");
  EXPECT_NE(ok.find("example_plugin"), std::string::npos) << ok;
  const std::string bad = run_command("GLA_PLUGINS=/nonexistent/x.so:" + std::string(GLA_EXAMPLE_PLUGIN) + " " + cli +
                                      " backends 2>&1");
  EXPECT_NE(bad.find("[gla] GLA_PLUGINS: path: cannot load plugin '/nonexistent/x.so'"), std::string::npos) << bad;
  EXPECT_NE(bad.find("example_plugin"), std::string::npos) << bad;
  const std::string none = run_command(cli + " backends 2>&1");
  EXPECT_EQ(none.find("example_plugin"), std::string::npos) << none;
}

}  // namespace
