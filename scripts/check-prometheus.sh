#!/usr/bin/env bash
# Check the ops bundle against a running tidemark admin listener:
#
#   scripts/check-prometheus.sh 127.0.0.1:9787
#
# 1. promtool check config on deploy/prometheus/prometheus.yml (its admin token file stubbed)
# 2. docker-compose config -q on docker-compose.yml (python yaml check if compose is unavailable)
# 3. curl TARGET/metrics | promtool check metrics
# 4. every metric name the dashboard uses is registered in src/metrics.rs
# 5. a throwaway Prometheus (temp config derived from deploy/prometheus/prometheus.yml,
#    target replaced, 1s interval) scrapes TARGET; once it has scraped MIN_SCRAPES times,
#    every `expr` (and template-variable query) in grafana/dashboards/tidemark.json is
#    evaluated through /api/v1/query. An error or an empty result fails.
#
# Panels written `X or on() vector(0)` (event counters that may not have fired yet) pass
# with a note when X is empty, and an all-NaN result (a ratio or quantile with no
# observations in its window) passes with a note; STRICT=1 fails both.
#
# Environment: STRICT=0|1, MIN_SCRAPES (3), READY_TIMEOUT seconds (60),
# TIDEMARK_ADMIN_TOKEN (sent as a bearer token to /metrics), NO_INSTALL=1 (never apt-get).
# Prints "N passed, M failed" last; exits non-zero if anything failed.
set -euo pipefail

TARGET=${1:-}
if [[ -z "$TARGET" || "$TARGET" == -* ]]; then
    echo "usage: $0 HOST:PORT   (tidemark's admin listener, e.g. 127.0.0.1:9787)" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROM_CFG=$ROOT/deploy/prometheus/prometheus.yml
DASHBOARD=$ROOT/grafana/dashboards/tidemark.json
COMPOSE=$ROOT/docker-compose.yml
METRICS_RS=$ROOT/src/metrics.rs
STRICT=${STRICT:-0}
MIN_SCRAPES=${MIN_SCRAPES:-3}
READY_TIMEOUT=${READY_TIMEOUT:-60}

PASSED=0
FAILED=0
FAILURES=()
pass() { PASSED=$((PASSED + 1)); echo "PASS  $*"; }
fail() { FAILED=$((FAILED + 1)); FAILURES+=("$*"); echo "FAIL  $*"; }
note() { echo "NOTE  $*"; }
indent() { sed "s/^/      /"; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/tidemark-check.XXXXXX")
PROM_PID=
cleanup() {
    if [[ -n "$PROM_PID" ]] && kill -0 "$PROM_PID" 2>/dev/null; then
        kill "$PROM_PID" 2>/dev/null || true
        wait "$PROM_PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- tools
APT_UPDATED=0
apt_install() {
    if [[ "${NO_INSTALL:-0}" == 1 ]]; then return 1; fi
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || return 1
        sudo=(sudo)
    fi
    command -v apt-get >/dev/null || return 1
    if [[ $APT_UPDATED == 0 ]]; then
        "${sudo[@]}" apt-get update -qq >/dev/null || return 1
        APT_UPDATED=1
    fi
    echo "installing $* (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
need() { # need COMMAND PACKAGE
    command -v "$1" >/dev/null && return 0
    apt_install "$2" && command -v "$1" >/dev/null
}
for tool in curl:curl python3:python3 prometheus:prometheus promtool:prometheus; do
    if ! need "${tool%%:*}" "${tool#*:}"; then
        echo "error: ${tool%%:*} is required (Debian package ${tool#*:}) and could not be installed" >&2
        exit 2
    fi
done
PY=python3
if ! "$PY" -c 'import yaml' 2>/dev/null; then
    if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import yaml' 2>/dev/null; then
        PY=/usr/bin/python3
    elif apt_install python3-yaml && /usr/bin/python3 -c 'import yaml' 2>/dev/null; then
        PY=/usr/bin/python3
    else
        echo "error: python3 with PyYAML is required (Debian package python3-yaml)" >&2
        exit 2
    fi
fi

# ---------------------------------------------------------------- 1. prometheus.yml
# promtool wants the files the config names to exist. The admin token file
# (a relative credentials_file, read beside the config) is written by
# docker-compose.yml when Prometheus starts: a placeholder stands in for it
# beside a copy of the config here.
mkdir -p "$TMP/deploy"
cp "$PROM_CFG" "$TMP/deploy/prometheus.yml"
"$PY" - "$PROM_CFG" "$TMP/deploy" <<'PY'
import os, sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
for job in cfg.get("scrape_configs", []):
    f = (job.get("authorization") or {}).get("credentials_file")
    if f and not os.path.isabs(f):
        open(os.path.join(sys.argv[2], f), "w").write("placeholder")
PY
if out=$(promtool check config "$TMP/deploy/prometheus.yml" 2>&1); then
    pass "promtool check config deploy/prometheus/prometheus.yml"
else
    fail "promtool check config deploy/prometheus/prometheus.yml"
    indent <<<"$out"
fi

# ---------------------------------------------------------------- 2. docker-compose.yml
COMPOSE_CMD=()
if need docker-compose docker-compose; then
    COMPOSE_CMD=(docker-compose)
elif command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
    COMPOSE_CMD=(docker compose)
fi
if [[ ${#COMPOSE_CMD[@]} -gt 0 ]]; then
    if out=$(cd "$ROOT" && "${COMPOSE_CMD[@]}" -f "$COMPOSE" config -q 2>&1); then
        pass "${COMPOSE_CMD[*]} config -q docker-compose.yml"
    else
        fail "${COMPOSE_CMD[*]} config -q docker-compose.yml"
        indent <<<"$out"
    fi
else
    note "docker-compose unavailable: falling back to a YAML structure check of docker-compose.yml"
    if out=$("$PY" - "$COMPOSE" 2>&1 <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
svcs = doc.get("services") or {}
missing = [s for s in ("tidemark", "traffic", "prometheus", "grafana") if s not in svcs]
assert not missing, f"services missing: {missing}"
for name, s in svcs.items():
    assert "image" in s or "build" in s, f"{name}: needs image or build"
PY
    ); then
        pass "docker-compose.yml (python yaml check)"
    else
        fail "docker-compose.yml (python yaml check)"
        indent <<<"$out"
    fi
fi

# ---------------------------------------------------------------- 3. /metrics lint
CURL_AUTH=()
if [[ -n "${TIDEMARK_ADMIN_TOKEN:-}" ]]; then
    CURL_AUTH=(-H "Authorization: Bearer $TIDEMARK_ADMIN_TOKEN")
fi
if ! curl -fsS --max-time 10 "${CURL_AUTH[@]}" "http://$TARGET/metrics" -o "$TMP/metrics.txt"; then
    fail "GET http://$TARGET/metrics"
    echo "${PASSED} passed, ${FAILED} failed"
    exit 1
fi
pass "GET http://$TARGET/metrics ($(wc -l <"$TMP/metrics.txt") lines)"
if out=$(promtool check metrics <"$TMP/metrics.txt" 2>&1); then
    pass "promtool check metrics"
else
    fail "promtool check metrics"
    indent <<<"$out"
fi

# ---------------------------------------------------------------- 4. temp Prometheus config
# The `tidemark` job of deploy/prometheus/prometheus.yml with only the target,
# the interval and the token (TIDEMARK_ADMIN_TOKEN's, or none) changed, so this
# test scrapes the way the compose stack does.
if [[ -n "${TIDEMARK_ADMIN_TOKEN:-}" ]]; then
    printf '%s' "$TIDEMARK_ADMIN_TOKEN" >"$TMP/admin-token"
fi
"$PY" - "$PROM_CFG" "$TARGET" "$TMP/prometheus.yml" "$TMP/admin-token" <<'PY'
import os, sys, yaml
src, target, dst, token = sys.argv[1:5]
cfg = yaml.safe_load(open(src))
jobs = [j for j in cfg.get("scrape_configs", []) if j.get("job_name") == "tidemark"]
if not jobs:
    sys.exit(f"{src}: no scrape job named tidemark")
job = jobs[0]
job["static_configs"] = [{"targets": [target]}]
job["scrape_interval"] = "1s"
job["scrape_timeout"] = "1s"
# The tidemark under test has its own token, or none.
if os.path.exists(token):
    job["authorization"] = {"type": "Bearer", "credentials_file": token}
else:
    job.pop("authorization", None)
cfg["global"] = dict(cfg.get("global") or {}, scrape_interval="1s", evaluation_interval="1s")
cfg["scrape_configs"] = [job]
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PY
if ! out=$(promtool check config "$TMP/prometheus.yml" 2>&1); then
    fail "promtool check config (derived test config)"
    indent <<<"$out"
fi

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
PROM_URL="http://127.0.0.1:$PORT"
prometheus --config.file="$TMP/prometheus.yml" \
    --storage.tsdb.path="$TMP/data" \
    --web.listen-address="127.0.0.1:$PORT" \
    --log.level=warn >"$TMP/prometheus.log" 2>&1 &
PROM_PID=$!

# ---------------------------------------------------------------- 5. evaluate the dashboard
set +e
"$PY" - "$PROM_URL" "$DASHBOARD" "$METRICS_RS" "$TMP/metrics.txt" "$READY_TIMEOUT" "$MIN_SCRAPES" "$STRICT" "$PROM_PID" "$TMP/results" <<'PY'
import atexit, json, os, re, sys, time, urllib.error, urllib.parse, urllib.request

prom, dash_path, metrics_rs, scraped, ready_timeout, min_scrapes, strict, pid, results = sys.argv[1:10]
ready_timeout, min_scrapes, strict, pid = float(ready_timeout), int(min_scrapes), strict == "1", int(pid)
passed, failures = 0, []

def ok(msg):
    global passed; passed += 1; print(f"PASS  {msg}")
def bad(msg):
    failures.append(msg); print(f"FAIL  {msg}")
@atexit.register
def report():  # first line: passed count; then one failure per line
    with open(results, "w") as f:
        f.write(f"{passed}\n")
        for m in failures:
            f.write(m.replace("\n", " ") + "\n")

def get(path, **params):
    url = prom + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()

def query(expr):
    data = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(prom + "/api/v1/query", data=data, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        try:
            body = json.load(e)
        except Exception:
            return None, f"HTTP {e.code}"
    except Exception as e:
        return None, str(e)
    if body.get("status") != "success":
        return None, f'{body.get("errorType")}: {body.get("error")}'
    return body["data"], None

def alive():
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False

# --- names: every metric the dashboard uses is one src/metrics.rs registers
rs = open(metrics_rs).read()
families = set(re.findall(r'"(tidemark_[a-z0-9_]+)"', rs))
histos = set(re.findall(r'histogram\(\s*&?r,\s*"(tidemark_[a-z0-9_]+)"', rs))
series_names = (families - histos) | {h + s for h in histos for s in ("_bucket", "_sum", "_count")}

dash = json.load(open(dash_path))
exprs = []  # (where, promql)
def walk(panels):
    for p in panels:
        for t in p.get("targets", []):
            if t.get("expr"):
                exprs.append((f'panel "{p.get("title")}" {t.get("refId", "")}', t["expr"]))
        walk(p.get("panels", []))
walk(dash.get("panels", []))
for v in dash.get("templating", {}).get("list", []):
    q = v.get("query")
    q = q.get("query") if isinstance(q, dict) else q
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q or "")
    if m:  # Grafana's label_values(sel, label) has data iff this does
        exprs.append((f"variable ${v['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    elif q:
        exprs.append((f"variable ${v['name']}", q))

used = set()
for _, e in exprs:
    used |= set(re.findall(r"\btidemark_[a-z0-9_]+\b", e))
unknown = sorted(used - series_names)
if unknown:
    bad(f"dashboard uses metric names not registered in src/metrics.rs: {', '.join(unknown)}")
else:
    ok(f"dashboard uses {len(used)} metric names, all registered in src/metrics.rs")
present = set(re.findall(r"^(tidemark_[a-z0-9_]+)", open(scraped).read(), re.M))
absent = sorted(n for n in used if n not in present)
if absent:
    print(f"NOTE  not in this scrape yet (no events of that kind so far): {', '.join(absent)}")

# --- wait (bounded) for Prometheus to be ready and to have scraped MIN_SCRAPES times
deadline = time.monotonic() + ready_timeout
ready = False
while time.monotonic() < deadline and alive():
    try:
        if get("/-/ready")[0] == 200:
            ready = True
            break
    except Exception:
        pass
    time.sleep(0.2)
if not ready:
    bad(f"prometheus not ready within {ready_timeout:.0f}s (alive={alive()})")
    sys.exit(1)

scrapes, up = 0, None
while time.monotonic() < deadline and alive():
    d, _ = query('count_over_time(up{job="tidemark"}[10m])')
    u, _ = query('up{job="tidemark"}')
    if d and d["result"]:
        scrapes = int(float(d["result"][0]["value"][1]))
    if u and u["result"]:
        up = u["result"][0]["value"][1]
    if scrapes >= min_scrapes:
        break
    time.sleep(0.25)
if scrapes < min_scrapes:
    bad(f"only {scrapes} scrapes within {ready_timeout:.0f}s (wanted {min_scrapes})")
    sys.exit(1)
if up != "1":
    bad(f"target is down in Prometheus (up={up}); see the target page of the temp Prometheus")
    sys.exit(1)
ok(f"prometheus scraped the target {scrapes} times, up=1")

# --- every expression
BUILTIN = {"__rate_interval": "15s", "__interval": "5s", "__interval_ms": "5000",
           "__range": "5m", "__range_s": "300", "__range_ms": "300000"}
def substitute(e):
    def rep(m):
        name = m.group(1) or m.group(2)
        return BUILTIN.get(name, ".*")
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", rep, e)

ZERO = re.compile(r"\s+or\s+on\s*\(\s*\)\s+vector\(0\)\s*$")
for where, raw in exprs:
    e = substitute(raw)
    data, err = query(e)
    if err:
        bad(f"{where}: error {err}\n      {e}")
        continue
    if not data["result"]:
        bad(f"{where}: no data\n      {e}")
        continue
    nan = data["resultType"] == "vector" and all(r["value"][1] == "NaN" for r in data["result"])
    m = ZERO.search(e)
    if m:
        inner = e[: m.start()]
        idata, ierr = query(inner)
        if ierr:
            bad(f"{where}: error {ierr}\n      {inner}")
            continue
        if not idata["result"]:
            if strict:
                bad(f"{where}: no data without the zero fallback (STRICT=1)\n      {inner}")
            else:
                ok(f"{where} (zero: no events yet)")
            continue
    if nan and strict:
        bad(f"{where}: only NaN (no observations in the window; STRICT=1)\n      {e}")
        continue
    res = data["result"]
    first = res[0]["value"][1] if data["resultType"] == "vector" else res
    shown = f"{len(res)} series, first = {first}" if data["resultType"] == "vector" else f"{data['resultType']} {first}"
    ok(f"{where}: {shown}" + (" (NaN: no observations in the window)" if nan else ""))

sys.exit(1 if failures else 0)
PY
set -e
if [[ -f "$TMP/results" ]]; then
    PASSED=$((PASSED + $(head -n1 "$TMP/results")))
    while IFS= read -r line; do
        FAILED=$((FAILED + 1))
        FAILURES+=("$line")
    done < <(tail -n +2 "$TMP/results")
else
    fail "dashboard evaluation did not run to completion"
fi
if [[ $FAILED -gt 0 && -s "$TMP/prometheus.log" ]]; then
    echo "--- temp prometheus log (tail)"
    tail -n 20 "$TMP/prometheus.log"
fi

echo
if [[ $FAILED -gt 0 ]]; then
    echo "failures:"
    for f in "${FAILURES[@]}"; do echo "  - $f"; done
fi
echo "${PASSED} passed, ${FAILED} failed"
[[ $FAILED -eq 0 ]]
