"use strict";
// The chat page: conversations in localStorage, markdown rendered by marked and sanitized by DOMPurify (vendored),
// one websocket (/v1/stream, docs/protocol.md) carrying the generations. No inline script: the page runs under a
// strict Content-Security-Policy.
const $ = (id) => document.getElementById(id);
const logEl = $("log"), form = $("form"), promptBox = $("prompt"), sendBtn = $("send"), stopBtn = $("stop");
const statusEl = $("status"), stats = $("stats"), ctxEl = $("ctx");
const STORE = {convs: "stagemesh.conversations", current: "stagemesh.current", settings: "stagemesh.settings",
               key: "stagemesh.apiKey"};
const MAX_CONVERSATIONS = 50;
const HINT = "Enter sends · Shift+Enter starts a new line";
const DEFAULTS = {system: "", temperature: 0.7, top_p: 0.95, max_tokens: null};  // max_tokens null: the gateway's

function load(name, fallback) {
  try { const v = JSON.parse(localStorage.getItem(name)); return v === null ? fallback : v; } catch { return fallback; }
}
const save = (name, value) => localStorage.setItem(name, JSON.stringify(value));

// What localStorage holds was written by an older page or edited by hand: only well-formed values are taken.
function validSettings(v) {
  const s = {...DEFAULTS}, ok = v && typeof v === "object";
  if (ok && typeof v.system === "string") s.system = v.system;
  if (ok && typeof v.temperature === "number" && v.temperature >= 0 && v.temperature <= 2) s.temperature = v.temperature;
  if (ok && typeof v.top_p === "number" && v.top_p > 0 && v.top_p <= 1) s.top_p = v.top_p;
  if (ok && Number.isInteger(v.max_tokens) && v.max_tokens >= 1) s.max_tokens = v.max_tokens;
  return s;
}
const validMessage = (m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string";
const validConversation = (c) => c && typeof c.id === "string" && Array.isArray(c.messages) && c.messages.every(validMessage);

let settings = validSettings(load(STORE.settings, {}));
let conversations = (Array.isArray(load(STORE.convs, [])) ? load(STORE.convs, []) : []).filter(validConversation);  // newest first
let conv = null;              // {id, title, messages: [{role, content}], updated, used}
let ws = null, current = null, counter = 0, retryMs = 1000, context = null, keyWanted = false;

// ---- markdown -------------------------------------------------------------------------------------------------
marked.setOptions({gfm: true, breaks: true});

function renderMarkdown(target, text) {
  target.innerHTML = DOMPurify.sanitize(marked.parse(text));
  for (const pre of target.querySelectorAll("pre")) {
    const b = document.createElement("button");
    b.type = "button"; b.className = "copy"; b.textContent = "Copy";
    b.addEventListener("click", () => copyText(pre.querySelector("code") ? pre.querySelector("code").textContent : pre.textContent, b));
    pre.appendChild(b);
  }
}

async function copyText(text, button) {
  try { await navigator.clipboard.writeText(text); } catch {
    const t = document.createElement("textarea"); t.value = text; document.body.appendChild(t); t.select();
    document.execCommand("copy"); t.remove();
  }
  button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

// ---- conversations --------------------------------------------------------------------------------------------
function persist() {
  if (conv && conv.messages.length) {
    conv.updated = Date.now();
    conversations = [conv, ...conversations.filter((c) => c.id !== conv.id)].slice(0, MAX_CONVERSATIONS);
  }
  try { save(STORE.convs, conversations); } catch {  // storage full: keep the newest half
    conversations = conversations.slice(0, Math.max(1, conversations.length >> 1)); save(STORE.convs, conversations);
  }
  if (conv) save(STORE.current, conv.id);
  drawList();
}

function newChat() {
  if (current) return;
  conv = {id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", messages: [], used: null};
  save(STORE.current, conv.id); drawConversation(); drawList(); promptBox.focus();
}

function openChat(id) {
  if (current) return;
  const found = conversations.find((c) => c.id === id);
  if (found) { conv = found; save(STORE.current, id); drawConversation(); drawList(); }
  $("app").classList.remove("show-sidebar");
}

function deleteChat(id) {
  conversations = conversations.filter((c) => c.id !== id); save(STORE.convs, conversations);
  if (conv && conv.id === id) newChat(); else drawList();
}

function drawList() {
  $("conversations").replaceChildren(...conversations.map((c) => {
    const li = document.createElement("li"), t = document.createElement("span"), del = document.createElement("button");
    li.className = conv && c.id === conv.id ? "active" : ""; li.dataset.id = c.id;
    t.className = "title"; t.textContent = c.title || "(untitled)"; t.title = t.textContent;
    t.addEventListener("click", () => openChat(c.id));
    del.className = "del"; del.type = "button"; del.textContent = "×"; del.title = "delete this conversation";
    del.addEventListener("click", () => deleteChat(c.id));
    li.append(t, del); return li;
  }));
}

function addMessage(role, text) {
  const div = document.createElement("div"), who = document.createElement("span"), body = document.createElement("div");
  div.className = "msg " + role; who.className = "who"; who.textContent = role === "user" ? "you" : "assistant";
  body.className = "body";
  if (role === "user") body.textContent = text; else renderMarkdown(body, text);
  div.append(who, body); logEl.appendChild(div); logEl.scrollTop = logEl.scrollHeight;
  return body;
}

function drawConversation() {
  logEl.replaceChildren();
  if (conv.dropped) {
    const d = document.createElement("div");
    d.className = "dropped"; d.textContent = `${conv.dropped} older messages were dropped to fit the model's context`;
    logEl.appendChild(d);
  }
  for (const m of conv.messages) addMessage(m.role, m.content);
  stats.textContent = conv.messages.length ? "" : HINT; drawContext();
}

function drawContext() {
  const used = conv && conv.used;
  ctxEl.textContent = context ? `context ${used || 0} / ${context}` : (used ? `context ${used}` : "");
  ctxEl.classList.toggle("full", Boolean(context && used && used >= context - 8));
}

// ---- the context limit: never a dead end ----------------------------------------------------------------------
function notice(text, withRetry) {
  const n = document.createElement("div"), p = document.createElement("div"), actions = document.createElement("div");
  n.className = "notice"; n.id = "context-notice"; p.textContent = text; actions.className = "actions";
  const drop = document.createElement("button"), fresh = document.createElement("button");
  drop.type = fresh.type = "button"; drop.id = "drop-oldest"; fresh.id = "start-anew"; fresh.className = "secondary";
  drop.textContent = withRetry ? "Drop the oldest turns and retry" : "Drop the oldest turns";
  fresh.textContent = "Start a new chat";
  drop.addEventListener("click", () => { n.remove(); dropOldest(withRetry); });
  fresh.addEventListener("click", () => {
    const last = withRetry ? conv.messages[conv.messages.length - 1].content : "";
    if (withRetry) { conv.messages.pop(); persist(); }
    newChat(); promptBox.value = last;
  });
  actions.append(drop, fresh); n.append(p, actions);
  const old = $("context-notice"); if (old) old.remove();
  logEl.appendChild(n); logEl.scrollTop = logEl.scrollHeight;
}

// Drops whole turns from the start until about a third of the conversation's text is gone (at least one turn),
// always keeping the newest user message; retry resends it.
function dropOldest(retry) {
  const msgs = conv.messages, keep = retry ? 1 : 0;
  const total = msgs.reduce((n, m) => n + m.content.length, 0);
  let dropped = 0, i = 0;
  while (i < msgs.length - keep && (i === 0 || dropped < total / 3 || msgs[i].role !== "user")) {
    dropped += msgs[i].content.length; i += 1;
  }
  if (i === 0) {
    const text = msgs.pop().content; persist(); drawConversation(); promptBox.value = text;
    stats.textContent = "this message alone does not fit the context: shorten it"; return;
  }
  conv.messages = msgs.slice(i); conv.used = null; conv.dropped = (conv.dropped || 0) + i; persist(); drawConversation();
  if (retry) generate();
}

// ---- generation over the websocket ----------------------------------------------------------------------------
function request() {
  const messages = settings.system ? [{role: "system", content: settings.system}, ...conv.messages] : conv.messages;
  const r = {type: "generate", id: current.id, messages, temperature: settings.temperature, top_p: settings.top_p};
  if (settings.max_tokens) r.max_tokens = settings.max_tokens;
  return r;
}

function generate() {
  current = {id: "r" + (++counter), text: "", tokens: 0, first: 0, el: addMessage("assistant", ""), frame: 0};
  ws.send(JSON.stringify(request()));
  sendBtn.disabled = true; stopBtn.disabled = false; stats.textContent = "waiting for the first token…";
}

// Streaming re-renders the markdown at most once per animation frame, however fast tokens come.
function scheduleRender() {
  if (current.frame) return;
  const c = current;
  c.frame = requestAnimationFrame(() => {
    c.frame = 0; renderMarkdown(c.el, c.text); logEl.scrollTop = logEl.scrollHeight;
  });
}

function onEvent(ev) {
  if (!current || ev.id !== current.id) { if (ev.type === "error" && !ev.id) stats.textContent = ev.message; return; }
  if (ev.type === "token") {
    if (!current.first) current.first = performance.now();
    current.tokens += 1; current.text += ev.text; scheduleRender();
    const secs = (performance.now() - current.first) / 1000;
    if (current.tokens > 1 && secs > 0) stats.textContent = `${current.tokens} tokens · ${((current.tokens - 1) / secs).toFixed(1)} tokens/s`;
  } else if (ev.type === "done") {
    const c = current, t = ev.timings || {};
    if (c.frame) cancelAnimationFrame(c.frame);
    renderMarkdown(c.el, c.text);
    const tps = t.per_token_ms ? (1000 / t.per_token_ms).toFixed(1) : "–";
    const why = {length: "cut at the token limit", stop: "done", cancelled: "stopped"}[ev.finish_reason] || ev.finish_reason;
    stats.textContent = `${ev.usage.completion_tokens} tokens · ${tps} tokens/s · first token after ` +
                        `${Math.round(t.ttft_ms)} ms · ${why}`;
    conv.messages.push({role: "assistant", content: c.text});
    conv.used = ev.usage.prompt_tokens + ev.usage.completion_tokens;
    finish(); persist(); drawContext();
    if (ev.finish_reason === "length" && context && conv.used >= context - 8) {
      notice(`The conversation has filled the model's context (${context} tokens): the answer was cut. ` +
             "Drop the oldest turns to go on, or start a new chat.", false);
    }
  } else if (ev.type === "error") {
    const c = current;
    if (c.frame) cancelAnimationFrame(c.frame);
    c.el.parentElement.remove(); finish(); stats.textContent = "";
    if (ev.code === "context_length_exceeded") {
      notice(`This conversation no longer fits the model's context${context ? ` (${context} tokens)` : ""}. ` +
             "Drop the oldest turns and retry, or start a new chat with your message.", true);
    } else {  // the message goes back to the box, to edit or resend
      const m = conv.messages.pop(); persist(); drawConversation(); promptBox.value = m ? m.content : "";
      stats.textContent = ""; const e = document.createElement("div");
      e.className = "msg error"; e.textContent = ev.message; logEl.appendChild(e);
    }
  }
}

function finish() { current = null; sendBtn.disabled = !(ws && ws.readyState === 1); stopBtn.disabled = true; promptBox.focus(); }

form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = promptBox.value.trim();
  if (!text || current || !ws || ws.readyState !== 1) return;
  const old = $("context-notice"); if (old) old.remove();
  if (!conv.title) conv.title = text.slice(0, 60);
  conv.messages.push({role: "user", content: text}); addMessage("user", text); promptBox.value = "";
  persist(); generate();
});
promptBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); form.requestSubmit(); }
});
stopBtn.addEventListener("click", () => { if (current && ws) ws.send(JSON.stringify({type: "cancel", id: current.id})); });
$("new-chat").addEventListener("click", () => { newChat(); $("app").classList.remove("show-sidebar"); });
$("toggle-sidebar").addEventListener("click", (e) => { e.stopPropagation(); $("app").classList.toggle("show-sidebar"); });
document.querySelector("main").addEventListener("click", () => $("app").classList.remove("show-sidebar"));

// ---- settings -------------------------------------------------------------------------------------------------
function drawSettings() {
  $("set-system").value = settings.system; $("set-temperature").value = settings.temperature;
  $("set-top-p").value = settings.top_p; $("set-max-tokens").value = settings.max_tokens || "";
}
$("open-settings").addEventListener("click", () => { drawSettings(); $("settings").hidden = !$("settings").hidden; });
$("settings").addEventListener("submit", (e) => {
  e.preventDefault();
  const num = (id) => $(id).value === "" ? null : Number($(id).value);
  const next = {system: $("set-system").value.trim(), temperature: num("set-temperature") ?? DEFAULTS.temperature,
                top_p: num("set-top-p") ?? DEFAULTS.top_p, max_tokens: num("set-max-tokens")};
  const bad = !(next.temperature >= 0 && next.temperature <= 2) ? "temperature must be 0..2"
    : !(next.top_p > 0 && next.top_p <= 1) ? "top-p must be in (0, 1]"
    : next.max_tokens !== null && !(Number.isInteger(next.max_tokens) && next.max_tokens >= 1) ? "max tokens must be a whole number >= 1, or empty for auto"
    : null;
  if (bad) { $("settings-note").textContent = bad; return; }
  settings = next; save(STORE.settings, settings); $("settings-note").textContent = "saved"; $("settings").hidden = true;
});

// ---- the gateway: API key, model name, context, websocket -----------------------------------------------------
const apiKey = () => localStorage.getItem(STORE.key) || "";
const authHeaders = () => apiKey() ? {Authorization: "Bearer " + apiKey()} : {};

$("forget-key").addEventListener("click", () => { localStorage.removeItem(STORE.key); $("settings-note").textContent = "key forgotten"; });
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const k = $("api-key").value.trim();
  if (!k) return;
  localStorage.setItem(STORE.key, k); $("api-key").value = ""; $("key-form").hidden = true; keyWanted = false;
  start();
});

function askKey(message) {
  keyWanted = true; $("key-form").hidden = false; $("key-error").textContent = message || "";
  statusEl.textContent = "API key needed"; sendBtn.disabled = true; $("api-key").focus();
}

// The model name and this deployment's context (the smallest any stage holds) from the info endpoints; a 401
// means a key is needed (asked once, then kept in localStorage) -- the websocket would be refused too.
async function fetchInfo() {
  const r = await fetch("/v1/models", {headers: authHeaders()});
  if (r.status === 401) { askKey(apiKey() ? "that key was refused" : ""); return false; }
  if (r.ok) { const m = await r.json(); $("model").textContent = m.data && m.data[0] ? m.data[0].id : ""; }
  const mesh = await fetch("/v1/mesh", {headers: authHeaders()});
  if (mesh.ok) {
    const lens = (await mesh.json()).stages.map((s) => s.kv_max_seq_len).filter((n) => Number.isInteger(n));
    context = lens.length ? Math.min(...lens) : null; drawContext();
  }
  return true;
}

function connect() {
  if (keyWanted) return;
  const q = apiKey() ? "?api_key=" + encodeURIComponent(apiKey()) : "";
  const sock = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/stream" + q);
  ws = sock;
  sock.onopen = () => {
    retryMs = 1000; statusEl.textContent = "connected"; statusEl.className = "ok"; sendBtn.disabled = Boolean(current);
  };
  sock.onmessage = (event) => onEvent(JSON.parse(event.data));
  sock.onclose = () => {
    if (ws !== sock) return;
    if (current) onEvent({type: "error", id: current.id, code: "disconnected", message: "the connection dropped; send again"});
    sendBtn.disabled = true; statusEl.textContent = "disconnected, retrying…"; statusEl.className = "";
    // a refused upgrade looks like any other close: ask the info endpoint whether the key is the reason
    setTimeout(() => fetchInfo().then((ok) => { if (ok) connect(); }, () => connect()), retryMs);
    retryMs = Math.min(10000, retryMs * 2);
  };
}

async function start() {
  try { if (!(await fetchInfo())) return; } catch { /* the gateway is not up yet: the websocket retries */ }
  connect();
}

const remembered = load(STORE.current, null);
conv = conversations.find((c) => c.id === remembered) || null;
if (conv) { drawConversation(); drawList(); } else newChat();
start();
