#!/usr/bin/env bash
# Installs what tests/page.rs drives: Debian's Chromium (/usr/bin/chromium,
# from apt when missing) and playwright-core (pinned in tests/page/package.json
# + package-lock.json) into the project-local prefix target/browser, with
# Node.js from scripts/node.sh when the machine has none new enough.
# Playwright's own browser download is never used: the test launches
# /usr/bin/chromium.
#
# Idempotent: a second run with the same lock only checks. Leaves
# target/browser/bin/node, the node the test runs its script with.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
prefix=$root/target/browser
say() { echo "browser.sh: $*" >&2; }

. scripts/node.sh
ensure_node

if [ ! -x /usr/bin/chromium ]; then
    say "installing Debian's chromium"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

mkdir -p "$prefix/bin"
if ! cmp -s tests/page/package-lock.json "$prefix/package-lock.json" || [ ! -d "$prefix/node_modules/playwright-core" ]; then
    cp tests/page/package.json tests/page/package-lock.json "$prefix/"
    rm -rf "$prefix/node_modules"
    say "npm ci into $prefix (node $(node --version), npm $(npm --version))"
    (cd "$prefix" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
fi
ln -sf "$node_dir/node" "$prefix/bin/node"
"$prefix/bin/node" -e "require('$prefix/node_modules/playwright-core'); console.log('playwright-core', require('$prefix/node_modules/playwright-core/package.json').version)"
/usr/bin/chromium --version 2>/dev/null
