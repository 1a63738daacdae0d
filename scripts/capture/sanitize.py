#!/usr/bin/env python3
"""Turns raw captures (target/capture/raw/<agent>/<scenario>/, written by
scripts/capture/run.sh) into the committed fixtures
tests/fixtures/agents/<agent>-<version>/<scenario>/: one file per request in
order, the WebSocket frames, and run.json, with

- machine-specific values replaced: the throwaway HOME by /home/user, the
  capture server's port by PORT, the repository path by /repo, per-machine
  ids (Claude Code's device_id, Codex's installation_id, Gemini's
  privileged user id) by fixed synthetic ones; the API keys were fake already
  and stay, so every header name and value shape is kept;
- long strings (system prompts, tool descriptions, environment blurbs) cut to
  their head and tail around a visible marker, so the JSON structure, every key
  (cache_control included) and the first and last bytes of each text block stay
  as sent; tool lists keep their first two and last tools, the others reduced
  to name and type beside a marker. Session ids are kept as captured (random
  per run).

    scripts/capture/sanitize.py [RAW_ROOT [FIXTURE_ROOT]]
"""
import json
import os
import re
import shutil
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RAW = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "capture", "raw")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "tests", "fixtures", "agents")

LIMIT = 800  # strings longer than this are cut
HEAD, TAIL = 300, 100
# Tool lists keep their first two and last entries whole (cut strings aside);
# the ones between keep name and type beside a marker.
TOOL_KEYS = {"tools", "functionDeclarations"}

FAKE_DEVICE = "d" * 64
FAKE_INSTALL = "00000000-0000-4000-8000-000000000001"
FAKE_USER = "00000000-0000-4000-8000-000000000002"


def cut(s):
    if len(s) <= LIMIT:
        return s
    if s.startswith("{"):
        # JSON inside a string (Codex's x-codex-turn-metadata): kept whole,
        # a reader parses it.
        try:
            json.loads(s)
            return s
        except ValueError:
            pass
    return f"{s[:HEAD]}…[capture: {len(s) - HEAD - TAIL} chars cut]…{s[-TAIL:]}"


def stub(tool):
    if not isinstance(tool, dict):
        return tool
    kept = {k: tool[k] for k in ("type", "name") if k in tool}
    kept["capture_cut"] = f"tool definition cut ({len(json.dumps(tool, ensure_ascii=False))} bytes)"
    return kept


def walk(v, key=None):
    if isinstance(v, str):
        return cut(v)
    if isinstance(v, list):
        if key in TOOL_KEYS and len(v) > 3:
            v = v[:2] + [stub(t) for t in v[2:-1]] + v[-1:]
        return [walk(x) for x in v]
    if isinstance(v, dict):
        return {k: walk(x, k) for k, x in v.items()}
    return v


class Scrub:
    def __init__(self, home):
        self.subs = [
            (re.escape(home), "/home/user"),
            # Claude Code names per-project dirs after the cwd, / turned to -.
            (re.escape(home.replace("/", "-").replace(".", "-")), "-home-user"),
            (re.escape(home.replace("/", "-")), "-home-user"),
            (re.escape(ROOT), "/repo"),
            (r"127\.0\.0\.1:\d{2,5}", "127.0.0.1:PORT"),
            (r'(\\*"device_id\\*":\\*")[0-9a-f]{64}', r"\g<1>" + FAKE_DEVICE),
            (r'(\\*"installation_id\\*":\\*")[0-9a-f-]{36}', r"\g<1>" + FAKE_INSTALL),
            (r'(\\*"x-codex-installation-id\\*":\\*")[0-9a-f-]{36}', r"\g<1>" + FAKE_INSTALL),
        ]
        self.literal = {}

    def text(self, s):
        for pat, rep in self.subs:
            s = re.sub(pat, rep, s)
        for a, b in self.literal.items():
            s = s.replace(a, b)
        return s

    def value(self, v):
        # Scrub the serialised form (ids hide inside JSON-in-strings such as
        # metadata.user_id and x-codex-turn-metadata), then cut long strings.
        return walk(json.loads(self.text(json.dumps(v, ensure_ascii=False))))


def headers_ids(entry, scrub):
    for name, value in entry.get("headers", []):
        if name.lower() == "x-gemini-api-privileged-user-id":
            scrub.literal[value] = FAKE_USER
        if name.lower() == "host":
            pass


def main():
    if not os.path.isdir(RAW):
        sys.exit(f"no raw captures at {RAW}: run scripts/capture/run.sh first")
    for agent in sorted(os.listdir(RAW)):
        for scen in sorted(os.listdir(os.path.join(RAW, agent))):
            src = os.path.join(RAW, agent, scen)
            run = json.load(open(os.path.join(src, "run.json")))
            dst = os.path.join(OUT, f"{agent}-{run['version']}", scen)
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(dst)
            scrub = Scrub(run["home"])
            reqdir = os.path.join(src, "requests")
            names = sorted(os.listdir(reqdir))
            for n in names:
                if n.endswith(".json"):
                    headers_ids(json.load(open(os.path.join(reqdir, n))), scrub)
            for n in names:
                p = os.path.join(reqdir, n)
                if n.endswith(".frames.jsonl"):
                    with open(os.path.join(dst, n), "w") as f:
                        for line in open(p):
                            f.write(json.dumps(scrub.value(json.loads(line)), ensure_ascii=False) + "\n")
                else:
                    entry = scrub.value(json.load(open(p)))
                    with open(os.path.join(dst, n), "w") as f:
                        json.dump(entry, f, indent=1, ensure_ascii=False)
                        f.write("\n")
            run = scrub.value(run)
            # argv[0] is the installed CLI's path; keep only its name.
            for s in run["steps"]:
                s["argv"][0] = os.path.basename(s["argv"][0])
            run.pop("home", None)
            with open(os.path.join(dst, "run.json"), "w") as f:
                json.dump(run, f, indent=1, ensure_ascii=False)
                f.write("\n")
            size = sum(os.path.getsize(os.path.join(dst, x)) for x in os.listdir(dst))
            print(f"{dst}: {len(os.listdir(dst))} files, {size} bytes")


if __name__ == "__main__":
    main()
