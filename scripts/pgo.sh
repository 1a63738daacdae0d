#!/usr/bin/env bash
# Make pgo/tidemark.profdata, the profile optimised builds are compiled with
# (scripts/rustc-wrapper), or check that it still fits the build.
#
#     bash scripts/pgo.sh                    # about 5 minutes on a 2-core box
#     bash scripts/pgo.sh --check [--strict] # builds the release binary and bench first
#
# Every crate is built instrumented (-C profile-generate) in target/pgo, the
# bench and the `tidemark` binary each by its own cargo command as a user
# builds them; the bench then runs every scenario against an in-process
# tidemark (small, streamed and 400 KB OpenAI requests, the path it does not
# read, cold histories), and the binary runs the demo (an OpenAI chat and an
# Anthropic session, streamed, over a growing history). Their counts are merged, sparse (a
# function never run is left out, so it is optimised as without a profile,
# not as cold), into pgo/tidemark.profdata.
#
# The profile matches a build only if the build's symbols are the ones it
# was made with: the same rustc (pgo/rustc-vV, which rust-toolchain.toml
# pins), and the same version and features of every crate. pgo/libtidemark
# names the library file that fixes both; `--check` compares it with the
# release binary's and bench's and checks the release library was compiled
# with the profile. When not (after a dependency update, another toolchain,
# or a dev-dependency that turns on a feature the library's crates did not
# have) the build is correct, only not profile-optimised: `--check` says so
# loudly and exits 0, so a dependency bump never fails the test command;
# `--strict` exits 1 instead (for a release pipeline). Run this script
# again then, and commit pgo/.
set -euo pipefail
cd "$(dirname "$0")/.."

# A build the profile does not fit: a note that is hard to miss, or with
# --strict a failure.
stale() {
    {
        echo "pgo: ================================================================"
        echo "pgo: NOTE: this release build is NOT profile-optimised."
        for line in "$@"; do echo "pgo: $line"; done
        echo "pgo: It is correct, only slower: the profile is worth 16-23% of the"
        echo "pgo: instructions a request (docs/history.md, 2026-12-07)."
        echo "pgo: To have it back: bash scripts/pgo.sh, then commit pgo/."
        echo "pgo: ================================================================"
    } >&2
    if [[ $strict == 1 ]]; then exit 1; fi
    exit 0
}

# The library file that `cargo build --release ARGS...` links, in target
# directory $1.
libfile() {
    CARGO_TARGET_DIR=$1 cargo build --release -q --message-format=json "${@:2}" |
        grep -o '"filenames":\["[^"]*/libtidemark-[0-9a-f]*\.rlib"' | sed 's|.*/||; s|"$||'
}

if [[ ${1:-} == --check ]]; then
    strict=0
    if [[ ${2:-} == --strict ]]; then strict=1; fi
    want=$(cat pgo/libtidemark)
    compiler=$(rustc -vV | sed -n 's/^release: //p')
    made=$(sed -n 's/^release: //p' pgo/rustc-vV)
    # The binary's library, and the bench's (an example, built with the
    # dev-dependencies): one file, or the bench trains other symbols. Its
    # hash covers the compiler's version too.
    for what in "--bin tidemark" "--example bench"; do
        have=$(libfile target $what)
        if [[ $have != "$want" ]]; then
            if [[ $compiler != "$made" ]]; then
                why="it is built by rustc $compiler; the profile fits rustc $made (rust-toolchain.toml)."
            else
                why="a dependency, feature or the library changed since the profile was made."
            fi
            stale "\`cargo build --release $what\` links $have," \
                "the profile was made for $want:" "$why"
        fi
    done
    # rustc lists the profile among the library's inputs when it used it:
    # the wrapper did its part.
    deps=target/release/deps/${want#lib}
    if ! grep -q "pgo/tidemark.profdata" "${deps%.rlib}.d"; then
        stale "$want was compiled without pgo/tidemark.profdata" \
            "(scripts/rustc-wrapper not used: RUSTC_WRAPPER set, or TIDEMARK_PGO=off?)."
    fi
    echo "pgo: the profile matches this build and was used ($want)"
    exit 0
fi

sysroot=$(rustc --print sysroot)
profdata=$(find "$sysroot" -name llvm-profdata -type f | head -n 1)
if [[ -z $profdata ]]; then
    rustup component add llvm-tools
    profdata=$(find "$sysroot" -name llvm-profdata -type f | head -n 1)
fi
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
export TIDEMARK_PGO=generate:$raw
# Apart from target/release: cargo does not see TIDEMARK_PGO.
lib=$(libfile target/pgo --bin tidemark)
if [[ $(libfile target/pgo --example bench) != "$lib" ]]; then
    echo "pgo: the bench links another library than the binary (a dev-dependency's feature?)" >&2
    exit 1
fi
target/pgo/release/examples/bench --secs 1 --repeat 1 --only tidemark,direct >/dev/null
target/pgo/release/tidemark demo >/dev/null
"$profdata" merge --sparse -o pgo/tidemark.profdata "$raw"
rustc -vV > pgo/rustc-vV
echo "$lib" > pgo/libtidemark
echo "pgo: pgo/tidemark.profdata for $lib ($(wc -c < pgo/tidemark.profdata) bytes)"
