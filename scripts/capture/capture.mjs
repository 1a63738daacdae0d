#!/usr/bin/env node
// A capture provider: a fake LLM API on 127.0.0.1 that records every request a
// coding agent makes (and every WebSocket frame both ways) and answers each in
// the real API's wire format, just well enough for the agent to finish a turn.
// It is how tests/fixtures/agents/ was made (see its README); a dev tool, not
// part of the test suite.
//
//   node scripts/capture/capture.mjs --out DIR [--port N] [--ws accept|refuse]
//                                    [--ws-refuse-status 404] [--deflate on|off]
//                                    [--tool-call on] [--minimal on] [--usage off]
//                                    [--reply TEXT] [--anthropic-tool NAME --anthropic-tool-input JSON]
//
// Prints "listening http://127.0.0.1:PORT" on stdout once bound. Every request
// becomes DIR/NNNN-<method>-<path>.json (method, path, query, raw header list,
// body parsed as JSON where it is JSON, and a summary of the answer). A
// WebSocket becomes DIR/NNNN-WS-<path>.json (handshake) plus
// DIR/NNNN-WS-<path>.frames.jsonl (one line per message or control frame, in
// order, with direction and milliseconds since the handshake).
//
// APIs answered (everything else gets a 404 in the Anthropic/OpenAI error shape
// and is recorded all the same, which is how side calls get noticed):
//   Anthropic  POST /v1/messages (SSE or JSON), POST /v1/messages/count_tokens
//   OpenAI     POST /v1/responses (SSE or JSON), GET /v1/responses + Upgrade
//              (the Responses WebSocket mode), POST /v1/chat/completions,
//              GET /v1/models
//   Gemini     POST /v1beta/models/M:streamGenerateContent (?alt=sse),
//              :generateContent, :countTokens

import http from "node:http";
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const prefix = process.env.AGENTS_PREFIX || path.resolve(here, "../../target/agents");
const require = createRequire(path.join(prefix, "package.json"));
const { WebSocketServer } = require("ws");

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => {
    if (a.startsWith("--")) acc.push([a.slice(2), all[i + 1]]);
    return acc;
  }, []),
);
const outDir = args.out || "capture-out";
const port = Number(args.port || 0);
const wsMode = args.ws || "accept";
const wsRefuseStatus = Number(args["ws-refuse-status"] || 404);
const deflate = (args.deflate || "on") === "on";
const reply = args.reply || "hi";
const toolCall = args["tool-call"] === "on";
const minimal = args.minimal === "on";
const noUsage = args.usage === "off";
fs.mkdirSync(outDir, { recursive: true });

let seq = 0;
let responses = 0; // ids of generated responses: unique even on one socket
const started = Date.now();
const nextName = (method, p) =>
  `${String(++seq).padStart(4, "0")}-${method}-${p.replace(/^\//, "").replace(/[^A-Za-z0-9._-]+/g, "_").slice(0, 80)}`;

// A rough token count (4 bytes a token) so usage numbers grow with the body
// the way real ones do; the agents only need plausible integers.
const tokens = (s) => Math.max(1, Math.ceil(Buffer.byteLength(s || "") / 4));

function parseBody(buf, headers) {
  const text = buf.toString("utf8");
  if (!text) return { body: null };
  try {
    return { body: JSON.parse(text) };
  } catch {
    const ct = headers["content-type"] || "";
    if (/json|text|x-www-form/.test(ct) || /^[\x09\x0a\x0d\x20-\x7e]*$/.test(text))
      return { body_text: text };
    return { body_base64: buf.toString("base64") };
  }
}

function record(name, obj) {
  fs.writeFileSync(path.join(outDir, name + ".json"), JSON.stringify(obj, null, 2) + "\n");
}

// ---------- Anthropic Messages ----------
// --anthropic-tool NAME --anthropic-tool-input JSON: the first request that
// offers tool NAME is answered with one call of it (Claude Code's Agent tool
// starts a sub-agent), every other request with text.
let anthropicToolPending = Boolean(args["anthropic-tool"]);
function anthropicEvents(req, inTok) {
  const model = req.model || "claude-sonnet-4-5";
  const id = `msg_capture${String(seq).padStart(6, "0")}`;
  const cached = 0;
  const start = { type: "message_start", message: { model, id, type: "message", role: "assistant", content: [], stop_reason: null, stop_sequence: null, usage: { input_tokens: inTok, cache_creation_input_tokens: 0, cache_read_input_tokens: cached, cache_creation: { ephemeral_5m_input_tokens: 0, ephemeral_1h_input_tokens: 0 }, output_tokens: 1, service_tier: "standard" } } };
  const name = args["anthropic-tool"];
  if (anthropicToolPending && (req.tools || []).some((t) => t.name === name)) {
    anthropicToolPending = false;
    const input = args["anthropic-tool-input"] || "{}";
    return [
      ["message_start", start],
      ["content_block_start", { type: "content_block_start", index: 0, content_block: { type: "tool_use", id: `toolu_capture${seq}`, name, input: {} } }],
      ["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "input_json_delta", partial_json: input } }],
      ["content_block_stop", { type: "content_block_stop", index: 0 }],
      ["message_delta", { type: "message_delta", delta: { stop_reason: "tool_use", stop_sequence: null }, usage: { input_tokens: inTok, cache_creation_input_tokens: 0, cache_read_input_tokens: cached, output_tokens: tokens(input) } }],
      ["message_stop", { type: "message_stop" }],
    ];
  }
  return [
    ["message_start", start],
    ["content_block_start", { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } }],
    ["ping", { type: "ping" }],
    ["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: reply } }],
    ["content_block_stop", { type: "content_block_stop", index: 0 }],
    ["message_delta", { type: "message_delta", delta: { stop_reason: "end_turn", stop_sequence: null }, usage: { input_tokens: inTok, cache_creation_input_tokens: 0, cache_read_input_tokens: cached, output_tokens: tokens(reply) } }],
    ["message_stop", { type: "message_stop" }],
  ];
}
function anthropicMessage(req, inTok) {
  return {
    model: req.model || "claude-sonnet-4-5", id: `msg_capture${String(seq).padStart(6, "0")}`, type: "message", role: "assistant",
    content: [{ type: "text", text: reply }], stop_reason: "end_turn", stop_sequence: null,
    usage: { input_tokens: inTok, cache_creation_input_tokens: 0, cache_read_input_tokens: 0, output_tokens: tokens(reply), service_tier: "standard" },
  };
}

// ---------- OpenAI Responses ----------
function responsesEvents(req, inTok) {
  const n0 = String(++responses).padStart(6, "0");
  const rid = `resp_capture${n0}`;
  const mid = `msg_capture${n0}`;
  const base = {
    id: rid, object: "response", created_at: Math.floor(Date.now() / 1000), status: "in_progress", background: false, error: null,
    incomplete_details: null, instructions: null, max_output_tokens: null, model: req.model || "gpt-5", output: [],
    parallel_tool_calls: true, previous_response_id: req.previous_response_id ?? null, prompt_cache_key: req.prompt_cache_key ?? null,
    reasoning: { effort: null, summary: null }, service_tier: "auto", store: req.store ?? false, temperature: 1.0,
    text: { format: { type: "text" }, verbosity: "medium" }, tool_choice: "auto", tools: [], top_p: 1.0, truncation: "disabled",
    usage: null, user: null, metadata: {},
  };
  const item = { id: mid, type: "message", status: "completed", content: [{ type: "output_text", annotations: [], logprobs: [], text: reply }], role: "assistant" };
  // --usage off: completed responses without usage (what an agent does then).
  const usage = noUsage ? null : { input_tokens: inTok, input_tokens_details: { cached_tokens: 0 }, output_tokens: tokens(reply), output_tokens_details: { reasoning_tokens: 0 }, total_tokens: inTok + tokens(reply) };
  let n = 0;
  const ev = (o) => ({ ...o, sequence_number: n++ });
  const last = Array.isArray(req.input) ? req.input[req.input.length - 1] : null;
  // A warm-up (`generate: false`, the WebSocket mode's prewarm) produces no
  // output: created then completed, with an id the next turn may chain from.
  if (req.generate === false) {
    const u = usage && { ...usage, output_tokens: 0, total_tokens: inTok };
    return [
      ev({ type: "response.created", response: base }),
      ev({ type: "response.completed", response: { ...base, status: "completed", usage: u } }),
    ];
  }
  // Codex's remote compaction (v2): the history plus a `compaction_trigger`
  // item; it wants exactly one output item of type `compaction` (opaque).
  if (last && last.type === "compaction_trigger") {
    const cmp = { id: `cmp_capture${n0}`, type: "compaction", encrypted_content: `capture-compaction-${n0}` };
    return [
      ev({ type: "response.created", response: base }),
      ev({ type: "response.in_progress", response: base }),
      ev({ type: "response.output_item.added", output_index: 0, item: cmp }),
      ev({ type: "response.output_item.done", output_index: 0, item: cmp }),
      ev({ type: "response.completed", response: { ...base, status: "completed", output: [cmp], usage } }),
    ];
  }
  // --tool-call: a turn that ends in a user message is answered with a call
  // of Codex's `exec` custom tool, so the agent runs it and continues the
  // turn (on a WebSocket: previous_response_id plus only the new items).
  if (toolCall && last && last.type === "message" && last.role === "user") {
    const call = { id: `ctc_capture${n0}`, type: "custom_tool_call", status: "completed", call_id: `call_capture${n0}`, name: "exec", input: 'text("tool ran")' };
    return [
      ev({ type: "response.created", response: base }),
      ev({ type: "response.in_progress", response: base }),
      ev({ type: "response.output_item.added", output_index: 0, item: { ...call, status: "in_progress", input: "" } }),
      ev({ type: "response.custom_tool_call_input.delta", item_id: call.id, output_index: 0, delta: call.input }),
      ev({ type: "response.custom_tool_call_input.done", item_id: call.id, output_index: 0, input: call.input }),
      ev({ type: "response.output_item.done", output_index: 0, item: call }),
      ev({ type: "response.completed", response: { ...base, status: "completed", output: [call], usage } }),
    ];
  }
  // --minimal: only what a client cannot do without (to find out what that is).
  if (minimal) {
    return [
      ev({ type: "response.created", response: base }),
      ev({ type: "response.output_item.done", output_index: 0, item }),
      ev({ type: "response.completed", response: { ...base, status: "completed", output: [item], usage } }),
    ];
  }
  return [
    ev({ type: "response.created", response: base }),
    ev({ type: "response.in_progress", response: base }),
    ev({ type: "response.output_item.added", output_index: 0, item: { ...item, status: "in_progress", content: [] } }),
    ev({ type: "response.content_part.added", item_id: mid, output_index: 0, content_index: 0, part: { type: "output_text", annotations: [], logprobs: [], text: "" } }),
    ev({ type: "response.output_text.delta", item_id: mid, output_index: 0, content_index: 0, delta: reply, logprobs: [] }),
    ev({ type: "response.output_text.done", item_id: mid, output_index: 0, content_index: 0, text: reply, logprobs: [] }),
    ev({ type: "response.content_part.done", item_id: mid, output_index: 0, content_index: 0, part: item.content[0] }),
    ev({ type: "response.output_item.done", output_index: 0, item }),
    ev({ type: "response.completed", response: { ...base, status: "completed", output: [item], usage } }),
  ];
}

// ---------- OpenAI Chat Completions ----------
function chatEvents(req, inTok) {
  const id = `chatcmpl-capture${seq}`;
  const created = Math.floor(Date.now() / 1000);
  const model = req.model || "gpt-4.1";
  const chunk = (delta, finish, usage) => ({ id, object: "chat.completion.chunk", created, model, choices: usage ? [] : [{ index: 0, delta, finish_reason: finish }], ...(usage ? { usage } : {}) });
  return [
    chunk({ role: "assistant", content: "" }, null),
    chunk({ content: reply }, null),
    chunk({}, "stop"),
    chunk(null, null, { prompt_tokens: inTok, completion_tokens: tokens(reply), total_tokens: inTok + tokens(reply) }),
  ];
}

// ---------- Gemini ----------
function geminiChunks(req, inTok, model) {
  const usage = { promptTokenCount: inTok, candidatesTokenCount: tokens(reply), totalTokenCount: inTok + tokens(reply), promptTokensDetails: [{ modality: "TEXT", tokenCount: inTok }] };
  // Side calls that ask for JSON (next-speaker checks, routing) get a JSON answer
  // matching their responseSchema where one is easy to satisfy.
  const cfg = req.generationConfig || {};
  let text = reply;
  if (cfg.responseMimeType === "application/json" || cfg.responseJsonSchema || cfg.responseSchema) {
    const schema = cfg.responseJsonSchema || cfg.responseSchema || {};
    text = JSON.stringify(fakeFromSchema(schema));
  }
  return [
    { candidates: [{ content: { parts: [{ text }], role: "model" }, finishReason: "STOP", index: 0 }], usageMetadata: usage, modelVersion: model, responseId: `capture${seq}` },
  ];
}
function fakeFromSchema(s) {
  if (!s || typeof s !== "object") return null;
  const t = Array.isArray(s.type) ? s.type[0] : s.type;
  if (s.enum) return s.enum[0];
  switch (String(t).toLowerCase()) {
    case "object": {
      const o = {};
      for (const [k, v] of Object.entries(s.properties || {})) o[k] = fakeFromSchema(v);
      return o;
    }
    case "array": return [];
    case "string": return "capture";
    // Routing classifiers validate their scores (1..100): the floor keeps
    // them happy and routes the turn as trivial.
    case "number": case "integer": return typeof s.minimum === "number" ? s.minimum : 1;
    case "boolean": return false;
    default: return null;
  }
}

function sse(res, events, named) {
  res.writeHead(200, { "content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache", connection: "keep-alive" });
  for (const e of events) {
    if (named) res.write(`event: ${e[0]}\ndata: ${JSON.stringify(e[1])}\n\n`);
    else res.write(`data: ${JSON.stringify(e)}\n\n`);
  }
}

function json(res, status, obj, extra = {}) {
  const body = JSON.stringify(obj);
  res.writeHead(status, { "content-type": "application/json", ...extra });
  res.end(body);
}

function handle(req, res, raw, name, entry) {
  const url = new URL(req.url, "http://x");
  const p = url.pathname;
  const body = entry.body || {};
  const inTok = tokens(raw.toString("utf8"));
  const answer = (kind, extra = {}) => { entry.answer = { kind, ...extra }; };

  if (req.method === "POST" && /\/v1\/messages\/count_tokens$/.test(p)) {
    answer("anthropic count_tokens");
    return json(res, 200, { input_tokens: inTok });
  }
  if (req.method === "POST" && /\/v1\/messages$/.test(p)) {
    if (body.stream) {
      const ev = anthropicEvents(body, inTok);
      answer("anthropic messages SSE", { events: ev.map((e) => e[0]) });
      sse(res, ev, true);
      return res.end();
    }
    answer("anthropic messages JSON");
    return json(res, 200, anthropicMessage(body, inTok), { "request-id": `req_capture${seq}` });
  }
  if (req.method === "POST" && /\/responses$/.test(p)) {
    const ev = responsesEvents(body, inTok);
    if (body.stream) {
      answer("responses SSE", { events: ev.map((e) => e.type) });
      sse(res, ev.map((e) => [e.type, e]), true);
      return res.end();
    }
    answer("responses JSON");
    return json(res, 200, ev[ev.length - 1].response);
  }
  if (req.method === "POST" && /\/chat\/completions$/.test(p)) {
    const ev = chatEvents(body, inTok);
    if (body.stream) {
      answer("chat SSE");
      sse(res, ev, false);
      res.write("data: [DONE]\n\n");
      return res.end();
    }
    answer("chat JSON");
    return json(res, 200, { id: ev[0].id, object: "chat.completion", created: ev[0].created, model: ev[0].model, choices: [{ index: 0, message: { role: "assistant", content: reply }, finish_reason: "stop" }], usage: ev[3].usage });
  }
  let m = p.match(/\/models\/([^/:]+):(streamGenerateContent|generateContent|countTokens)$/);
  if (req.method === "POST" && m) {
    const [, model, verb] = m;
    if (verb === "countTokens") {
      answer("gemini countTokens");
      return json(res, 200, { totalTokens: inTok });
    }
    const chunks = geminiChunks(body, inTok, model);
    if (verb === "streamGenerateContent") {
      if (url.searchParams.get("alt") === "sse") {
        answer("gemini SSE");
        sse(res, chunks, false);
        return res.end();
      }
      answer("gemini JSON array stream");
      return json(res, 200, chunks);
    }
    answer("gemini generateContent");
    return json(res, 200, chunks[0]);
  }
  if (req.method === "GET" && /\/v1\/models$/.test(p)) {
    answer("models list");
    return json(res, 200, { object: "list", data: [], models: [] });
  }
  answer("404");
  return json(res, 404, { type: "error", error: { type: "not_found_error", message: `capture: nothing at ${req.method} ${p}` } });
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    const raw = Buffer.concat(chunks);
    const url = new URL(req.url, "http://x");
    const name = nextName(req.method, url.pathname);
    const entry = {
      seq, ms: Date.now() - started, method: req.method, path: url.pathname,
      query: Object.fromEntries(url.searchParams), http_version: req.httpVersion,
      headers: pairs(req.rawHeaders), ...parseBody(raw, req.headers),
    };
    try {
      handle(req, res, raw, name, entry);
    } catch (e) {
      entry.answer = { kind: "capture error", error: String(e) };
      if (!res.headersSent) json(res, 500, { error: String(e) });
    }
    record(name, entry);
    log(`${entry.ms}ms ${req.method} ${req.url} -> ${entry.answer?.kind}`);
  });
});

function pairs(rawHeaders) {
  const out = [];
  for (let i = 0; i < rawHeaders.length; i += 2) out.push([rawHeaders[i], rawHeaders[i + 1]]);
  return out;
}
function log(s) { process.stderr.write(s + "\n"); }

const wss = new WebSocketServer({ noServer: true, perMessageDeflate: deflate });
server.on("upgrade", (req, socket, head) => {
  const url = new URL(req.url, "http://x");
  const name = nextName("WS", url.pathname);
  const entry = {
    seq, ms: Date.now() - started, method: req.method, path: url.pathname, query: Object.fromEntries(url.searchParams),
    http_version: req.httpVersion, headers: pairs(req.rawHeaders),
  };
  if (wsMode === "refuse") {
    entry.answer = { kind: `upgrade refused with ${wsRefuseStatus}` };
    record(name, entry);
    log(`${entry.ms}ms WS ${req.url} -> refused ${wsRefuseStatus}`);
    const body = JSON.stringify({ error: { message: "capture: websocket refused", type: "invalid_request_error" } });
    socket.end(`HTTP/1.1 ${wsRefuseStatus} Refused\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`);
    return;
  }
  wss.handleUpgrade(req, socket, head, (ws) => {
    const t0 = Date.now();
    const framesFile = path.join(outDir, name + ".frames.jsonl");
    const frame = (o) => fs.appendFileSync(framesFile, JSON.stringify({ ms: Date.now() - t0, ...o }) + "\n");
    entry.answer = { kind: "websocket accepted", extensions: ws.extensions || "" };
    record(name, entry);
    log(`${entry.ms}ms WS ${req.url} -> accepted (${ws.extensions || "no extensions"})`);
    ws.on("message", (data, isBinary) => {
      const text = isBinary ? null : data.toString("utf8");
      let msg = null;
      try { msg = JSON.parse(text); } catch {}
      frame({ dir: "client", opcode: isBinary ? "binary" : "text", ...(msg ? { json: msg } : isBinary ? { base64: data.toString("base64") } : { text }) });
      if (msg && msg.type === "response.create") {
        const body = msg.response && typeof msg.response === "object" ? msg.response : msg;
        for (const ev of responsesEvents(body, tokens(text))) {
          const s = JSON.stringify(ev);
          ws.send(s);
          frame({ dir: "server", opcode: "text", json: ev });
        }
      }
    });
    ws.on("ping", (d) => frame({ dir: "client", opcode: "ping", text: d.toString() }));
    ws.on("pong", (d) => frame({ dir: "client", opcode: "pong", text: d.toString() }));
    ws.on("close", (code, reason) => {
      frame({ dir: "client", opcode: "close", code, reason: reason.toString() });
      log(`${Date.now() - started}ms WS ${req.url} closed ${code}`);
    });
    ws.on("error", (e) => frame({ dir: "error", text: String(e) }));
  });
});

server.listen(port, "127.0.0.1", () => {
  process.stdout.write(`listening http://127.0.0.1:${server.address().port}\n`);
});
for (const s of ["SIGINT", "SIGTERM"]) process.on(s, () => { server.close(); process.exit(0); });
