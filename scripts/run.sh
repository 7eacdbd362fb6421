#!/usr/bin/env bash
# Sets everything up, builds, and runs the main job: `gla run` (the default problem, forward and
# backward on the backend the dispatcher picks, checked against the reference backend).
# Arguments go to `gla run` (see `build/tools/gla run --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
exec build/tools/gla run "$@"
