// The `gla` command's argument handling: numbers parsed strictly, sizes whose buffers overflow
// int64 and allocations that fail are clear errors (exit status 2 for bad arguments, 1 for a
// problem the machine cannot hold), never a crash or a silently different problem.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace {

struct Result {
  int status = -1;  // exit status, or 128 + signal
  std::string output;
};

Result run_cli(const std::string& arguments, const std::string& prefix = "") {
  Result r;
  const std::string command = prefix + std::string(GLA_CLI) + " " + arguments + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return r;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, pipe)) r.output += buffer;
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

void expect_error(const std::string& arguments, int status, const std::string& phrase) {
  const Result r = run_cli(arguments);
  EXPECT_EQ(r.status, status) << arguments << "\n" << r.output;
  EXPECT_NE(r.output.find(phrase), std::string::npos) << arguments << "\n" << r.output;
}

TEST(Cli, NumbersAreParsedStrictly) {
  // Used to run silently as --cu-seqlens 0,0,10.
  expect_error("run --cu-seqlens 0,abc,10", 2, "--cu-seqlens: expected comma-separated non-negative integers, got 'abc'");
  expect_error("run --cu-seqlens 0,,10", 2, "got '' in '0,,10'");
  expect_error("run --cu-seqlens 0,5,-3", 2, "got '-3'");
  expect_error("run --T 12x", 2, "--T: expected an integer from 0 to 9223372036854775807, got '12x'");
  expect_error("run --T ' 12'", 2, "got ' 12'");
  expect_error("run --T 99999999999999999999", 2, "got '99999999999999999999'");
  expect_error("run --H -1", 2, "--H: expected an integer");
  expect_error("run --seed 4294967296", 2, "--seed: expected an integer from 0 to 4294967295");
  expect_error("run --repeat 0", 2, "--repeat: expected an integer from 1 to 1000000");
  expect_error("run --K", 2, "--K: expected a value");
}

TEST(Cli, SizesWhoseBuffersOverflowAreErrors) {
  // Used to crash (SIGSEGV) on a wrapped allocation size.
  expect_error("run --T 4611686018427387904", 2, "problem too large: B=2 T=4611686018427387904");
  expect_error("explain --B 1 --T 4294967296 --H 4294967296", 2, "overflow int64");
}

TEST(Cli, ProblemsLargerThanTheMachineAreErrors) {
  // Used to abort on an uncaught std::bad_alloc.
  expect_error("run --K 100000000", 1, "bytes of host memory, more than this machine's");
}

TEST(Cli, FailedAllocationIsAnError) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "address-space limits (ulimit -v) do not combine with sanitizer shadow memory";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  GTEST_SKIP() << "address-space limits (ulimit -v) do not combine with sanitizer shadow memory";
#endif
#endif
  // 2 GB of buffers under a 1 GB address-space limit: the allocation fails inside the command.
  const Result r = run_cli("run --B 1 --T 100000 --H 4 --K 64 --V 64", "ulimit -v 1000000; ");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("gla: cannot allocate the problem's buffers (2048524288 bytes"), std::string::npos) << r.output;
}

TEST(Cli, ValidArgumentsStillRun) {
  const Result r = run_cli("run --B 1 --T 70 --H 1 --K 8 --V 8 --cu-seqlens 0,30,70 --repeat 1");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("problem: chunk B=1 T=70 H=1 K=8 V=8 N=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("PASS"), std::string::npos) << r.output;
}

// The cpu backend's thread pool is as large as the CPU affinity mask (taskset), not the machine's
// CPU count; GLA_NUM_THREADS still overrides. The plan line of explain reports "... of N threads".
TEST(Cli, CpuThreadsFollowTheAffinityMask) {
#if defined(__linux__)
  if (std::system("command -v taskset > /dev/null 2>&1") != 0) GTEST_SKIP() << "taskset not found: cannot pin the CLI";
  cpu_set_t mask;
  CPU_ZERO(&mask);
  ASSERT_EQ(sched_getaffinity(0, sizeof mask, &mask), 0);
  if (std::thread::hardware_concurrency() < 2) {
    GTEST_SKIP() << "one CPU online: a mask of one CPU cannot be told from the CPU count here";
  }
  int first = 0;
  while (!CPU_ISSET(first, &mask)) ++first;
  const std::string explain = "explain --backend cpu --B 1 --T 64 --H 8 --K 16 --V 16";
  const std::string unset = "env -u GLA_NUM_THREADS ";
  const std::string pin = "taskset -c " + std::to_string(first) + " ";
  const Result pinned = run_cli(explain, unset + pin);
  ASSERT_EQ(pinned.status, 0) << pinned.output;
  EXPECT_NE(pinned.output.find("on 1 of 1 threads (GLA_NUM_THREADS, else the CPUs this process may run on)"),
            std::string::npos) << pinned.output;
  const Result free = run_cli(explain, unset);
  ASSERT_EQ(free.status, 0) << free.output;
  EXPECT_NE(free.output.find(" of " + std::to_string(CPU_COUNT(&mask)) + " threads"), std::string::npos) << free.output;
  const Result forced = run_cli(explain, "GLA_NUM_THREADS=3 " + pin);
  ASSERT_EQ(forced.status, 0) << forced.output;
  EXPECT_NE(forced.output.find("on 3 of 3 threads"), std::string::npos) << forced.output;
#else
  GTEST_SKIP() << "CPU affinity masks are read on Linux only";
#endif
}

}  // namespace

namespace {

// `gla tune` measures in one process and writes GLA_TUNE_FILE; `gla explain` with the `fastest`
// policy in another reads the winner and its times from it.
TEST(Cli, TuneWritesTheFileThatALaterProcessReads) {
  const std::string path = ::testing::TempDir() + "gla_cli_tune.txt";
  std::remove(path.c_str());
  const std::string problem = "--B 1 --T 130 --H 2 --K 16 --V 16";
  const Result tuned = run_cli("tune " + problem, "GLA_TUNE_FILE=" + path + " ");
  ASSERT_EQ(tuned.status, 0) << tuned.output;
  EXPECT_NE(tuned.output.find("== forward"), std::string::npos) << tuned.output;
  EXPECT_NE(tuned.output.find("<- winner"), std::string::npos) << tuned.output;
  EXPECT_NE(tuned.output.find("reference: "), std::string::npos) << tuned.output;
  for (const char* which : {"", " --backward"}) {
    const Result later = run_cli("explain " + problem + which, "GLA_TUNE_FILE=" + path + " GLA_POLICY=fastest ");
    ASSERT_EQ(later.status, 0) << later.output;
    EXPECT_NE(later.output.find("measured (read from GLA_TUNE_FILE"), std::string::npos) << which << later.output;
    EXPECT_NE(later.output.find("<- winner"), std::string::npos) << later.output;
  }
  expect_error("tune --backend cpu " + problem, 2, "tune: --backend and --stage-pipeline fix the choice it measures");
  std::remove(path.c_str());
}

}  // namespace
