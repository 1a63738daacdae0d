#!/usr/bin/env bash
# Runs each pinned coding agent against the capture provider (capture.mjs),
# scenario by scenario, offline and with a throwaway HOME, and writes what it
# sent to target/capture/raw/<agent>/<scenario>/ with run.json (commands,
# config, exit codes, wall-clock seconds). scripts/capture/sanitize.py turns
# that into tests/fixtures/agents/. A dev tool: how those fixtures were made.
#
#   scripts/capture/run.sh [claude-code|codex|opencode|gemini ...]   (default: all)
#   STRACE=1 scripts/capture/run.sh ...   also records the DNS names each run
#                                          looks up (outside hosts it tries)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
[ -f target/agents/env.sh ] || bash scripts/agents.sh >/dev/null
# shellcheck disable=SC1091
. target/agents/env.sh
out=$root/target/capture
# HOMEs (and the agents' working dirs) outside any git repository: inside this
# one, Claude Code puts the repo's git status into the first user message and
# the others describe the repository too.
homes=$(mktemp -d /tmp/tidemark-capture.XXXXXX)
trap 'rm -rf "$homes"' EXIT
agents=("$@")
[ ${#agents[@]} -gt 0 ] || agents=(claude-code codex opencode gemini)

version() { node -p "require('$root/tests/agents/package.json').dependencies['$1']"; }

# start_capture DIR [capture args...]: sets PORT and CAP_PID.
start_capture() {
    local dir=$1; shift
    rm -rf "$dir"; mkdir -p "$dir"
    node scripts/capture/capture.mjs --out "$dir/requests" "$@" >"$dir/capture.stdout" 2>"$dir/capture.log" &
    CAP_PID=$!
    for _ in $(seq 100); do grep -q listening "$dir/capture.stdout" 2>/dev/null && break; sleep 0.05; done
    PORT=$(sed 's#.*:##' "$dir/capture.stdout")
    [ -n "$PORT" ] || { echo "capture server did not start" >&2; exit 1; }
}
stop_capture() { kill "$CAP_PID" 2>/dev/null || true; wait "$CAP_PID" 2>/dev/null || true; }

# scenario AGENT NAME: a fresh HOME (and work dir, the cwd of every step).
scenario() {
    AGENT=$1; NAME=$2
    DIR=$out/raw/$AGENT/$NAME
    HOME_DIR=$homes/$AGENT/$NAME
    rm -rf "$HOME_DIR"; mkdir -p "$HOME_DIR/work"
    STEPS=()
    echo "== $AGENT/$NAME" >&2
}

# step LABEL ENV... -- CMD...: runs CMD in the work dir with only ENV (plus
# PATH, TERM) set, timed; the outcome goes into run.json.
step() {
    local label=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local n=$(( ${#STEPS[@]} + 1 )) st=() t0 t1 rc
    if [ -n "${STRACE:-}" ]; then st=(strace -f -qq -s 300 -xx -e trace=sendto,sendmmsg,sendmsg -o "$DIR/strace.$n"); fi
    t0=$(date +%s%N)
    set +e
    (cd "$HOME_DIR/work" && env -i PATH="$PATH" TERM=dumb HOME="$HOME_DIR" "${envs[@]}" \
        "${st[@]}" timeout 180 "$@" >"$DIR/step$n.stdout" 2>"$DIR/step$n.stderr" </dev/null)
    rc=$?
    set -e
    t1=$(date +%s%N)
    local secs
    secs=$(awk "BEGIN{printf \"%.2f\", ($t1-$t0)/1e9}")
    echo "   $label: rc=$rc ${secs}s" >&2
    STEPS+=("$(node -e 'console.log(JSON.stringify({label:process.argv[1],env:process.argv[2].split("\n").filter(Boolean),argv:JSON.parse(process.argv[3]),exit:+process.argv[4],seconds:+process.argv[5]}))' \
        "$label" "$(printf '%s\n' "${envs[@]}")" "$(node -e 'console.log(JSON.stringify(process.argv.slice(1)))' -- "$@")" "$rc" "$secs")")
}

# finish: run.json (agent, version, steps, config files, DNS names looked up).
finish() {
    local pkg=$1; shift
    stop_capture
    local steps
    steps=$(printf '%s\n' "${STEPS[@]}" | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.stringify(s.trim().split("\n").map(JSON.parse))))')
    DIR="$DIR" HOME_DIR="$HOME_DIR" AGENT="$AGENT" NAME="$NAME" VERSION="$(version "$pkg")" STEPS="$steps" \
        python3 - "$@" <<'EOF'
import json, os, re, sys, glob
d = os.environ["DIR"]
names = set()
# DNS queries in strace's hex dump of sendto/sendmmsg: 12-byte header, then
# length-prefixed labels.
for f in glob.glob(os.path.join(d, "strace.*")):
    for line in open(f, errors="replace"):
        for s in re.findall(r'"((?:\\x[0-9a-f]{2})+)"', line):
            b = bytes.fromhex(s.replace("\\x", ""))
            i, labels = 12, []
            while i < len(b) and b[i] and i + 1 + b[i] <= len(b):
                labels.append(b[i + 1:i + 1 + b[i]].decode("latin1")); i += 1 + b[i]
            if len(labels) > 1 and all(re.fullmatch(r"[A-Za-z0-9-]+", x) for x in labels):
                names.add(".".join(labels))
    os.remove(f)
configs = {}
for rel in sys.argv[1:]:
    p = os.path.join(os.environ["HOME_DIR"], rel)
    if os.path.exists(p):
        configs[rel] = open(p).read()
run = {
    "agent": os.environ["AGENT"], "version": os.environ["VERSION"], "scenario": os.environ["NAME"],
    "home": os.environ["HOME_DIR"], "steps": json.loads(os.environ["STEPS"]), "config_files": configs,
}
if names or glob.glob(os.path.join(d, "strace.*")) or os.environ.get("STRACE"):
    run["dns_names_looked_up"] = sorted(names)
json.dump(run, open(os.path.join(d, "run.json"), "w"), indent=2)
EOF
}

want() { local a; for a in "${agents[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }

if want claude-code; then
    claude=$(command -v claude)
    quiet=(CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1)
    scenario claude-code continue
    start_capture "$DIR"
    base=(ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=sk-ant-capture-0000)
    step 'claude -p' "${base[@]}" "${quiet[@]}" -- "$claude" -p "say hi"
    step 'claude -c -p' "${base[@]}" "${quiet[@]}" -- "$claude" -c -p "again"
    step 'claude -c -p' "${base[@]}" "${quiet[@]}" -- "$claude" -c -p "again"
    finish @anthropic-ai/claude-code

    # The first answer calls the Agent tool: Claude Code starts a sub-agent
    # (in the background) under the same session id, with its own system prompt.
    scenario claude-code subagent
    start_capture "$DIR" --anthropic-tool Agent \
        --anthropic-tool-input '{"description":"Count to three","prompt":"count to three","subagent_type":"general-purpose"}'
    base=(ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=sk-ant-capture-0000)
    step 'claude -p (main calls Agent)' "${base[@]}" "${quiet[@]}" -- "$claude" -p "say hi"
    step 'claude -c -p' "${base[@]}" "${quiet[@]}" -- "$claude" -c -p "again"
    finish @anthropic-ai/claude-code

    # What a user who sets only the base URL and key gets: a HEAD /api/hello
    # before every run and lookups of the vendor's hosts.
    scenario claude-code default-env
    start_capture "$DIR"
    base=(ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=sk-ant-capture-0000)
    step 'claude -p' "${base[@]}" -- "$claude" -p "say hi"
    finish @anthropic-ai/claude-code
fi

if want codex; then
    codex=$(command -v codex)
    # codex_config [LINE]: the quiet config, LINE (a top-level key) first.
    codex_config() {
        mkdir -p "$HOME_DIR/codex"
        cat >"$HOME_DIR/codex/config.toml" <<EOF
${1:-}
openai_base_url = "http://127.0.0.1:$PORT/v1"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
EOF
    }
    env_codex() { echo CODEX_HOME="$HOME_DIR/codex" CODEX_API_KEY=sk-capture-0000; }

    scenario codex ws-exec-resume
    start_capture "$DIR"; codex_config
    # shellcheck disable=SC2046
    step 'codex exec' $(env_codex) -- "$codex" exec --skip-git-repo-check "say hi"
    # shellcheck disable=SC2046
    step 'codex exec resume --last' $(env_codex) -- "$codex" exec resume --last --skip-git-repo-check "again"
    finish @openai/codex codex/config.toml

    scenario codex ws-tool-call
    start_capture "$DIR" --tool-call on; codex_config
    # shellcheck disable=SC2046
    step 'codex exec (one tool call)' $(env_codex) -- "$codex" exec --skip-git-repo-check "say hi"
    finish @openai/codex codex/config.toml

    # The capture's usage (~17k prompt tokens) is over this limit, so the
    # resumed run compacts first (remote compaction v2, over the socket).
    scenario codex ws-compaction
    start_capture "$DIR"; codex_config 'model_auto_compact_token_limit = 5000'
    # shellcheck disable=SC2046
    step 'codex exec' $(env_codex) -- "$codex" exec --skip-git-repo-check "say hi"
    # shellcheck disable=SC2046
    step 'codex exec resume --last (compacts first)' $(env_codex) -- "$codex" exec resume --last --skip-git-repo-check "again"
    finish @openai/codex codex/config.toml

    scenario codex ws-refused-404
    start_capture "$DIR" --ws refuse --ws-refuse-status 404; codex_config
    # shellcheck disable=SC2046
    step 'codex exec' $(env_codex) -- "$codex" exec --skip-git-repo-check "say hi"
    finish @openai/codex codex/config.toml

    scenario codex ws-refused-426-tool-call
    start_capture "$DIR" --ws refuse --ws-refuse-status 426 --tool-call on; codex_config
    # shellcheck disable=SC2046
    step 'codex exec (one tool call)' $(env_codex) -- "$codex" exec --skip-git-repo-check "say hi"
    finish @openai/codex codex/config.toml
fi

if want opencode; then
    opencode=$(command -v opencode)
    scenario opencode continue
    start_capture "$DIR"
    mkdir -p "$HOME_DIR/.config/opencode"
    cat >"$HOME_DIR/.config/opencode/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "model": "anthropic/claude-sonnet-4-5",
  "small_model": "anthropic/claude-haiku-4-5",
  "autoupdate": false,
  "share": "disabled",
  "provider": {
    "anthropic": {
      "options": { "baseURL": "http://127.0.0.1:$PORT/v1", "apiKey": "sk-ant-capture-0000" }
    }
  }
}
EOF
    # npm_config_registry: opencode npm-installs @opencode-ai/plugin into its
    # config dir on every start; a dead loopback registry makes that fail fast.
    quiet=(OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_SHARE=1
        OPENCODE_DISABLE_LSP_DOWNLOAD=1 OPENCODE_DISABLE_DEFAULT_PLUGINS=1 OPENCODE_DISABLE_CLAUDE_CODE=1
        OPENCODE_DISABLE_EXTERNAL_SKILLS=1 npm_config_registry=http://127.0.0.1:9/)
    step 'opencode run' "${quiet[@]}" -- "$opencode" run "say hi"
    step 'opencode run --continue' "${quiet[@]}" -- "$opencode" run --continue "again"
    step 'opencode run --continue' "${quiet[@]}" -- "$opencode" run --continue "again"
    finish opencode-ai .config/opencode/opencode.json
fi

if want gemini; then
    gemini=$(command -v gemini)
    gemini_settings() {
        mkdir -p "$HOME_DIR/.gemini"
        cat >"$HOME_DIR/.gemini/settings.json" <<'EOF'
{
  "security": { "auth": { "selectedType": "gemini-api-key" } },
  "privacy": { "usageStatisticsEnabled": false },
  "telemetry": { "enabled": false },
  "general": { "disableAutoUpdate": true, "disableUpdateNag": true }
}
EOF
    }
    env_gemini() { echo GOOGLE_GEMINI_BASE_URL="http://127.0.0.1:$PORT" GEMINI_API_KEY=capture-gemini-0000 GEMINI_CLI_TRUST_WORKSPACE=true; }

    scenario gemini auto-model-resume
    start_capture "$DIR"; gemini_settings
    # shellcheck disable=SC2046
    step 'gemini -p' $(env_gemini) -- "$gemini" -p "say hi"
    # shellcheck disable=SC2046
    step 'gemini --resume latest -p' $(env_gemini) -- "$gemini" --resume latest -p "again"
    finish @google/gemini-cli .gemini/settings.json

    scenario gemini model-flag-resume
    start_capture "$DIR"; gemini_settings
    # shellcheck disable=SC2046
    step 'gemini -m gemini-2.5-pro -p' $(env_gemini) -- "$gemini" -m gemini-2.5-pro -p "say hi"
    # shellcheck disable=SC2046
    step 'gemini -m gemini-2.5-pro --resume latest -p' $(env_gemini) -- "$gemini" -m gemini-2.5-pro --resume latest -p "again"
    finish @google/gemini-cli .gemini/settings.json
fi
