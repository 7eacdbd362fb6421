// The reference backend against the fp64 numpy oracle (../shared/reference/gla_reference.py), on
// fixtures made by tests/fixtures/make_oracle_fixtures.py: the whole-operation token loop and the
// reference's own stage pipeline (the chunked form) must both reproduce it.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "test_support.hpp"

using namespace gla::test;

namespace {

struct Fixture {
  std::map<std::string, std::string> header;
  std::map<std::string, std::vector<double>> arrays;
  int64_t get(const std::string& key) const { return std::stoll(header.at(key)); }
};

Fixture load(const std::string& name) {
  Fixture f;
  std::ifstream in(std::string(GLA_FIXTURE_DIR) + "/oracle/" + name + ".txt");
  if (!in) throw std::runtime_error("cannot open fixture " + name);
  std::string line;
  std::getline(in, line);
  std::istringstream hs(line);
  std::string word;
  hs >> word;  // "case"
  while (hs >> word) {
    const auto eq = word.find('=');
    f.header[word.substr(0, eq)] = word.substr(eq + 1);
  }
  std::string array_name;
  size_t count = 0;
  while (in >> array_name >> count) {
    std::vector<double> values(count);
    for (auto& x : values) in >> x;
    f.arrays[array_name] = std::move(values);
  }
  return f;
}

void assign(HostTensor& t, const std::vector<double>& values) {
  ASSERT_EQ(static_cast<int64_t>(values.size()), t.size());
  for (int64_t i = 0; i < t.size(); ++i) t.set(i, values[static_cast<size_t>(i)]);
}

double rel_to(const HostTensor& t, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < t.size(); ++i) {
    const double d = t.get(i) - ref[static_cast<size_t>(i)];
    if (!std::isfinite(t.get(i))) return INFINITY;
    num += d * d;
    den += ref[static_cast<size_t>(i)] * ref[static_cast<size_t>(i)];
  }
  return std::sqrt(num / den);
}

class OracleFixture : public ::testing::TestWithParam<std::string> {};

void check_against_oracle(const Fixture& f, const RunOptions& options, double bar) {
  Case c;
  c.B = f.get("B");
  c.T = f.get("T");
  c.H = f.get("H");
  c.K = f.get("K");
  c.V = f.get("V");
  c.per_head_gate = f.get("per_head_gate") != 0;
  c.initial_state = f.get("initial_state") != 0;
  if (f.header.at("cu_seqlens") != "-") {
    std::stringstream s(f.header.at("cu_seqlens"));
    std::string item;
    while (std::getline(s, item, ',')) c.cu_seqlens.push_back(std::stoll(item));
  }
  Inputs in = make_inputs(c);  // shapes; values replaced by the fixture's
  assign(in.q, f.arrays.at("q"));
  assign(in.k, f.arrays.at("k"));
  assign(in.v, f.arrays.at("v"));
  assign(in.g, f.arrays.at("g"));
  if (c.initial_state) assign(in.h0, f.arrays.at("initial_state"));
  assign(in.dout, f.arrays.at("do"));
  assign(in.dht, f.arrays.at("dht"));

  Outputs out;
  ASSERT_EQ(run_forward(in, out, options), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_backward(in, out, options), GLA_STATUS_OK) << gla_last_error();
  const std::pair<const char*, const HostTensor*> outputs[] = {{"o", &out.o},   {"final_state", &out.ht},
                                                               {"dq", &out.dq}, {"dk", &out.dk},
                                                               {"dv", &out.dv}, {"dg", &out.dg},
                                                               {"dh0", &out.dh0}};
  for (const auto& [name, tensor] : outputs) {
    EXPECT_LT(rel_to(*tensor, f.arrays.at(name)), bar) << name;
  }
}

TEST_P(OracleFixture, TokenLoopMatchesOracle) {
  // fp32 outputs of an fp64 computation: only the final rounding separates them.
  check_against_oracle(load(GetParam()), {"reference"}, 1e-6);
}

// Largest |b| = |chunk-local cumulative gate| / ln 2 over 64-token chunks (per-key columns).
double max_cumulative_gate(const Fixture& f) {
  const auto& g = f.arrays.at("g");
  const int64_t T = f.get("T"), B = f.get("B");
  const int64_t cols = static_cast<int64_t>(g.size()) / (B * T);
  double worst = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t col = 0; col < cols; ++col) {
      double acc = 0;
      for (int64_t t = 0; t < T; ++t) {
        if (t % 64 == 0) acc = 0;
        acc += g[static_cast<size_t>((b * T + t) * cols + col)];
        worst = std::max(worst, std::abs(acc) / std::log(2.0));
      }
    }
  }
  return worst;
}

TEST_P(OracleFixture, ReferenceStagePipelineMatchesOracle) {
  // The chunked form through the dispatcher's stage pipeline. Its intermediates are fp32 by
  // contract (gla.h), so each decay 2^(b_t - b_s) carries the rounding of b: relative error up to
  // ulp(max|b|) * ln 2 (about 2e-5 when 64 steps of strong decay put |b| near 460). The bar is
  // 1e-5 plus that term; for mild gates it stays 1e-5.
  const Fixture f = load(GetParam());
  RunOptions options{"reference"};
  options.stage_pipeline = true;
  const double gate_rounding = std::ldexp(1.0, -23) * max_cumulative_gate(f) * std::log(2.0);
  check_against_oracle(f, options, 1e-5 + 2 * gate_rounding);
}

INSTANTIATE_TEST_SUITE_P(Oracle, OracleFixture,
                         ::testing::Values("single_step", "partial_chunk", "strong_decay", "weak_decay_batch",
                                           "per_head_gate", "varlen_no_h0"));

}  // namespace
