#!/usr/bin/env bash
# User-space instructions per request, proxy by proxy, on the bench's small
# rows: a count callgrind makes the same on a busy machine as on a quiet one,
# where requests/s on this shared 2-core box swings by 5-10% from run to run.
# A change too small for examples/bench to see shows here.
#
#     BENCH=/tmp/bench.old bash scripts/instructions.sh tidemark
#
#     bash scripts/instructions.sh [tidemark,tap-off,untapped,nginx] [small|stream]
#
# `stream` counts the 20-chunk stream rows instead of the small ones.
# Each target runs twice under callgrind, for SHORT (3) and LONG (9)
# seconds; instructions per request are the difference of the two runs'
# totals over the difference of their requests, so start-up (the tokenizer's
# tables, nginx's configuration) cancels out. Counted: tidemark's worker
# threads, or nginx's one process (`--nginx-one-process`). Valgrind hides
# the SHA-NI instructions, so SHA-256 (a credential's hash, made once per
# credential and worker thread; the bench sends none) runs in software
# here and costs several times what it does on the hardware: its share is
# printed apart. About 2 minutes for the
# four targets after the build.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
want=${1:-tidemark,tap-off,untapped,nginx}
row=${2:-small}
case $row in
    small) rows=('small non-stream, 32' 'small non-stream, untapped') ;;
    stream) rows=('20-chunk stream, 32' '20-chunk stream, untapped') ;;
    *) echo "row: small or stream, not $row" >&2; exit 2 ;;
esac
if [[ ,$want, == *,nginx,* ]] && ! command -v nginx >/dev/null; then
    apt-get install -y -qq nginx-light >/dev/null
fi
# BENCH=path counts a bench binary kept from another build (two builds
# compared in turn) instead of building this tree's.
if [[ -n ${BENCH:-} ]]; then
    bin=$(realpath "$BENCH")
else
    cargo build --release --example bench
    bin=$PWD/target/release/examples/bench
fi
short=${SHORT:-3}
long=${LONG:-9}

# run SCENARIO TARGET SECS: "requests instructions sha256-instructions"
run() {
    local dir
    dir=$(mktemp -d)
    (cd "$dir" && valgrind --tool=callgrind --trace-children=yes --separate-threads=yes \
        "$bin" --secs "$3" --warmup 0 --scenario "$1" --only "$2" --nginx-one-process \
        >run.log 2>vg.err)
    local rps ins=0 sha=0 f n
    rps=$(grep "^${1%%,*}" "$dir/run.log" | awk -v t="$2" '{for (i = 1; i < NF; i++) if ($i == t) print $(i + 1)}')
    for f in "$dir"/callgrind.out.*; do
        if [[ $2 == nginx ]]; then
            grep -q '^cmd:.*nginx -c' "$f" || continue
        else
            grep -q 'tidemark::proxy::handle' "$f" || continue
        fi
        n=$(grep -m1 '^summary:' "$f" | awk '{print $2}')
        ins=$((ins + n))
        n=$(callgrind_annotate --inclusive=yes --show-percs=no "$f" 2>/dev/null |
            awk '/sha2::sha256::compress256 \[/ && !n {gsub(",", "", $1); print $1; n = 1}')
        sha=$((sha + ${n:-0}))
    done
    rm -rf "$dir"
    if [[ -z $rps || $ins == 0 ]]; then
        echo "no $2 cell or no $2 profile in the run" >&2
        exit 1
    fi
    echo "$((rps * $3)) $ins $sha"
}

printf '%-10s %-28s %10s %18s\n' target scenario instr/req 'of which SHA-256'
for t in ${want//,/ }; do
    case $t in
        untapped) scenario=${rows[1]} target=tidemark ;;
        *) scenario=${rows[0]} target=$t ;;
    esac
    read -r n1 i1 s1 < <(run "$scenario" "$target" "$short")
    read -r n2 i2 s2 < <(run "$scenario" "$target" "$long")
    if [[ -z ${n1:-} || -z ${n2:-} ]]; then
        exit 1
    fi
    if ((n2 <= n1)); then
        echo "$t: the long run served no more requests than the short one" >&2
        exit 1
    fi
    printf '%-10s %-28s %10d %18d\n' "$t" "$scenario" $(((i2 - i1) / (n2 - n1))) $(((s2 - s1) / (n2 - n1)))
done
