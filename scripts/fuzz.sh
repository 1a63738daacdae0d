#!/usr/bin/env bash
# Run every cargo-fuzz target under tests/fuzz for N seconds each (default 60)
# and print, per target, the executions run and whether it crashed.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Needs a nightly toolchain (`rustup toolchain install nightly`) and
# cargo-fuzz (`cargo install cargo-fuzz`). Crashes are kept in
# tests/fuzz/artifacts/TARGET/; corpora in tests/fuzz/corpus/TARGET/.
set -euo pipefail
secs="${1:-60}"
shift || true
cd "$(dirname "$0")/.."
fz=(--fuzz-dir tests/fuzz)
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list "${fz[@]}")
fi
seed_corpus() {
  # Start each corpus from the wire fixtures (response bodies) or nothing.
  local t="$1" dir="tests/fuzz/corpus/$1"
  mkdir -p "$dir"
  [ -n "$(ls -A "$dir" 2>/dev/null)" ] && return
  case "$t" in
    sse|usage)
      for f in tests/fixtures/*/*.sse tests/fixtures/*/*.ndjson tests/fixtures/*/*.json; do
        [ -f "$f" ] || continue
        { printf '\x00'; cat "$f"; } > "$dir/$(basename "$(dirname "$f")")-$(basename "$f")"
      done ;;
    inspect|trim)
      printf '%s' '{"model":"gpt-4o","stream":true,"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"again"}]}' > "$dir/chat.json"
      printf '%s' '{"model":"claude-sonnet-4-5","max_tokens":64,"system":"s","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":"a"},{"role":"user","content":"b"}]}' > "$dir/anthropic.json"
      printf '%s' '{"contents":[{"role":"user","parts":[{"text":"hello"}]},{"role":"model","parts":[{"text":"x"}]},{"role":"user","parts":[{"text":"y"}]}]}' > "$dir/gemini.json" ;;
  esac
}
status=0
summary=()
for t in "${targets[@]}"; do
  seed_corpus "$t"
  log="$(mktemp)"
  if cargo +nightly fuzz run "${fz[@]}" "$t" "tests/fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 >"$log" 2>&1; then
    result="ok"
  else
    result="CRASH (see tests/fuzz/artifacts/$t/)"
    status=1
  fi
  execs="$(grep -Eo 'Done [0-9]+ runs' "$log" | grep -Eo '[0-9]+' | tail -1 || true)"
  [ -z "$execs" ] && execs="$(grep -Eo '#[0-9]+' "$log" | tail -1 | tr -d '#' || true)"
  summary+=("$t: ${execs:-?} executions in ${secs}s: $result")
  tail -5 "$log"
  rm -f "$log"
done
printf '%s\n' "${summary[@]}"
exit "$status"
