#include "core/tuner.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/environment.hpp"
#include "core/tensor.hpp"

namespace gla {

namespace {

int64_t bucket(int64_t x) {
  int64_t b = 1;
  while (b < x) b <<= 1;
  return b;
}

bool plain_name(const std::string& s) { return !s.empty() && s.find_first_of("\t\n\r") == std::string::npos; }

// Erases the least recently used record (a scan: at most kMaxTuneRecords + 1 entries, once per new
// measurement, next to the several timed runs that measurement took).
template <class Map>
void erase_least_recent(Map& records) {
  auto oldest = records.begin();
  for (auto it = records.begin(); it != records.end(); ++it) {
    if (it->second.used < oldest->second.used) oldest = it;
  }
  records.erase(oldest);
}

}  // namespace

std::string tune_signature(const gla_problem& p) {
  std::ostringstream s;
  s << gla_unit_name(p.unit) << " dev=" << device_type_name(p.device_type) << ':' << p.device_index
    << " dtype=" << dtype_name(p.dtype) << " gate=" << (p.gate_per_head ? "head:" : "key:") << dtype_name(p.gate_dtype)
    << " BT~" << bucket(p.B * p.T) << " N~" << bucket(p.N) << " H=" << p.H << " K=" << p.K << " V=" << p.V;
  const std::pair<const char*, const gla_tensor*> flags[] = {
      {"h0", &p.initial_state}, {"ht", &p.final_state}, {"cs", &p.h},   {"do", &p.do_}, {"dht", &p.dht},
      {"dq", &p.dq},            {"dk", &p.dk},          {"dv", &p.dv},  {"dg", &p.dg},  {"dh0", &p.dh0},
      {"gv", &p.gv},            {"dgv", &p.dgv},        {"ts", &p.token_states}};
  s << " +";
  for (const auto& [name, t] : flags) {
    if (present(*t)) s << name << ',';
  }
  const bool recurrent = p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD;
  if (recurrent && present(p.g)) s << "gk,";  // the chunked operator always has its gate
  if (p.varlen) s << "varlen,";
  if (p.state_v_first) s << "vfirst,";
  if (p.reverse) s << "reverse,";
  if (present(p.dg)) s << "dg:" << dtype_name(p.dg.dtype) << ',';
  return s.str();
}

int tune_winner(const std::vector<double>& ms) {
  double best = -1;
  for (double t : ms) {
    if (t >= 0 && (best < 0 || t < best)) best = t;
  }
  if (best < 0) return -1;
  for (size_t i = 0; i < ms.size(); ++i) {
    if (ms[i] >= 0 && ms[i] <= best * 1.05) return static_cast<int>(i);
  }
  return -1;
}

Tuner& Tuner::instance() {
  static Tuner* tuner = new Tuner();
  return *tuner;
}

Tuner::Tuner() = default;

namespace {
// The file named by GLA_TUNE_FILE ("" = none).
std::string tune_path() { return environment().tune_file; }
}  // namespace

// Called with mutex_ held: when GLA_TUNE_FILE names another file than the records came from, they
// are replaced by that file's.
void Tuner::load_file() {
  const std::string path = tune_path();
  if (path == path_ && loaded_) return;
  path_ = path;
  loaded_ = true;
  drop_reported_ = false;
  records_.clear();
  if (path_.empty()) return;
  std::ifstream in(path_);
  if (!in) return;  // no file yet: the first measurement writes it
  auto ignore = [&](const std::string& why) {
    std::fprintf(stderr, "[gla] GLA_TUNE_FILE '%s' ignored (%s); it is rewritten at the next measurement\n",
                 path_.c_str(), why.c_str());
    records_.clear();
  };
  std::string line;
  int number = 0;
  bool header = false;
  std::map<std::string, Slot> read;
  long beyond_bound = 0;  // records past kMaxTuneRecords (a file not written by this bound): not kept
  while (std::getline(in, line)) {
    ++number;
    if (line.empty() || line[0] == '#') continue;
    if (!header) {
      std::istringstream h(line);
      std::string magic, version;
      int format = 0;
      if (!(h >> magic >> format >> version) || magic != "libgla-tune") return ignore("line " + std::to_string(number) + ": not a libgla tuning file");
      if (format != kTuneFileFormat) {
        return ignore("format " + std::to_string(format) + ", this libgla reads format " + std::to_string(kTuneFileFormat));
      }
      if (version != gla_version()) return ignore("written by libgla " + version + ", this is " + gla_version() + ": stale");
      header = true;
      continue;
    }
    // signature \t winner \t count \t (label \t ms) x count
    std::vector<std::string> fields;
    std::stringstream f(line);
    std::string field;
    while (std::getline(f, field, '\t')) fields.push_back(field);
    TuneRecord r;
    r.from_file = true;
    char* end = nullptr;
    const long count = fields.size() >= 3 ? std::strtol(fields[2].c_str(), &end, 10) : -1;
    if (count < 1 || !end || *end || fields.size() != 3 + 2 * static_cast<size_t>(count)) {
      return ignore("line " + std::to_string(number) + ": malformed record");
    }
    r.winner = fields[1];
    bool winner_listed = false;
    for (long i = 0; i < count; ++i) {
      const std::string& label = fields[3 + 2 * i];
      const double ms = std::strtod(fields[4 + 2 * i].c_str(), &end);
      if (!plain_name(label) || !end || *end) return ignore("line " + std::to_string(number) + ": malformed time");
      r.candidates.push_back(label);
      r.ms.push_back(ms);
      winner_listed = winner_listed || label == r.winner;
    }
    if (!winner_listed) return ignore("line " + std::to_string(number) + ": winner is not among the candidates");
    // Lines are written least recently used first, so a later line is the more recent.
    read[fields[0]] = Slot{std::move(r), ++use_clock_};
    if (read.size() > kMaxTuneRecords) {
      erase_least_recent(read);
      ++beyond_bound;
    }
  }
  if (!header) return ignore("no header line");
  if (beyond_bound > 0) {
    std::fprintf(stderr,
                 "[gla] GLA_TUNE_FILE '%s' holds more than %zu records: the %ld first (least recently used) are "
                 "not read, and leave the file at the next measurement\n",
                 path_.c_str(), kMaxTuneRecords, beyond_bound);
  }
  records_ = std::move(read);
}

void Tuner::save_file() {
  if (path_.empty()) return;
  std::ostringstream out;
  out << "# libgla tuning records of the `fastest` policy (GLA_TUNE_FILE): signature, winner, candidates and ms\n"
      << "libgla-tune " << kTuneFileFormat << ' ' << gla_version() << '\n';
  // Least recently used first: the next process reads recency back from the order.
  std::vector<const std::pair<const std::string, Slot>*> order;
  for (const auto& entry : records_) order.push_back(&entry);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->second.used < b->second.used; });
  for (const auto* entry : order) {
    const std::string& signature = entry->first;
    const TuneRecord& r = entry->second.record;
    bool ok = plain_name(signature);
    for (const auto& c : r.candidates) ok = ok && plain_name(c);
    if (!ok) continue;  // a name with a tab or newline cannot be written; measured again next process
    out << signature << '\t' << r.winner << '\t' << r.candidates.size();
    char ms[32];
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      std::snprintf(ms, sizeof ms, "%.6g", r.ms[i]);
      out << '\t' << r.candidates[i] << '\t' << ms;
    }
    out << '\n';
  }
  // Written beside the target and renamed over it: a reader never sees half a file.
  const std::string temporary = path_ + ".tmp." + std::to_string(getpid());
  {
    std::ofstream file(temporary, std::ios::trunc);
    file << out.str();
    if (!file.flush()) {
      std::fprintf(stderr, "[gla] GLA_TUNE_FILE '%s': cannot write %s (records kept in this process only)\n",
                   path_.c_str(), temporary.c_str());
      std::remove(temporary.c_str());
      return;
    }
  }
  if (std::rename(temporary.c_str(), path_.c_str()) != 0) {
    std::fprintf(stderr, "[gla] GLA_TUNE_FILE '%s': cannot replace it (records kept in this process only)\n", path_.c_str());
    std::remove(temporary.c_str());
  }
}

bool Tuner::lookup(const std::string& signature, const std::vector<std::string>& candidates, TuneRecord& out) {
  std::lock_guard lock(mutex_);
  load_file();
  auto it = records_.find(signature);
  if (it == records_.end() || it->second.record.candidates != candidates) return false;
  it->second.used = ++use_clock_;
  out = it->second.record;
  return true;
}

TuneRecord Tuner::get_or_measure(const std::string& signature, const std::vector<std::string>& candidates,
                                 const std::function<TuneRecord()>& measure, bool remeasure) {
  {
    std::unique_lock lock(mutex_);
    load_file();
    for (;;) {
      if (in_flight_.count(signature)) {
        done_.wait(lock);
        remeasure = false;  // the measurement just made is the one asked for
        load_file();
        continue;
      }
      auto it = records_.find(signature);
      if (!remeasure && it != records_.end() && it->second.record.candidates == candidates) {
        it->second.used = ++use_clock_;
        return it->second.record;
      }
      in_flight_.insert(signature);
      break;
    }
  }
  TuneRecord record;
  try {
    record = measure();
  } catch (...) {
    std::lock_guard lock(mutex_);
    in_flight_.erase(signature);
    done_.notify_all();
    throw;
  }
  std::lock_guard lock(mutex_);
  in_flight_.erase(signature);
  keep(signature, record);
  save_file();
  done_.notify_all();
  return record;
}

void Tuner::keep(const std::string& signature, const TuneRecord& record) {
  records_[signature] = Slot{record, ++use_clock_};
  while (records_.size() > kMaxTuneRecords) {
    if (!path_.empty() && !drop_reported_) {
      std::fprintf(stderr,
                   "[gla] fastest: more than %zu signatures measured; the least recently used records are dropped, "
                   "from GLA_TUNE_FILE '%s' too (reported once per file)\n",
                   kMaxTuneRecords, path_.c_str());
      drop_reported_ = true;
    }
    erase_least_recent(records_);
  }
}

size_t Tuner::size() {
  std::lock_guard lock(mutex_);
  load_file();
  return records_.size();
}

void Tuner::clear() {
  std::lock_guard lock(mutex_);
  records_.clear();
  loaded_ = false;
}

}  // namespace gla
