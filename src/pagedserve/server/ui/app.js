// The page: chat through /v1/chat/completions, and the engine's steps from /engine/events.
// Everything shown from a model or a user is set as text (textContent, createElement), never as
// HTML, and the page's Content-Security-Policy allows only its own script.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagedserve-key";
const CHATS_STORE = "pagedserve-conversations";
const SEAT_STEPS = 160; // columns of the seats picture
const COLORS = {};

let modelName = null;

// ---------------------------------------------------------------- auth

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function askForKey() {
  $("key-form").hidden = false;
  $("api-key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("api-key").value);
  $("api-key").value = "";
  $("key-form").hidden = true;
  start();
});

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (response.status === 401) {
    askForKey();
    throw new Error("this server needs an API key");
  }
  return response;
}

// ---------------------------------------------------------------- markdown, as DOM nodes

function inline(text, into) {
  // `code`, **bold**, *emphasis*; everything else is text.
  const pattern = /(`[^`]+`|\*\*[^*]+\*\*|\*[^*\s][^*]*\*)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    into.append(text.slice(last, match.index));
    const token = match[0];
    let node;
    if (token.startsWith("`")) {
      node = document.createElement("code");
      node.textContent = token.slice(1, -1);
    } else if (token.startsWith("**")) {
      node = document.createElement("strong");
      node.textContent = token.slice(2, -2);
    } else {
      node = document.createElement("em");
      node.textContent = token.slice(1, -1);
    }
    into.append(node);
    last = match.index + token.length;
  }
  into.append(text.slice(last));
}

function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = text.split("\n");
  let list = null;
  let paragraph = null;
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (line.startsWith("```")) {
      const code = [];
      for (i++; i < lines.length && !lines[i].startsWith("```"); i++) code.push(lines[i]);
      const pre = document.createElement("pre");
      const block = document.createElement("code");
      block.textContent = code.join("\n");
      pre.append(block);
      fragment.append(pre);
      list = paragraph = null;
      continue;
    }
    const heading = /^(#{1,4})\s+(.*)$/.exec(line);
    const item = /^\s*(?:[-*]|\d+\.)\s+(.*)$/.exec(line);
    if (heading) {
      const node = document.createElement(`h${Math.min(6, heading[1].length + 2)}`);
      inline(heading[2], node);
      fragment.append(node);
      list = paragraph = null;
    } else if (item) {
      if (!list) {
        list = document.createElement(/^\s*\d/.test(line) ? "ol" : "ul");
        fragment.append(list);
      }
      const node = document.createElement("li");
      inline(item[1], node);
      list.append(node);
      paragraph = null;
    } else if (line.trim() === "") {
      list = paragraph = null;
    } else {
      if (!paragraph) {
        paragraph = document.createElement("p");
        fragment.append(paragraph);
      } else {
        paragraph.append(document.createElement("br"));
      }
      inline(line, paragraph);
      list = null;
    }
  }
  return fragment;
}

// ---------------------------------------------------------------- conversations

function loadChats() {
  try {
    return JSON.parse(localStorage.getItem(CHATS_STORE)) || { current: null, chats: {} };
  } catch {
    return { current: null, chats: {} };
  }
}

let store = loadChats();

function saveChats() {
  localStorage.setItem(CHATS_STORE, JSON.stringify(store));
}

function currentChat() {
  if (!store.current || !store.chats[store.current]) newChat();
  return store.chats[store.current];
}

function newChat() {
  const id = `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`;
  store.chats[id] = { title: "New conversation", messages: [], created: Date.now() };
  store.current = id;
  saveChats();
}

function drawChats() {
  currentChat(); // there is always one to show
  const select = $("conversations");
  select.replaceChildren();
  const ids = Object.keys(store.chats).sort((a, b) => store.chats[b].created - store.chats[a].created);
  for (const id of ids) {
    const option = document.createElement("option");
    option.value = id;
    option.textContent = store.chats[id].title;
    option.selected = id === store.current;
    select.append(option);
  }
  const list = $("messages");
  list.replaceChildren();
  for (const message of currentChat().messages) list.append(messageNode(message));
  list.scrollTop = list.scrollHeight;
}

function messageNode(message) {
  const item = document.createElement("li");
  item.className = message.role;
  const body = document.createElement("div");
  body.className = "content";
  body.append(renderMarkdown(message.content));
  item.append(body);
  if (message.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = message.stats;
    item.append(stats);
  }
  return item;
}

$("new-conversation").addEventListener("click", () => { newChat(); drawChats(); $("prompt").focus(); });
$("delete-conversation").addEventListener("click", () => {
  delete store.chats[store.current];
  store.current = Object.keys(store.chats)[0] || null;
  saveChats();
  drawChats();
});
$("conversations").addEventListener("change", (event) => {
  store.current = event.target.value;
  saveChats();
  drawChats();
});

// ---------------------------------------------------------------- chat

let controller = null;

async function* serverEvents(response) {
  // The data of each server-sent event in a fetch response's body.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim());
      if (data.length) yield data.join("\n");
    }
  }
}

function chatBody(history) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of history) messages.push({ role: m.role, content: m.content });
  const body = {
    model: modelName,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("use-schema").checked) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse($("schema").value) },
    };
  }
  return body;
}

async function send(text) {
  const chat = currentChat();
  $("chat-error").textContent = "";
  let body;
  try {
    body = chatBody([...chat.messages, { role: "user", content: text }]);
  } catch (error) {
    $("chat-error").textContent = `the schema is not JSON: ${error.message}`;
    return;
  }
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New conversation") chat.title = text.slice(0, 40);
  const answer = { role: "assistant", content: "" };
  chat.messages.push(answer);
  saveChats();
  drawChats();
  const node = $("messages").lastElementChild;
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null;
  let tokens = 0;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error((await response.json()).error?.message || response.statusText);
    for await (const data of serverEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        answer.content += delta;
        node.querySelector(".content").replaceChildren(renderMarkdown(answer.content));
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") $("chat-error").textContent = error.message;
  } finally {
    const now = performance.now();
    if (first !== null) {
      const rate = tokens > 1 ? ((tokens - 1) * 1000) / Math.max(1, now - first) : 0;
      answer.stats = `TTFT ${Math.round(first - started)} ms · ${rate.toFixed(1)} tokens/s` +
        (controller.signal.aborted ? " · stopped" : "");
    }
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    saveChats();
    drawChats();
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());

// ---------------------------------------------------------------- the engine, live

const seatColumns = []; // the last SEAT_STEPS steps: [[seat, "p" | "d"], ...]
let maxSeats = 0;

function color(name) {
  COLORS[name] ??= getComputedStyle(document.documentElement).getPropertyValue(`--${name}`).trim();
  return COLORS[name];
}

function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = Number(canvas.getAttribute("height"));
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  return [context, width, height];
}

function drawSeats() {
  const [context, width, height] = fitCanvas($("seats"));
  const rows = Math.max(maxSeats, 1);
  const w = width / SEAT_STEPS;
  const h = Math.min(height / rows, 16);
  seatColumns.forEach((seats, column) => {
    for (const [seat, phase] of seats) {
      context.fillStyle = color(phase === "p" ? "prefill" : "decode");
      context.fillRect(column * w, seat * h, Math.max(w - 0.5, 0.5), Math.max(h - 1, 1));
    }
  });
}

function drawBlocks(states) {
  const [context, width, height] = fitCanvas($("blocks"));
  const n = states.length;
  const side = Math.max(2, Math.floor(Math.sqrt((width * height) / Math.max(n, 1))));
  const perRow = Math.max(1, Math.floor(width / side));
  const names = { f: "free", u: "used", s: "shared", c: "cached" };
  for (let i = 0; i < n; i++) {
    context.fillStyle = color(names[states[i]]);
    context.fillRect((i % perRow) * side, Math.floor(i / perRow) * side, side - 1, side - 1);
  }
}

function ms(value) {
  return value === null || value === undefined ? "–" : `${value.toFixed(value < 10 ? 1 : 0)} ms`;
}

function update(snapshot) {
  for (const [step, , , seats] of snapshot.steps) {
    seatColumns.push(seats);
    for (const [seat] of seats) maxSeats = Math.max(maxSeats, seat + 1);
    $("stat-step").textContent = String(step);
  }
  seatColumns.splice(0, Math.max(0, seatColumns.length - SEAT_STEPS));
  $("stat-running").textContent = String(snapshot.running);
  $("stat-waiting").textContent = String(snapshot.waiting);
  $("stat-seats").textContent = String(maxSeats);
  $("stat-preemptions").textContent = String(snapshot.preemptions);
  const { queries, hits } = snapshot.prefix_cache;
  $("stat-hits").textContent = queries ? `${((100 * hits) / queries).toFixed(1)}%` : "–";
  const kv = snapshot.kv;
  $("kv-counts").textContent = `· ${kv.used} used, ${kv.shared} shared, ${kv.cached} cached, ${kv.free} free`;
  const rows = [["TTFT", "ttft"], ["ITL", "itl"], ["E2E", "e2e"]].map(([label, key]) => {
    const row = document.createElement("tr");
    for (const text of [label, ms(snapshot.latency_ms[key].p50), ms(snapshot.latency_ms[key].p99)]) {
      const cell = document.createElement(row.children.length ? "td" : "th");
      cell.textContent = text;
      row.append(cell);
    }
    return row;
  });
  $("latency").replaceChildren(...rows);
  drawSeats();
  drawBlocks(snapshot.blocks);
}

async function watchEngine() {
  for (;;) {
    try {
      const response = await api("/engine/events");
      if (!response.ok) {
        $("feed-status").textContent = (await response.json()).error?.message || response.statusText;
        return;
      }
      $("feed-status").textContent = "live";
      for await (const data of serverEvents(response)) update(JSON.parse(data));
    } catch (error) {
      $("feed-status").textContent = error.message;
      if (!$("key-form").hidden) return; // start() runs again once a key is given
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

const BURST_PROMPTS = [
  "Write a short poem about the sea.", "Explain what a KV cache is.", "List three uses of copper.",
  "Tell a story about a robot learning to paint.", "What is continuous batching?",
  "Describe a sunrise in the mountains.", "Give advice for a first marathon.",
];

// A browser opens at most 6 connections to a server, so the burst is 4 requests of several
// prompts each (the completions API takes a list): every prompt is a request in the engine, and
// each group stops at its own max_tokens, so seats free up at different steps.
const BURST_GROUPS = 4;

$("burst").addEventListener("submit", async (event) => {
  event.preventDefault();
  const count = Math.min(64, Math.max(1, Number($("burst-size").value) || 1));
  $("burst-status").textContent = `${count} sent`;
  let done = 0;
  const groups = Array.from({ length: Math.min(BURST_GROUPS, count) }, () => []);
  for (let i = 0; i < count; i++) groups[i % groups.length].push(BURST_PROMPTS[i % BURST_PROMPTS.length]);
  const one = (prompts, g) => api("/v1/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: modelName, prompt: prompts, max_tokens: 16 + 32 * g, temperature: 0.8 }),
  }).then((response) => {
    if (!response.ok) throw new Error(response.statusText);
    done += prompts.length;
    $("burst-status").textContent = `${done} of ${count} answered`;
  }).catch((error) => { $("burst-status").textContent = error.message; });
  await Promise.all(groups.map(one));
});

window.addEventListener("resize", drawSeats);

// ---------------------------------------------------------------- start

async function start() {
  try {
    const response = await api("/v1/models");
    modelName = (await response.json()).data[0].id;
    $("model-name").textContent = modelName;
  } catch (error) {
    $("feed-status").textContent = error.message;
    return;
  }
  watchEngine();
}

drawChats();
start();
