"use strict";
// ---- the mesh view (#mesh): one stream of snapshots from the gateway (GET /v1/mesh/stream), drawn here ----------
const meshEl = document.getElementById("mesh"), chatEl = document.getElementById("app");
let meshSource = null, meshSnapshot = null;
const CHARTS = [["tokens_per_s", "tokens/s", 0], ["ttft_ms", "TTFT (ms, 10 s)", 0], ["queue", "queue", 0],
                ["running", "running sequences", 0], ["inflight", "micro-batches in flight", 0]];

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
const fmt = (x, digits, unit) => (x === null || x === undefined) ? "–" : x.toFixed(digits) + (unit || "");

function row(name, value) { const r = el("div", "row"); r.append(el("span", "", name), el("span", "", value)); return r; }

function bar(fraction) {
  const b = el("div", "bar"), f = el("div");
  f.style.width = Math.round(100 * Math.max(0, Math.min(1, fraction || 0))) + "%"; b.appendChild(f); return b;
}

function hop(ms, title) {
  const h = el("div", "hop"); h.title = title;
  h.append(el("div", "", fmt(ms, 2, " ms")), el("div", "arrow", "→"), el("div", "", "hop"));
  return h;
}

function stageNode(s) {
  const n = el("div", "node"); n.id = "stage-" + (s.pipeline ? s.pipeline + "-" : "") + s.index; n.dataset.state = s.state;
  const h = el("h3"); h.append(el("span", "", "stage " + s.index), el("span", "badge " + s.state, s.state)); n.appendChild(h);
  n.appendChild(el("div", "addr", s.url + (s.listen ? "  " + s.listen : "")));
  if (s.state === "lost" || s.state === "unknown") {
    n.appendChild(el("div", "error", s.error || "no answer"));
  } else {
    n.appendChild(row("layers", s.layers ? s.layers[0] + ":" + s.layers[1] + " (" + s.position + ")" : "–"));
    n.appendChild(row("busy (last 10 s)", fmt(s.busy_fraction === null ? null : 100 * s.busy_fraction, 0, "%")));
    n.appendChild(bar(s.busy_fraction));
    n.appendChild(row("compute per micro-batch", fmt(s.compute_ms, 1, " ms")));
    n.appendChild(row("KV slots", s.kv_slots === undefined ? "–" : s.kv_slots_used + " of " + s.kv_slots + " in use"));
    n.appendChild(bar(s.kv_slots ? s.kv_slots_used / s.kv_slots : 0));
    if (typeof s.kv_slots_cached === "number") n.appendChild(cachedRow(s));
  }
  n.appendChild(row("restarts", String(s.restarts)));
  return n;
}

const count = (n) => n.toLocaleString("en-US");

// the prefix cache's rows on this stage, their K/V of the stage's bound (--prefix-cache-memory), and the K/V that
// running sequences read from those rows' pages instead of copies
function cachedRow(s) {
  const mib = (b) => count(Math.round(b / 1048576)) + " MiB";
  const parts = [count(s.kv_slots_cached) + (s.kv_slots_cached === 1 ? " prefix" : " prefixes")];
  if (s.kv_prefix_memory_bytes) parts.push(mib(s.kv_cached_bytes || 0) + " of " + mib(s.kv_prefix_memory_bytes) + " KV");
  if (s.kv_shared_bytes) parts.push(mib(s.kv_shared_bytes) + " shared");
  const r = row("cached prefixes", parts.join(" · "));
  r.title = "cached prefixes: how many, their K/V of the stage's prefix-cache memory, and the K/V running sequences " +
            "read from their pages instead of copies";
  return r;
}

function sparkline(values, w, h) {
  const ns = "http://www.w3.org/2000/svg", svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`); svg.setAttribute("preserveAspectRatio", "none");
  const nums = values.filter((v) => v !== null), max = Math.max(1e-9, ...nums);
  let d = "", pen = false;
  values.forEach((v, i) => {
    if (v === null) { pen = false; return; }
    const x = values.length > 1 ? (i / (values.length - 1)) * w : 0, y = h - 2 - (v / max) * (h - 4);
    d += (pen ? "L" : "M") + x.toFixed(1) + "," + y.toFixed(1); pen = true;
  });
  const path = document.createElementNS(ns, "path");
  path.setAttribute("d", d); path.setAttribute("fill", "none"); path.setAttribute("stroke", "#2563eb");
  path.setAttribute("stroke-width", "1.5"); path.setAttribute("vector-effect", "non-scaling-stroke");
  svg.appendChild(path);
  return svg;
}

function drawMesh(snap) {
  meshSnapshot = snap;
  const verdict = document.getElementById("mesh-verdict");
  const lost = (snap.pipelines || []).filter((p) => !p.ready);
  verdict.className = snap.ready && !lost.length ? "ok" : "bad";
  verdict.textContent = !snap.ready ? "NOT READY: " + (snap.problem || (snap.draining ? "draining" : "…"))
    : lost.length ? "DEGRADED (serving on the others): " + lost.map((p) => "pipeline " + p.name + ": " + p.problem).join("; ")
    : "ready";
  const g = snap.gateway, pipe = document.getElementById("pipeline");
  if (snap.pipelines && snap.pipelines.length > 1) {
    pipe.classList.add("replicas");
    pipe.replaceChildren(...snap.pipelines.map(replicaRow));
  } else {
    pipe.classList.remove("replicas");
    pipe.replaceChildren(...pipelineNodes(snap, g));
  }
  drawStats(snap, g);
}

// several pipelines: one row each, its load and cache next to its stages
function replicaRow(p) {
  const r = el("div", "replica"); r.id = "pipeline-" + p.name;
  const head = el("div", "node"); head.dataset.state = p.ready ? "ready" : "lost";
  const h = el("h3"); h.append(el("span", "", "pipeline " + p.name), el("span", "badge " + p.state, p.state)); head.appendChild(h);
  const pc = p.prefix_cache, rate = pc && pc.hit_rate !== null ? fmt(100 * pc.hit_rate, 0, "%") : "–";
  head.append(row("queue", String(p.queue)), row("running", String(p.running)),
              row("KV used", fmt(100 * p.kv_used_ratio, 0, "%")), bar(p.kv_used_ratio), row("cache hits", rate),
              row("routed", String(p.routed)), row("handed off", String(p.handed_off)));
  if (pc && pc.audits) head.append(row("cache audited", pc.audits + ", " + pc.audit_mismatches + " mismatched"));
  if (!p.ready) head.appendChild(el("div", "error", p.problem || ""));
  const nodes = [head];
  p.stages.forEach((s, i) => {
    nodes.push(hop(i === 0 ? s.hop_in_ms : p.stages[i - 1].hop_next_ms, "hop latency into stage " + i));
    nodes.push(stageNode(s));
  });
  r.replaceChildren(...nodes);
  return r;
}

function pipelineNodes(snap, g) {
  const gwNode = el("div", "node"); gwNode.id = "gateway-node";
  const gh = el("h3"); gh.append(el("span", "", "gateway"), el("span", "badge " + (snap.ready ? "ready" : "lost"), snap.ready ? "ready" : "waiting"));
  gwNode.append(gh, row("queue", String(g.queue)), row("running", String(g.running)),
                row("in flight", g.inflight + " / " + g.max_inflight));
  const nodes = [gwNode];
  snap.stages.forEach((s, i) => {
    nodes.push(hop(i === 0 ? s.hop_in_ms : snap.stages[i - 1].hop_next_ms, "hop latency into stage " + i));
    nodes.push(stageNode(s));
  });
  const last = snap.stages[snap.stages.length - 1];
  nodes.push(hop(last ? last.hop_next_ms : null, "results back to the gateway"));
  const back = el("div", "node"); back.append(el("h3", "", "→ gateway"), row("tokens/s", fmt(g.tokens_per_s, 1)));
  nodes.push(back);
  return nodes;
}

function drawStats(snap, g) {
  const st = document.getElementById("gw-stats");
  const stat = (id, name, value) => { const s = el("span"); s.id = id; s.append(name + " ", el("b", "", value)); return s; };
  st.replaceChildren(stat("gw-tps", "tokens/s", fmt(g.tokens_per_s, 1)), stat("gw-ttft", "TTFT", fmt(g.ttft_ms, 0, " ms")),
                     stat("gw-replaying", "replaying", String(g.replaying)), stat("gw-failovers", "failovers", String(g.failovers)),
                     stat("gw-replayed", "replayed sequences", String(g.replayed_sequences)),
                     stat("gw-tokens", "generated tokens", String(g.generated_tokens)),
                     // --split auto: the split chosen at start and the prediction it came from, one line per pipeline
                     ...(snap.pipelines || []).filter((p) => p.split_auto).map((p) =>
                       stat("split-auto-" + p.name, snap.pipelines.length > 1 ? "pipeline " + p.name : "split", p.split_auto.summary)));
  const charts = document.getElementById("charts"), times = snap.series.t || [];
  const span = times.length > 1 ? times[times.length - 1] - times[0] : 0;
  const ago = span >= 90 ? "−" + Math.round(span / 60) + " min" : "−" + Math.round(span) + " s";
  charts.replaceChildren(...CHARTS.map(([key, name, digits]) => {
    const c = el("div", "chart"); c.id = "chart-" + key;
    const values = snap.series[key] || [], lastv = values.length ? values[values.length - 1] : null;
    const nums = values.filter((v) => v !== null), top = nums.length ? Math.max(...nums) : 0;
    const label = el("div", "label"); label.append(el("span", "", name), el("b", "", fmt(lastv, digits)));
    // axes: the value from 0 (bottom) to the window's largest (top), time from the oldest point to now
    const plot = el("div", "plot"), y = el("div", "y-axis"), x = el("div", "x-axis");
    y.append(el("span", "y-max", top >= 100 ? count(Math.round(top)) : String(+top.toFixed(1))), el("span", "y-min", "0"));
    x.append(el("span", "x-start", span ? ago : ""), el("span", "x-name", "time"), el("span", "x-end", "now"));
    plot.append(y, sparkline(values, 200, 60), x);
    c.append(label, plot);
    return c;
  }));
}

function openMesh() {
  if (meshSource) return;
  const conn = document.getElementById("mesh-conn");
  const key = typeof apiKey === "function" ? apiKey() : "";  // EventSource sends no headers: the key as a query
  meshSource = new EventSource("/v1/mesh/stream" + (key ? "?api_key=" + encodeURIComponent(key) : ""));
  meshSource.onopen = () => { conn.textContent = "live"; };
  meshSource.onerror = () => { conn.textContent = "reconnecting…"; };
  meshSource.onmessage = (event) => { drawMesh(JSON.parse(event.data)); };
}

function closeMesh() { if (meshSource) { meshSource.close(); meshSource = null; } }

function route() {
  const mesh = location.hash === "#mesh";
  meshEl.hidden = !mesh; chatEl.hidden = mesh; chatEl.style.display = mesh ? "none" : "";
  if (mesh) openMesh(); else closeMesh();
}
window.addEventListener("hashchange", route);
route();
