/* Switches callgrind's instrumentation on and off from a running program (a no-op outside
 * valgrind), so that python_overhead.py --row counts only its measured calls, not Python's start-up
 * and torch's import (~5.7G instructions, minutes under callgrind). Not part of the build:
 *   cc -O2 -shared -fPIC -o /tmp/callgrind_toggle.so bench/callgrind_toggle.c
 * (needs valgrind's headers: Debian package valgrind). */
#include <valgrind/callgrind.h>

void callgrind_start(void) {
  CALLGRIND_ZERO_STATS;
  CALLGRIND_START_INSTRUMENTATION;
}

void callgrind_stop(void) {
  CALLGRIND_STOP_INSTRUMENTATION;
  CALLGRIND_DUMP_STATS_AT("measured calls");
}
