// The browser end of tests/page.rs: Debian's Chromium driven by
// playwright-core, one JSON command per line on stdin, one JSON answer per
// line on stdout. Every wait has a timeout; the test bounds each answer too.
//
// Commands: launch {js}, goto {url}, eval {js}, wait {js, timeout},
// submit {selector, value, button}, route {pattern, body}, screenshot {path},
// quit. An answer is {ok: true, ...} or {error: "..."}.
"use strict";
const fs = require("fs");
const os = require("os");
const path = require("path");
const readline = require("readline");
const { chromium } = require(process.env.PLAYWRIGHT_CORE);

// Off the network: this machine's is closed, and the test must not reach it.
const FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];
const TIMEOUT = 15000;

let context = null;
let page = null;
const dirs = [];

async function launch(js) {
  if (context) await context.close();
  // A fresh profile per launch: no cookie or cache carries over.
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "tidemark-page-"));
  dirs.push(dir);
  context = await chromium.launchPersistentContext(dir, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    args: FLAGS,
    javaScriptEnabled: js !== false,
    viewport: { width: 1400, height: 820 },
  });
  context.setDefaultTimeout(TIMEOUT);
  page = context.pages()[0] || (await context.newPage());
  return { version: context.browser() ? context.browser().version() : "" };
}

async function run(c) {
  switch (c.cmd) {
    case "launch":
      return await launch(c.js);
    case "goto": {
      const r = await page.goto(c.url, { waitUntil: "load" });
      return { status: r ? r.status() : 0, url: page.url() };
    }
    case "eval":
      return { value: await page.evaluate(c.js) };
    case "wait": {
      // Polled with evaluate, not waitForFunction: that one compiles its
      // string in the page, which the page's Content-Security-Policy forbids
      // (and the test keeps the policy on: it proves the script's hash).
      const end = Date.now() + (c.timeout || TIMEOUT);
      for (;;) {
        const v = await page.evaluate(c.js);
        if (v) return { value: v };
        if (Date.now() > end) throw new Error("timed out after " + (c.timeout || TIMEOUT) + " ms");
        await new Promise((r) => setTimeout(r, 100));
      }
    }
    case "submit": {
      await page.fill(c.selector, c.value);
      const nav = page.waitForNavigation({ timeout: TIMEOUT });
      await page.click(c.button);
      const r = await nav;
      return { status: r ? r.status() : 0, url: page.url() };
    }
    case "route":
      await page.route(c.pattern, (route) =>
        route.fulfill({ status: 200, contentType: "application/json", body: c.body }),
      );
      return {};
    case "screenshot":
      await page.screenshot({ path: c.path, fullPage: true });
      return {};
    case "quit":
      return {};
    default:
      throw new Error("unknown command " + c.cmd);
  }
}

async function main() {
  const rl = readline.createInterface({ input: process.stdin });
  for await (const line of rl) {
    if (!line.trim()) continue;
    let c;
    let answer;
    try {
      c = JSON.parse(line);
      answer = Object.assign({ ok: true }, await run(c));
    } catch (e) {
      answer = { error: String(e && e.message ? e.message : e) };
    }
    process.stdout.write(JSON.stringify(answer) + "\n");
    if (c && c.cmd === "quit") break;
  }
  if (context) await context.close();
  for (const d of dirs) fs.rmSync(d, { recursive: true, force: true });
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stderr.write(String(e && e.stack ? e.stack : e) + "\n");
    process.exit(1);
  },
);
