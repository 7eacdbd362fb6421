// The `fastest` policy's memory: per problem signature, the candidates that were timed, their times
// and the winner. Process-wide and thread-safe; a signature is measured once even when many threads
// meet it first at the same moment (the others wait for that measurement). With GLA_TUNE_FILE set
// the records are read from that file at first use and the file is rewritten after each new
// measurement, so a later process (or production, after `gla tune`) never pays for it. At most
// kMaxTuneRecords records are kept, in memory and in the file: the least recently used goes first.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "gla/gla.h"

namespace gla {

struct TuneRecord {
  std::vector<std::string> candidates;  // labels in priority order
  std::vector<double> ms;               // minimum measured time per candidate (< 0: the run failed)
  std::string winner;
  bool from_file = false;
};

// The signature of a validated whole-operation problem: unit, device, dtypes, gate form, shape
// bucket (H, K, V exact; B*T and N rounded up to powers of two) and the flags that change the work
// (states, varlen, state layout, which gradients, the recurrent gates and direction).
std::string tune_signature(const gla_problem& problem);

// First candidate (in priority order) within 5% of the fastest: ties follow priority. -1 if every
// run failed.
int tune_winner(const std::vector<double>& ms);

class Tuner {
 public:
  static Tuner& instance();

  // The record for `signature` if one exists whose candidates are exactly `candidates`.
  bool lookup(const std::string& signature, const std::vector<std::string>& candidates, TuneRecord& out);
  // The record, measuring it with `measure` when there is none for these candidates (or `remeasure`).
  // Concurrent callers for one signature wait for the first one's measurement.
  TuneRecord get_or_measure(const std::string& signature, const std::vector<std::string>& candidates,
                            const std::function<TuneRecord()>& measure, bool remeasure);
  // Forgets every record (tests; the file is left alone).
  void clear();
  // Records kept now (at most kMaxTuneRecords).
  size_t size();

 private:
  struct Slot {
    TuneRecord record;
    uint64_t used = 0;  // use_clock_ at the last measurement, load or use
  };
  Tuner();
  void load_file();  // all called with mutex_ held
  void save_file();
  // Stores the record, dropping the least recently used beyond kMaxTuneRecords.
  void keep(const std::string& signature, const TuneRecord& record);

  std::mutex mutex_;
  std::condition_variable done_;
  std::map<std::string, Slot> records_;
  uint64_t use_clock_ = 0;
  bool drop_reported_ = false;  // the first drop from path_ has been reported on stderr
  std::set<std::string> in_flight_;
  std::string path_;     // the GLA_TUNE_FILE the records came from ("" = none)
  bool loaded_ = false;  // path_ has been read
};

// Records kept per process and per GLA_TUNE_FILE. Each is a few hundred bytes; unbounded, a fuzzing
// run of the C ABI grew by ~100 MB per million distinct signatures. Least recently used is dropped
// (not all at once, as the cuda plan cache does at 1024): the signatures a process keeps meeting stay
// measured, and a file keeps the ones still in use. A dropped signature is measured again if met again.
inline constexpr size_t kMaxTuneRecords = 1024;

// Format of GLA_TUNE_FILE; a file of another format or library version is ignored (with a warning).
inline constexpr int kTuneFileFormat = 1;

}  // namespace gla
