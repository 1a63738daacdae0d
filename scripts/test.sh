#!/usr/bin/env bash
# The whole test run, on a fresh machine: installs what tests need beyond
# cargo (Python SDK clients into target/venv, redis-server, the pinned coding
# agents and Node when missing via scripts/agents.sh, chromium and
# playwright-core into target/browser via scripts/browser.sh; Prometheus and
# docker-compose are installed by scripts/check-prometheus.sh, which the
# metrics test runs), then runs every test. Used by README and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never

# The compiler. rust-toolchain.toml pins the one pgo/'s profile was made
# with, and rustup installs it where it is missing, unless it cannot
# (offline, or RUSTUP_AUTO_INSTALL=0). Then an installed toolchain that is
# that very compiler (the same `rustc -vV`) stands in for it, or else the
# default one: a correct build, only not profile-optimised (scripts/pgo.sh
# --check says so at the end).
if command -v rustup >/dev/null && ! cargo --version >/dev/null 2>&1; then
    use=
    for t in $(rustup toolchain list | cut -d' ' -f1); do
        if [ "$(rustup run "$t" rustc -vV 2>/dev/null)" = "$(cat pgo/rustc-vV)" ]; then
            use=$t
            break
        fi
    done
    export RUSTUP_TOOLCHAIN=${use:-$(rustup default | cut -d' ' -f1)}
    echo "test.sh: rust-toolchain.toml's toolchain is not installed here; building with $RUSTUP_TOOLCHAIN" >&2
fi
# Property tests: more cases in CI than in a quick local run, still bounded.
if [ "${CI:-}" = "true" ]; then export PROPTEST_CASES="${PROPTEST_CASES:-2000}"; fi

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# The official SDKs, as clients of the end-to-end policy tests, and the
# official OTLP protobuf definitions, which the OpenTelemetry tests'
# collector (tests/otel/collector.py) decodes with, in a
# virtual environment of the project's own: stock Debian 12 and Ubuntu 24.04
# refuse `pip install` outside one (PEP 668) and come without python3-venv.
# The tests run this interpreter (TIDEMARK_PYTHON; tests/sdk_python.rs
# falls back to target/venv/bin/python, then python3). `realtime` brings
# the websockets client of `client.responses.connect()` (tests/agents.rs).
VENV=target/venv
if ! "$VENV/bin/python" -c 'import openai, anthropic, websockets, opentelemetry.proto' 2>/dev/null; then
    command -v python3 >/dev/null || apt_install python3
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        # Without ensurepip (python3-venv) venv fails half-way: start over.
        rm -rf "$VENV"
        apt_install python3-venv
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'openai[realtime]' anthropic opentelemetry-proto
fi
export TIDEMARK_PYTHON="$PWD/$VENV/bin/python"
# A real Redis for the shared-state tests.
if ! command -v redis-server >/dev/null; then
    apt_install redis-server
fi
# Debian's Chromium and playwright-core (target/browser) for the sessions
# page's browser test, tests/page.rs.
bash scripts/browser.sh

# Claude Code, Codex CLI, opencode and Gemini CLI, pinned, into
# target/agents (and Node into target/venv when the machine has none), for
# tests/agents.rs.
bash scripts/agents.sh

cargo build --tests --all-targets
cargo test --all-targets -- --test-threads=2

# The SSE scanner and every provider's parser under 100,000 random inputs and
# chunkings each (issue 3's fuzz bar; cargo-fuzz targets: scripts/fuzz.sh).
PROPTEST_CASES=100000 cargo test --test usage_fixtures -- readers_never_panic scanner_random

# The README's main command, with a short script.
cargo run --release -- demo --turns 6

# The release build above was compiled with pgo/'s profile only if it still
# names this build's functions (a dependency update or another toolchain
# renames them all). Such a build is correct, only slower: a loud note, not
# a failure (`--check --strict` fails instead).
bash scripts/pgo.sh --check
