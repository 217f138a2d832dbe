"use strict";
// The chat page: conversations in localStorage, markdown rendered by marked and sanitized by DOMPurify, code
// highlighted by highlight.js (all three vendored), one websocket (/v1/stream, docs/protocol.md) carrying the
// generations. No inline script: the page runs under a strict Content-Security-Policy.
const $ = (id) => document.getElementById(id);
const logEl = $("log"), form = $("form"), promptBox = $("prompt"), sendBtn = $("send"), stopBtn = $("stop");
const statusEl = $("status"), stats = $("stats"), ctxEl = $("ctx");
const STORE = {convs: "stagemesh.conversations", current: "stagemesh.current", settings: "stagemesh.settings",
               key: "stagemesh.apiKey", theme: "stagemesh.theme"};
const MAX_CONVERSATIONS = 50;
const HINT = "Enter sends · Shift+Enter starts a new line";
// The page's sampler defaults (the API's own, for a request that leaves a field out: temperature 1, top-p 1, no
// max_tokens = until the context is full). Settings show both; what a request sends is what the settings show.
const DEFAULTS = {system: "", temperature: 0.7, top_p: 0.95, max_tokens: null, mode: "auto"};  // max_tokens null: "auto"
// mode: "chat" sends the conversation as messages (the model's chat template renders them); "complete" sends its
// text as one prompt and the model continues it (a base model, or one with no chat template); "auto": chat where
// /v1/models lists the "chat" capability, else complete.
const MODES = ["auto", "chat", "complete"];
const API_DEFAULTS = {temperature: 1, top_p: 1};
const AUTO_MAX_TOKENS = 1024;  // "auto": at most this, or what is left of the context if less; "Continue" goes on
const EXPORT_KIND = "stagemesh.conversations";

function load(name, fallback) {
  try { const v = JSON.parse(localStorage.getItem(name)); return v === null ? fallback : v; } catch { return fallback; }
}
const save = (name, value) => localStorage.setItem(name, JSON.stringify(value));

// What localStorage holds was written by an older page, edited by hand or imported: only well-formed values are taken.
function validSettings(v) {
  const s = {...DEFAULTS}, ok = v && typeof v === "object";
  if (ok && typeof v.system === "string") s.system = v.system;
  if (ok && typeof v.temperature === "number" && v.temperature >= 0 && v.temperature <= 2) s.temperature = v.temperature;
  if (ok && typeof v.top_p === "number" && v.top_p > 0 && v.top_p <= 1) s.top_p = v.top_p;
  if (ok && Number.isInteger(v.max_tokens) && v.max_tokens >= 1) s.max_tokens = v.max_tokens;
  if (ok && MODES.includes(v.mode)) s.mode = v.mode;
  return s;
}
// A message: {role, content, cut?, alts?, alt?}. `alts` are the branches at this place of the conversation: each a
// whole tail from here on (a list of messages, themselves possibly branching), except alts[alt] = null, the one
// shown (this message and those after it in conv.messages).
const MAX_DEPTH = 100;
function validMessage(m, depth = 0) {
  if (!(m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string")) return false;
  if (m.cut !== undefined && typeof m.cut !== "boolean") return false;
  if (m.alts === undefined) return m.alt === undefined;
  return depth < MAX_DEPTH && Array.isArray(m.alts) && Number.isInteger(m.alt) && m.alt >= 0 && m.alt < m.alts.length
    && m.alts.every((t, i) => i === m.alt ? t === null
      : Array.isArray(t) && t.length > 0 && t[0].role === m.role && t.every((x) => validMessage(x, depth + 1)));
}
const validConversation = (c) => Boolean(c && typeof c.id === "string" && c.id && Array.isArray(c.messages)
  && c.messages.every((m) => validMessage(m)) && (c.title === undefined || typeof c.title === "string"));

let settings = validSettings(load(STORE.settings, {}));
let conversations = (Array.isArray(load(STORE.convs, [])) ? load(STORE.convs, []) : []).filter(validConversation);  // newest first
let conv = null;              // {id, title, messages: [{role, content, ...}], updated, used}
let ws = null, current = null, counter = 0, retryMs = 1000, context = null, keyWanted = false;
let modelChats = true;        // /v1/models lists "chat": the model has a chat template
const completing = () => settings.mode === "complete" || (settings.mode === "auto" && !modelChats);

// ---- theme: the system's (prefers-color-scheme) unless the settings pick one ------------------------------------
const darkQuery = matchMedia("(prefers-color-scheme: dark)");
function applyTheme() {
  const pref = localStorage.getItem(STORE.theme) || "auto";
  const dark = pref === "dark" || (pref !== "light" && darkQuery.matches);
  document.documentElement.dataset.theme = dark ? "dark" : "light";
  $("hljs-light").media = dark ? "not all" : "all"; $("hljs-dark").media = dark ? "all" : "not all";
}
darkQuery.addEventListener("change", applyTheme);
applyTheme();

// ---- markdown -------------------------------------------------------------------------------------------------
marked.setOptions({gfm: true, breaks: true});
const MAX_AUTODETECT = 20000;  // characters: longer blocks without a language stay plain

// highlight.js escapes the text it wraps in its spans; the result is sanitized once more all the same.
function highlightCode(code) {
  const m = /\blanguage-([\w#+.-]+)/.exec(code.className), lang = m && hljs.getLanguage(m[1]) ? m[1] : null;
  const text = code.textContent;
  if (!lang && text.length > MAX_AUTODETECT) return;
  const r = lang ? hljs.highlight(text, {language: lang, ignoreIllegals: true}) : hljs.highlightAuto(text);
  code.innerHTML = DOMPurify.sanitize(r.value); code.classList.add("hljs");
  if (r.language) code.dataset.language = r.language;
}

function renderMarkdown(target, text) {
  target.innerHTML = DOMPurify.sanitize(marked.parse(text));
  for (const pre of target.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    if (code) highlightCode(code);
    const b = document.createElement("button");
    b.type = "button"; b.className = "copy"; b.textContent = "Copy";
    b.addEventListener("click", () => copyText(code ? code.textContent : pre.textContent, b));
    pre.appendChild(b);
  }
}

async function copyText(text, button) {
  const label = button.textContent;
  try { await navigator.clipboard.writeText(text); } catch {
    const t = document.createElement("textarea"); t.value = text; document.body.appendChild(t); t.select();
    document.execCommand("copy"); t.remove();
  }
  button.textContent = "Copied"; setTimeout(() => { button.textContent = label; }, 1200);
}

// ---- conversations --------------------------------------------------------------------------------------------
function persist() {
  if (conv && conv.messages.length) {
    conv.updated = Date.now();
    conversations = [conv, ...conversations.filter((c) => c.id !== conv.id)].slice(0, MAX_CONVERSATIONS);
  }
  storeAll();
  if (conv) save(STORE.current, conv.id);
  drawList();
}

function storeAll() {
  try { save(STORE.convs, conversations); } catch {  // storage full: keep the newest half
    conversations = conversations.slice(0, Math.max(1, conversations.length >> 1)); save(STORE.convs, conversations);
  }
}

const newId = () => "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6);

function newChat() {
  if (current) return;
  conv = {id: newId(), title: "", messages: [], used: null};
  save(STORE.current, conv.id); drawConversation(); drawList(); promptBox.focus();
}

function openChat(id) {
  if (current) return;
  const found = conversations.find((c) => c.id === id);
  if (found) { conv = found; save(STORE.current, id); drawConversation(); drawList(); }
  $("app").classList.remove("show-sidebar");
}

function deleteChat(id) {
  if (current && conv && conv.id === id) return;
  conversations = conversations.filter((c) => c.id !== id); storeAll();
  if (conv && conv.id === id) newChat(); else drawList();
}

function renameChat(li, c) {
  const input = document.createElement("input");
  input.className = "rename"; input.value = c.title || ""; input.setAttribute("aria-label", "conversation title");
  let done = false;
  const end = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) { c.title = input.value.trim().slice(0, 120); storeAll(); }
    drawList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); end(true); } else if (e.key === "Escape") end(false);
  });
  input.addEventListener("blur", () => end(true));
  li.querySelector(".title").replaceWith(input); input.focus(); input.select();
}

// every string a conversation holds (its branches too), for the search box
function searchable(c) {
  const out = [c.title || ""];
  const walk = (msgs) => { for (const m of msgs) { out.push(m.content); for (const t of m.alts || []) if (t) walk(t); } };
  walk(c.messages);
  return out.join("\n").toLowerCase();
}

function drawList() {
  const q = $("search").value.trim().toLowerCase();
  const shown = conversations.filter((c) => !q || searchable(c).includes(q));
  const button = (cls, text, title, action) => {
    const b = document.createElement("button");
    b.className = cls; b.type = "button"; b.textContent = text; b.title = title; b.setAttribute("aria-label", title);
    b.addEventListener("click", (e) => { e.stopPropagation(); action(); });
    return b;
  };
  $("conversations").replaceChildren(...shown.map((c) => {
    const li = document.createElement("li"), t = document.createElement("span");
    li.className = conv && c.id === conv.id ? "active" : ""; li.dataset.id = c.id;
    t.className = "title"; t.textContent = c.title || "(untitled)"; t.title = t.textContent;
    t.addEventListener("click", () => openChat(c.id));
    t.addEventListener("dblclick", () => renameChat(li, c));
    li.append(t, button("rename", "✎", "rename this conversation", () => renameChat(li, c)),
              button("export", "⤓", "export this conversation (JSON)", () => exportConversations([c])),
              button("del", "×", "delete this conversation", () => deleteChat(c.id)));
    return li;
  }));
  const note = $("conv-note"), none = "no conversation matches";
  if (q && !shown.length) note.textContent = none; else if (note.textContent === none) note.textContent = "";
}

// ---- export and import: JSON files, checked before anything is kept -------------------------------------------
function exportConversations(list) {
  const body = {kind: EXPORT_KIND, version: 1, exported: new Date().toISOString(),
                conversations: list.map(({id, title, messages, updated, dropped}) => ({id, title, messages, updated, dropped}))};
  const a = document.createElement("a"), stamp = new Date().toISOString().slice(0, 10);
  a.href = URL.createObjectURL(new Blob([JSON.stringify(body, null, 1)], {type: "application/json"}));
  a.download = list.length === 1 ? `stagemesh-chat-${stamp}-${list[0].id}.json` : `stagemesh-chats-${stamp}.json`;
  document.body.appendChild(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

// An export of this page (one or all conversations), or a bare list of conversations: all or nothing.
function parseImport(text) {
  let data;
  try { data = JSON.parse(text); } catch { throw new Error("this file is not JSON"); }
  const list = Array.isArray(data) ? data : data && data.kind === EXPORT_KIND ? data.conversations : null;
  if (!Array.isArray(list)) throw new Error("this file is not an export of stagemesh conversations");
  if (!list.length) throw new Error("this file holds no conversations");
  list.forEach((c, i) => {
    if (!validConversation(c)) throw new Error(`conversation ${i + 1} of the file is malformed (each needs an id and ` +
                                               "messages of role user or assistant with text content)");
  });
  return list.map((c) => ({id: c.id, title: c.title || "", messages: c.messages, used: null,
                           updated: Number.isFinite(c.updated) ? c.updated : Date.now(),
                           ...(Number.isInteger(c.dropped) && c.dropped > 0 ? {dropped: c.dropped} : {})}));
}

function importConversations(text) {
  let list;
  try { list = parseImport(text); } catch (e) { return `Import failed, nothing changed: ${e.message}`; }
  const have = new Map(conversations.map((c) => [c.id, JSON.stringify(c.messages)]));
  const fresh = [];
  for (const c of list) {
    if (have.get(c.id) === JSON.stringify(c.messages)) continue;  // already here, as it is
    if (have.has(c.id) || fresh.some((f) => f.id === c.id)) c.id = newId() + fresh.length;  // a different one: both kept
    fresh.push(c);
  }
  if (conversations.length + fresh.length > MAX_CONVERSATIONS) {
    return `Import failed, nothing changed: the browser keeps at most ${MAX_CONVERSATIONS} conversations and this ` +
           `would make ${conversations.length + fresh.length}; delete some first`;
  }
  conversations = [...conversations, ...fresh].sort((a, b) => (b.updated || 0) - (a.updated || 0));
  storeAll(); drawList();
  const skipped = list.length - fresh.length;
  return `imported ${fresh.length} conversation${fresh.length === 1 ? "" : "s"}` + (skipped ? ` (${skipped} already here)` : "");
}

$("export-all").addEventListener("click", () => {
  if (conversations.length) exportConversations(conversations); else $("conv-note").textContent = "nothing to export yet";
});
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", async () => {
  const f = $("import-file").files[0];
  if (!f) return;
  const note = f.size > 20e6 ? "Import failed, nothing changed: the file is over 20 MB" : importConversations(await f.text());
  $("import-file").value = "";
  $("conv-note").textContent = note; $("conv-note").classList.toggle("error", note.startsWith("Import failed"));
});
$("search").addEventListener("input", drawList);

// ---- messages: copy, edit, regenerate, continue, branches ------------------------------------------------------
const plain = ({alts, alt, ...m}) => m;  // eslint-disable-line no-unused-vars

// Replaces conv.messages[i:] by nothing, keeping them as a branch of place i; returns the branch fields the message
// that takes place i carries.
function fork(i) {
  const old = conv.messages[i], alts = old.alts ? old.alts.slice() : [null];
  alts[old.alts ? old.alt : 0] = [plain(old), ...conv.messages.slice(i + 1)];
  conv.messages = conv.messages.slice(0, i); conv.used = null;
  return {alts: [...alts, null], alt: alts.length};
}

function showBranch(i, j) {
  if (current) return;
  const m = conv.messages[i], alts = m.alts.slice();
  if (j < 0 || j >= alts.length || j === m.alt) return;
  alts[m.alt] = [plain(m), ...conv.messages.slice(i + 1)];
  const tail = alts[j]; alts[j] = null;
  conv.messages = [...conv.messages.slice(0, i), {...tail[0], alts, alt: j}, ...tail.slice(1)];
  conv.used = null; persist(); drawConversation();
}

const snapshot = () => JSON.parse(JSON.stringify(conv.messages));

function regenerate() {
  if (current || !ready()) return;
  const before = snapshot(), branch = fork(conv.messages.length - 1);
  persist(); drawConversation(); generate({branch, before});
}

function editMessage(i, text) {
  if (current || !ready() || !text.trim()) return;
  const before = snapshot(), branch = fork(i);
  conv.messages.push({role: "user", content: text.trim(), ...branch});
  persist(); drawConversation(); generate({before});
}

function continueAnswer() {
  if (current || !ready()) return;
  const bodies = logEl.querySelectorAll(".msg.assistant .body");
  generate({cont: true, el: bodies[bodies.length - 1]});
}

function startEdit(div, i) {
  const m = conv.messages[i], box = document.createElement("textarea"), row = document.createElement("div");
  box.className = "edit-box"; box.value = m.content; box.rows = Math.min(10, m.content.split("\n").length + 1);
  const sendEdit = document.createElement("button"), cancel = document.createElement("button");
  sendEdit.type = cancel.type = "button"; sendEdit.className = "save-edit"; cancel.className = "secondary";
  sendEdit.textContent = "Send"; cancel.textContent = "Cancel";
  sendEdit.addEventListener("click", () => editMessage(i, box.value));
  cancel.addEventListener("click", drawConversation);
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); editMessage(i, box.value); }
    else if (e.key === "Escape") drawConversation();
  });
  row.className = "actions"; row.append(sendEdit, cancel);
  div.querySelector(".body").replaceWith(box); div.querySelector(".actions").replaceWith(row); box.focus();
}

function actionButton(cls, text, title, action) {
  const b = document.createElement("button");
  b.type = "button"; b.className = cls; b.textContent = text; b.title = title;
  b.addEventListener("click", () => action(b));
  return b;
}

function messageActions(div, m, i) {
  const bar = document.createElement("div"), last = i === conv.messages.length - 1;
  bar.className = "actions";
  if (m.alts && m.alts.length > 1) {
    const nav = document.createElement("span"), label = document.createElement("span");
    nav.className = "branches"; label.textContent = `${m.alt + 1}/${m.alts.length}`; label.className = "branch-label";
    nav.append(actionButton("prev-branch", "‹", "previous version", () => showBranch(i, m.alt - 1)), label,
               actionButton("next-branch", "›", "next version", () => showBranch(i, m.alt + 1)));
    nav.firstChild.disabled = m.alt === 0; nav.lastChild.disabled = m.alt === m.alts.length - 1;
    bar.appendChild(nav);
  }
  bar.appendChild(actionButton("copy-msg", "Copy", "copy this message (markdown)", (b) => copyText(m.content, b)));
  if (m.role === "user") bar.appendChild(actionButton("edit", "Edit", "edit and send again from here", () => startEdit(div, i)));
  if (m.role === "assistant" && last) {
    bar.appendChild(actionButton("regenerate", "Regenerate", "a new answer; this one stays as a version", regenerate));
    if (m.cut) bar.appendChild(actionButton("continue", "Continue", "generate more of this answer", continueAnswer));
  }
  return bar;
}

function addMessage(role, text, i) {
  const div = document.createElement("div"), who = document.createElement("span"), body = document.createElement("div");
  div.className = "msg " + role; who.className = "who"; who.textContent = role === "user" ? "you" : "assistant";
  body.className = "body";
  if (role === "user") body.textContent = text; else renderMarkdown(body, text);
  div.append(who, body);
  if (i !== undefined) { div.dataset.index = i; div.appendChild(messageActions(div, conv.messages[i], i)); }
  logEl.appendChild(div); logEl.scrollTop = logEl.scrollHeight;
  return body;
}

function drawConversation() {
  logEl.replaceChildren();
  if (conv.dropped) {
    const d = document.createElement("div");
    d.className = "dropped"; d.textContent = `${conv.dropped} older messages were dropped to fit the model's context`;
    logEl.appendChild(d);
  }
  conv.messages.forEach((m, i) => addMessage(m.role, m.content, i));
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
const ready = () => Boolean(conv && ws && ws.readyState === 1);

// What "auto" max tokens sends: AUTO_MAX_TOKENS, or less when the context has less room left (the room is at most
// context - conv.used, the last turn's prompt + answer: the next prompt holds them). Where the prompt leaves less
// room than that, the gateway refuses max_tokens and the page asks again without it: all the room there is.
function autoMaxTokens() {
  return context ? Math.max(1, Math.min(AUTO_MAX_TOKENS, context - ((conv && conv.used) || 0))) : AUTO_MAX_TOKENS;
}

function request() {
  const sampling = {type: "generate", id: current.id, temperature: settings.temperature, top_p: settings.top_p};
  // completing: the conversation is one text (what was written and what the model added, in order), continued
  const r = completing() ? {...sampling, prompt: conv.messages.map((m) => m.content).join("")} : {...sampling,
    messages: (settings.system ? [{role: "system", content: settings.system}, ...conv.messages] : conv.messages)
      .map((m) => ({role: m.role, content: m.content}))};
  if (settings.max_tokens) r.max_tokens = settings.max_tokens;
  else if (!current.uncapped) r.max_tokens = autoMaxTokens();
  if (current.cont && !completing()) r.continue_final_message = true;  // the answer goes on instead of a new turn
  return r;
}

// opts: {branch} (regenerate: the fields the new answer carries), {before} (the messages to restore on an error),
// {cont, el} (continue the last answer, drawn in el).
function generate(opts = {}) {
  const el = opts.cont ? opts.el : addMessage("assistant", "");
  const text = opts.cont ? conv.messages[conv.messages.length - 1].content : "";
  current = {id: "r" + (++counter), text, start: text.length, tokens: 0, first: 0, el, frame: 0, ...opts};
  if (opts.cont) {  // its buttons go while it grows
    const bar = el.parentElement.querySelector(".actions"); if (bar) bar.remove();
  }
  ws.send(JSON.stringify(request()));
  sendBtn.disabled = true; stopBtn.disabled = false; stats.textContent = "waiting for the first token…";
  for (const b of logEl.querySelectorAll(".actions button")) b.disabled = true;
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
    const tps = t.per_token_ms ? (1000 / t.per_token_ms).toFixed(1) : "–";
    const full = ev.finish_reason === "length" && context && ev.usage.total_tokens >= context - 8;
    const why = {length: full ? "cut: the context is full" : "stopped at the token limit: Continue goes on",
                 stop: "done", cancelled: "stopped"}[ev.finish_reason] || ev.finish_reason;
    const cut = ev.finish_reason === "length" && !full ? {cut: true} : {};
    if (c.cont) {
      const {cut: _, ...m} = conv.messages.pop();  // eslint-disable-line no-unused-vars
      conv.messages.push({...m, content: c.text, ...cut});
    } else {
      conv.messages.push({role: "assistant", content: c.text, ...cut, ...(c.branch || {})});
    }
    conv.used = ev.usage.prompt_tokens + ev.usage.completion_tokens;
    finish(); persist(); drawConversation();
    stats.textContent = `${ev.usage.completion_tokens} tokens · ${tps} tokens/s · first token after ` +
                        `${Math.round(t.ttft_ms)} ms · ${why}`;
    if (full) {
      notice(`The conversation has filled the model's context (${context} tokens): the answer was cut. ` +
             "Drop the oldest turns to go on, or start a new chat.", false);
    }
  } else if (ev.type === "error") {
    const c = current;
    if (c.frame) cancelAnimationFrame(c.frame);
    if (ev.param === "max_tokens" && !settings.max_tokens && !c.uncapped) {
      c.uncapped = true; ws.send(JSON.stringify(request())); return;  // less room than the auto cap: all there is
    }
    finish(); stats.textContent = "";
    if (c.before || c.cont) {  // an edit, a regenerate or a continue: the conversation as it was, and the error
      if (c.before) conv.messages = c.before;
      persist(); drawConversation();
      if (ev.code === "context_length_exceeded") {
        notice(`This conversation no longer fits the model's context${context ? ` (${context} tokens)` : ""}. ` +
               "Drop the oldest turns, or start a new chat.", false);
      } else {
        const e = document.createElement("div"); e.className = "msg error"; e.textContent = ev.message; logEl.appendChild(e);
      }
    } else if (ev.code === "context_length_exceeded") {
      c.el.parentElement.remove();
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
  conv.messages.push({role: "user", content: text}); promptBox.value = "";
  persist(); drawConversation(); generate();
});
promptBox.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); form.requestSubmit(); }
});
stopBtn.addEventListener("click", () => { if (current && ws) ws.send(JSON.stringify({type: "cancel", id: current.id})); });
$("new-chat").addEventListener("click", () => { newChat(); $("app").classList.remove("show-sidebar"); });
$("toggle-sidebar").addEventListener("click", (e) => { e.stopPropagation(); $("app").classList.toggle("show-sidebar"); });
document.querySelector("main").addEventListener("click", () => $("app").classList.remove("show-sidebar"));

// ---- settings -------------------------------------------------------------------------------------------------
// The page says which way it sends: a model without a chat template continues text, and the box asks for that.
function drawMode() {
  const plain = completing();
  $("mode-note").hidden = !plain;
  $("mode-note").textContent = !plain ? "" : modelChats ? "Text completion (settings): the model continues your text."
    : "This model has no chat template: the page completes text. Write the start of something and the model continues it.";
  promptBox.placeholder = plain ? "Write the start of a text…" : "Ask something…";
}

function drawSettings() {
  $("set-system").value = settings.system; $("set-temperature").value = settings.temperature;
  $("set-top-p").value = settings.top_p; $("set-max-tokens").value = settings.max_tokens || "";
  $("set-theme").value = localStorage.getItem(STORE.theme) || "auto";
  $("set-mode").value = settings.mode;
  $("hint-mode").textContent = `auto: ${modelChats ? "chat (the model has a chat template)" : "complete (the model has no chat template)"}`;
  $("hint-temperature").textContent = `page default ${DEFAULTS.temperature} (the API's: ${API_DEFAULTS.temperature})`;
  $("hint-top-p").textContent = `page default ${DEFAULTS.top_p} (the API's: ${API_DEFAULTS.top_p})`;
  $("hint-max-tokens").textContent = `auto: ${AUTO_MAX_TOKENS.toLocaleString("en-US")}, or what the context has left`;
  drawEffective();
}

// The values the next request sends, as the form stands (empty = the page's default).
function drawEffective() {
  const v = (id, dflt) => $(id).value === "" ? dflt : $(id).value;
  const max = $("set-max-tokens").value;
  $("set-effective").textContent = `Each request sends: temperature ${v("set-temperature", DEFAULTS.temperature)} · ` +
    `top-p ${v("set-top-p", DEFAULTS.top_p)} · max tokens ${max || `${autoMaxTokens()} (auto)`}`;
}
for (const id of ["set-temperature", "set-top-p", "set-max-tokens"]) $(id).addEventListener("input", drawEffective);
$("set-theme").addEventListener("change", () => {
  const v = $("set-theme").value;
  if (v === "auto") localStorage.removeItem(STORE.theme); else localStorage.setItem(STORE.theme, v);
  applyTheme();
});
$("open-settings").addEventListener("click", () => { drawSettings(); $("settings").hidden = !$("settings").hidden; });
$("settings").addEventListener("submit", (e) => {
  e.preventDefault();
  const num = (id) => $(id).value === "" ? null : Number($(id).value);
  const next = {system: $("set-system").value.trim(), temperature: num("set-temperature") ?? DEFAULTS.temperature,
                top_p: num("set-top-p") ?? DEFAULTS.top_p, max_tokens: num("set-max-tokens"), mode: $("set-mode").value};
  const bad = !(next.temperature >= 0 && next.temperature <= 2) ? "temperature must be 0..2"
    : !(next.top_p > 0 && next.top_p <= 1) ? "top-p must be in (0, 1]"
    : next.max_tokens !== null && !(Number.isInteger(next.max_tokens) && next.max_tokens >= 1) ? "max tokens must be a whole number >= 1, or empty for auto"
    : null;
  if (bad) { $("settings-note").textContent = bad; return; }
  settings = next; save(STORE.settings, settings); $("settings-note").textContent = "saved"; $("settings").hidden = true;
  drawMode();
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
  if (r.ok) {
    const m = await r.json(), model = m.data && m.data[0];
    modelChats = !(model && Array.isArray(model.capabilities) && !model.capabilities.includes("chat"));
    $("model").textContent = model ? model.id : ""; drawMode();
  }
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
