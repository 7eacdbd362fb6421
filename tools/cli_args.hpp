// The `gla` command line's arguments: parsed into a Config without running anything, so the parser
// is tested and fuzzed on its own (tests/fuzz/fuzz_cli_args.cpp). Numbers are parsed strictly
// (decimal digits only, in range) and the problem's buffer sizes are checked for int64 overflow
// before the command allocates them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gla/gla.h"

namespace gla::cli {

struct Config {
  int64_t B = 2, T = 1000, H = 4, K = 64, V = 64;
  int32_t dtype = GLA_DTYPE_F32;
  bool gate_f32 = false, per_head = false, h0 = true, ht = true, v_first = false, pipeline = false;
  bool backward = false;
  // --op recurrent: the recurrent operator (fused_recurrent_gla) with its key gate gk (--no-gk drops
  // it), an optional value gate gv (--gv) and reverse time order (--reverse).
  bool recurrent = false, gk = true, gv = false, reverse = false;
  int32_t device = GLA_DEVICE_CPU;
  std::vector<int64_t> cu;
  std::string backend;
  int repeat = 3;
  unsigned seed = 0;
};

struct ParseResult {
  enum Kind { kOk, kHelp, kError } kind = kOk;
  Config config;
  std::string error;  // kError: what was wrong, naming the option
};

// Parses the options after the command word.
ParseResult parse_args(const std::vector<std::string>& args);

// Number of sequences: B, or the entries of --cu-seqlens minus one.
int64_t sequence_count(const Config& c);

// Host bytes the `run` command allocates for the problem (every input, output and gradient, the
// reference's copies included), or an error naming the sizes when that does not fit in int64.
struct ProblemBytes {
  bool ok = false;
  int64_t bytes = 0;
  std::string error;
};
ProblemBytes problem_bytes(const Config& c);

}  // namespace gla::cli
