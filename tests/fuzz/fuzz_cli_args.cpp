// libFuzzer target over the `gla` command's argument parser (tools/cli_args.hpp): the input split
// at NUL bytes into arguments. Checked: no crash or sanitizer report; an accepted configuration
// has non-negative sizes, and its buffer-size check either fits in int64 or says why not.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli_args.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.emplace_back();
    } else {
      args.back() += static_cast<char>(data[i]);
    }
  }
  const gla::cli::ParseResult r = gla::cli::parse_args(args);
  if (r.kind == gla::cli::ParseResult::kError && r.error.empty()) std::abort();
  if (r.kind != gla::cli::ParseResult::kOk) return 0;
  const gla::cli::Config& c = r.config;
  if (c.B < 0 || c.T < 0 || c.H < 0 || c.K < 0 || c.V < 0 || c.repeat < 1) std::abort();
  for (int64_t x : c.cu) {
    if (x < 0) std::abort();
  }
  const gla::cli::ProblemBytes bytes = gla::cli::problem_bytes(c);
  if (bytes.ok ? bytes.bytes < 0 : bytes.error.empty()) std::abort();
  return 0;
}
