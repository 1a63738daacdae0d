#!/usr/bin/env bash
# The whole test run, on a fresh machine: installs what tests need beyond
# cargo (Python SDK clients, redis-server; Prometheus and docker-compose are
# installed by scripts/check-prometheus.sh, which the metrics test runs), then
# runs every test. Used by README and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
# Property tests: more cases in CI than in a quick local run, still bounded.
if [ "${CI:-}" = "true" ]; then export PROPTEST_CASES="${PROPTEST_CASES:-2000}"; fi

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# The official SDKs, as clients of the end-to-end policy tests.
if ! python3 -c 'import openai, anthropic' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check openai anthropic
fi
# A real Redis for the shared-state tests.
if ! command -v redis-server >/dev/null; then
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

cargo build --tests --all-targets
cargo test --all-targets -- --test-threads=2

# The SSE scanner and every provider's parser under 100,000 random inputs and
# chunkings each (issue 3's fuzz bar; cargo-fuzz targets: scripts/fuzz.sh).
PROPTEST_CASES=100000 cargo test --test usage_fixtures -- readers_never_panic scanner_random

# The README's main command, with a short script.
cargo run --release -- demo --turns 6

# The release build above was compiled with pgo/'s profile only if it still
# names this build's functions (a dependency update or a new toolchain
# renames them all): fail rather than ship a build that silently lost it.
bash scripts/pgo.sh --check
