#!/usr/bin/env bash
# The whole test run, on a fresh machine: installs what tests need beyond
# cargo, then runs every test. Used by README and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
# Property tests: many cases in CI, fewer by default elsewhere.
if [ "${CI:-}" = "true" ]; then export PROPTEST_CASES="${PROPTEST_CASES:-100000}"; fi

cargo build --tests --all-targets
cargo test --all-targets -- --test-threads=2
