// inferd live dashboard: reads /dashboard/events (server-sent events, fetched so that the API key goes in
// a header) and draws the running batch, the KV cache and the charts on canvases. No libraries.
"use strict";

const MAX_STEPS = 160; // columns in the batch view
const HISTORY_S = 300; // seconds shown in the charts
const FREE = 0, CACHED = 1, OWNER_BASE = 2, SHARED = 0x8000;

const $ = (id) => document.getElementById(id);
const state = {
  hello: null,
  steps: [], // the last MAX_STEPS step events
  kv: null, // {codes: Uint16Array, owners: [...], usage}
  summaries: [],
  last: null, // the latest summary
  play: new Set(), // request ids (prefixes) of the playground's requests in flight
  stepsSeen: 0,
  kvUpdates: 0,
  dirty: true,
};
window.dashboard = state; // for tests and curious people

// -- the API key ----------------------------------------------------------------------------------
function apiKey() {
  const q = new URLSearchParams(location.search).get("key");
  if (q) sessionStorage.setItem("inferd-key", q);
  return sessionStorage.getItem("inferd-key") || "";
}
function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}
$("key-btn").addEventListener("click", () => {
  const key = window.prompt("API key (--api-key of the server)", apiKey());
  if (key === null) return;
  sessionStorage.setItem("inferd-key", key);
  if (stream) stream.abort();
});

// -- colours --------------------------------------------------------------------------------------
const colourCache = new Map();
function requestColour(id) {
  let c = colourCache.get(id);
  if (c) return c;
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
  const hue = ((h >>> 0) % 360);
  c = `hsl(${hue} 70% 58%)`;
  if (colourCache.size > 5000) colourCache.clear();
  colourCache.set(id, c);
  return c;
}
function isPlay(id) {
  for (const p of state.play) if (id === p || id.startsWith(p + "-")) return true;
  return false;
}

// -- the event stream -----------------------------------------------------------------------------
let stream = null;
// Server-sent events from a fetch response: calls onData with each event's data (its data: lines joined).
async function readSSE(resp, onData) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
      if (data) onData(data);
    }
  }
}

async function connect() {
  stream = new AbortController();
  setConn("connecting", "");
  try {
    const resp = await fetch("/dashboard/events", { headers: authHeaders(), signal: stream.signal });
    if (resp.status === 401) {
      setConn("needs API key: click key", "bad");
      return retry(5000);
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    setConn("live", "live");
    await readSSE(resp, (data) => onMessage(JSON.parse(data)));
    setConn("reconnecting", "bad");
  } catch (e) {
    if (e.name !== "AbortError") setConn("offline: " + e.message, "bad");
  }
  retry(1500);
}
function retry(ms) { setTimeout(connect, ms); }
function setConn(text, cls) {
  const el = $("conn");
  el.textContent = text;
  el.className = "pill " + cls;
}

function onMessage(m) {
  if (m.type === "hello") {
    state.hello = m;
    $("model").textContent = `${m.model} · ${m.num_blocks} blocks × ${m.block_size} tokens · budget ${m.budget}` +
      ` tokens/step · ≤ ${m.max_num_seqs} seqs`;
    $("kv-total").textContent = m.num_blocks;
    $("kv-bs").textContent = m.block_size + " tokens";
    state.summaries = m.summaries || [];
    if (m.kv) setKV(m.kv);
    if (m.last_step) addStep(m.last_step);
    if (state.summaries.length) onSummary(state.summaries[state.summaries.length - 1], false);
  } else if (m.type === "events") {
    for (const e of m.events) {
      if (e.type === "step") addStep(e);
      if (e.kv) setKV(e.kv);
    }
  } else if (m.type === "summary") {
    onSummary(m, true);
  }
  state.dirty = true;
}

function addStep(e) {
  state.steps.push(e);
  if (state.steps.length > MAX_STEPS) state.steps.shift();
  state.stepsSeen++;
}

function setKV(kv) {
  const n = state.hello ? state.hello.num_blocks : kv.runs.filter((_, i) => i % 2).reduce((a, b) => a + b, 0);
  const codes = new Uint16Array(n);
  let pos = 0;
  for (let i = 0; i < kv.runs.length; i += 2) {
    codes.fill(kv.runs[i], pos, pos + kv.runs[i + 1]);
    pos += kv.runs[i + 1];
  }
  state.kv = { codes, owners: kv.owners, usage: kv.usage };
  state.kvUpdates++;
}

function onSummary(s, append) {
  if (append) {
    state.summaries.push(s);
    const cut = s.ts - HISTORY_S;
    while (state.summaries.length && state.summaries[0].ts < cut) state.summaries.shift();
  }
  state.last = s;
  $("k-running").textContent = s.running;
  $("k-waiting").textContent = s.waiting;
  $("k-tps").textContent = fmt(s.output_tokens_per_s, 1);
  $("k-ttft").textContent = ms(s.ttft_ms.p50);
  $("k-itl").textContent = ms(s.itl_ms.p50);
  $("k-kv").textContent = pct(s.kv_usage);
  $("k-spec").textContent = s.spec_tokens_per_step == null ? "–" : fmt(s.spec_tokens_per_step, 2) + " (" + pct(s.spec_acceptance) + ")";
  $("k-dropped").textContent = s.dropped_events;
  $("kv-hit").textContent = s.prefix_hit_rate == null ? "–" : pct(s.prefix_hit_rate);
  $("kv-hit1m").textContent = s.prefix_hit_rate_1m == null ? "–" : pct(s.prefix_hit_rate_1m);
}

const fmt = (v, d) => (v == null ? "–" : Number(v).toFixed(d));
const ms = (v) => (v == null ? "–" : v < 10 ? v.toFixed(2) + " ms" : v < 1000 ? v.toFixed(0) + " ms" : (v / 1000).toFixed(2) + " s");
const pct = (v) => (v == null ? "–" : (100 * v).toFixed(1) + "%");

// -- drawing --------------------------------------------------------------------------------------
function fitCanvas(c) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(50, Math.floor(c.clientWidth * dpr));
  const h = Math.floor(Number(c.getAttribute("height")) * dpr);
  if (c.width !== w || c.height !== h) { c.width = w; c.height = h; c.style.height = c.getAttribute("height") + "px"; }
  const ctx = c.getContext("2d");
  return { ctx, w, h, dpr };
}

function drawBatch() {
  const { ctx, w, h, dpr } = fitCanvas($("batch"));
  ctx.clearRect(0, 0, w, h);
  const steps = state.steps;
  const budget = state.hello ? state.hello.budget : 1;
  const top = 14 * dpr, bottom = h - 2 * dpr, span = bottom - top;
  const col = w / MAX_STEPS;
  const x0 = w - steps.length * col;
  let maxDur = 0, maxTokens = 4;
  for (const s of steps) { maxDur = Math.max(maxDur, s.dur_ms); maxTokens = Math.max(maxTokens, s.tokens); }
  // bars scale to the busiest step in view, so that a batch of decodes is visible next to a large budget
  const scale = Math.min(budget, maxTokens);
  ctx.fillStyle = "#2a313b";
  ctx.fillRect(0, top - 1, w, 1);
  steps.forEach((s, i) => {
    const x = x0 + i * col;
    let y = bottom;
    for (const [id, tokens, kind, flag] of s.reqs) {
      const hh = Math.max(1, (tokens / scale) * span);
      ctx.globalAlpha = isPlay(id) || state.play.size === 0 ? 1 : 0.45;
      ctx.fillStyle = requestColour(id);
      if (kind === "p") {
        ctx.globalAlpha *= 0.5;
        ctx.fillRect(x, y - hh, Math.max(1, col - 1), hh);
        ctx.globalAlpha *= 2;
        ctx.fillRect(x, y - hh, Math.max(1, col - 1), Math.min(hh, 1.5 * dpr));
      } else {
        ctx.fillRect(x, y - hh, Math.max(1, col - 1), hh);
      }
      y -= hh;
      if (flag === "f") {
        ctx.fillStyle = "#6ad48a";
        ctx.fillRect(x, y - 2 * dpr, Math.max(1, col - 1), 2 * dpr);
      }
    }
    ctx.globalAlpha = 1;
    if (s.preempted.length) {
      ctx.fillStyle = "#ff5f5f";
      ctx.beginPath();
      ctx.moveTo(x, 0); ctx.lineTo(x + col, 0); ctx.lineTo(x + col / 2, 10 * dpr); ctx.fill();
    }
  });
  if (steps.length > 1 && maxDur > 0) { // the step duration
    ctx.strokeStyle = "#f2c14e";
    ctx.lineWidth = 1.2 * dpr;
    ctx.beginPath();
    steps.forEach((s, i) => {
      const x = x0 + (i + 0.5) * col, y = bottom - (s.dur_ms / maxDur) * span;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = "#f2c14e";
    ctx.font = `${10 * dpr}px sans-serif`;
    ctx.fillText(`max ${maxDur.toFixed(1)} ms`, 4 * dpr, 11 * dpr);
  }
  ctx.fillStyle = "#8a94a3";
  ctx.font = `${10 * dpr}px sans-serif`;
  ctx.textAlign = "right";
  ctx.fillText(scale === budget ? `top = budget, ${budget} tokens` : `top = ${scale} tokens (budget ${budget})`,
    w - 4 * dpr, 11 * dpr);
  ctx.textAlign = "left";
  drawBatchTable();
}

function drawBatchTable() {
  const s = state.steps[state.steps.length - 1];
  const body = $("batch-table").tBodies[0];
  if (!s) return;
  // idle: the latest summary (the server's clock, like the step's) says nothing runs, a second after the step
  const idle = state.last && state.last.running === 0 && state.last.waiting === 0 && state.last.ts - s.ts > 1;
  $("step-line").textContent = idle
    ? `idle · last step #${s.id}`
    : `step #${s.id} · ${s.tokens}/${s.budget} tokens (${((100 * s.tokens) / s.budget).toFixed(0)}% of budget) · ` +
      `${s.dur_ms.toFixed(2)} ms · ${s.reqs.length} in batch · running ${s.running} · waiting ${s.waiting}` +
      (s.preempted.length ? ` · preempted ${s.preempted.join(", ")}` : "");
  $("step-line").dataset.idle = idle ? "1" : "0";
  const rows = idle ? [] : s.reqs.slice(0, 24);
  body.replaceChildren(...rows.map(([id, tokens, kind, flag, constraint, adapter]) => {
    const tr = document.createElement("tr");
    const state_ = flag === "f" ? "finished" : flag === "s" ? "sampled" : "computing";
    // a structured output's rows say which grammar masks their tokens
    const grammar = constraint ? ` <span class="constrained" title="tokens masked by a grammar">${constraint}</span>` : "";
    tr.innerHTML = `<td><span class="dot"></span></td><td>${tokens}</td><td>${kind === "p" ? "prefill" : "decode"}${grammar}</td>` +
      `<td>${state_}</td>`;
    tr.cells[0].append(id);
    if (adapter) { // the LoRA adapter the row runs under (its name as text, never as markup)
      const tag = document.createElement("span");
      tag.className = "adapter";
      tag.title = "LoRA adapter";
      tag.textContent = adapter;
      tr.cells[0].append(" ", tag);
    }
    tr.querySelector(".dot").style.background = requestColour(id);
    if (isPlay(id)) tr.style.fontWeight = "bold";
    return tr;
  }));
}

function drawKV() {
  const c = $("kv");
  const kv = state.kv;
  if (!kv) return;
  const n = kv.codes.length;
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(50, Math.floor(c.clientWidth * dpr));
  // the largest square cell that fits n blocks into w x (260 css px), at least 1 px
  const area = w * 260 * dpr;
  let cell = Math.max(1, Math.min(18 * dpr, Math.floor(Math.sqrt(area / n))));
  let cols = Math.max(1, Math.floor(w / cell));
  const rows = Math.ceil(n / cols);
  const h = rows * cell;
  if (c.width !== w || c.height !== h) { c.width = w; c.height = h; c.style.height = h / dpr + "px"; }
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const gap = cell >= 5 ? 1 : 0;
  const highlight = state.play.size > 0;
  let used = 0, shared = 0, cached = 0;
  let i = 0;
  while (i < n) { // draw runs of equal codes, row by row
    const code = kv.codes[i];
    let j = i + 1;
    while (j < n && kv.codes[j] === code && j % cols !== 0) j++;
    const len = j - i;
    if (code === FREE) ctx.fillStyle = "#232a33";
    else if (code === CACHED) { ctx.fillStyle = "#4b5b70"; cached += len; }
    else {
      used += len;
      const owner = kv.owners[(code & ~SHARED) - OWNER_BASE] || "?";
      ctx.fillStyle = requestColour(owner);
      ctx.globalAlpha = highlight && !isPlay(owner) ? 0.3 : 1;
      if (code & SHARED) shared += len;
    }
    const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
    ctx.fillRect(x, y, len * cell - gap, cell - gap);
    if (code >= OWNER_BASE && code & SHARED) { // shared prefix blocks: a white frame (or a white stripe)
      ctx.fillStyle = "#ffffff";
      if (cell >= 6) {
        for (let k = 0; k < len; k++) {
          ctx.strokeStyle = "#ffffff";
          ctx.lineWidth = Math.max(1, cell / 6);
          ctx.strokeRect(x + k * cell + ctx.lineWidth / 2, y + ctx.lineWidth / 2,
            cell - gap - ctx.lineWidth, cell - gap - ctx.lineWidth);
        }
      } else {
        ctx.fillRect(x, y, len * cell - gap, Math.max(1, Math.floor(cell / 3)));
      }
    }
    ctx.globalAlpha = 1;
    i = j;
  }
  $("kv-used").textContent = used;
  $("kv-shared").textContent = shared;
  $("kv-cached").textContent = cached;
  $("kv-owners").textContent = kv.owners.length;
  $("kv-usage").textContent = pct(used / n);
}

function drawChart(id, series, unit) {
  const { ctx, w, h, dpr } = fitCanvas($(id));
  ctx.clearRect(0, 0, w, h);
  const sums = state.summaries;
  const now = sums.length ? sums[sums.length - 1].ts : Date.now() / 1000;
  const left = 4 * dpr, right = w - 4 * dpr, top = 14 * dpr, bottom = h - 12 * dpr;
  let max = 0;
  for (const s of series) for (const p of sums) { const v = s.get(p); if (v != null) max = Math.max(max, v); }
  const peak = max;
  max = max > 0 ? max * 1.1 : 1;
  ctx.strokeStyle = "#2a313b";
  ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) { const y = top + ((bottom - top) * k) / 4; ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(right, y); ctx.stroke(); }
  ctx.font = `${10 * dpr}px sans-serif`;
  ctx.fillStyle = "#8a94a3";
  ctx.fillText(peak > 0 ? `${fmt(peak, peak < 10 ? 2 : 0)}${unit}` : "no data yet", left, 10 * dpr);
  ctx.textAlign = "right";
  ctx.fillText(`-${HISTORY_S / 60} min`, left + 40 * dpr, h - 2 * dpr);
  ctx.fillText("now", right, h - 2 * dpr);
  let lx = right;
  for (const s of [...series].reverse()) { // the legend, right-aligned
    ctx.fillStyle = s.colour;
    const last = sums.length ? s.get(sums[sums.length - 1]) : null;
    const label = `${s.label} ${last == null ? "–" : fmt(last, last < 10 ? 2 : 0)}`;
    ctx.fillText(label, lx, 10 * dpr);
    lx -= ctx.measureText(label).width + 10 * dpr;
  }
  ctx.textAlign = "left";
  for (const s of series) {
    ctx.strokeStyle = s.colour;
    ctx.lineWidth = 1.5 * dpr;
    ctx.beginPath();
    let pen = false;
    for (const p of sums) {
      const v = s.get(p);
      if (v == null) { pen = false; continue; }
      const x = right - ((now - p.ts) / HISTORY_S) * (right - left);
      const y = bottom - (v / max) * (bottom - top);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    }
    ctx.stroke();
  }
}

const PCT_COLOURS = ["#5fb3ff", "#f2c14e", "#ff5f5f"];
function drawCharts() {
  const pcts = (key) => ["p50", "p90", "p99"].map((p, i) => ({ label: p, colour: PCT_COLOURS[i], get: (s) => s[key][p] }));
  drawChart("c-ttft", pcts("ttft_ms"), " ms");
  drawChart("c-itl", pcts("itl_ms"), " ms");
  drawChart("c-tps", [{ label: "tok/s", colour: "#6ad48a", get: (s) => s.output_tokens_per_s }], "");
  drawChart("c-queue", [
    { label: "running", colour: "#5fb3ff", get: (s) => s.running },
    { label: "waiting", colour: "#ff5f5f", get: (s) => s.waiting },
  ], "");
  drawChart("c-kv", [
    { label: "KV %", colour: "#c38bff", get: (s) => 100 * s.kv_usage },
    { label: "hit %", colour: "#6ad48a", get: (s) => (s.prefix_hit_rate_1m == null ? null : 100 * s.prefix_hit_rate_1m) },
  ], "%");
}

let lastFrame = 0;
function frame(t) {
  if (state.dirty && t - lastFrame > 80) { // at most ~12 redraws a second
    state.dirty = false;
    lastFrame = t;
    drawBatch();
    drawKV();
    drawCharts();
  }
  requestAnimationFrame(frame);
}
window.addEventListener("resize", () => { state.dirty = true; });

// -- the playground -------------------------------------------------------------------------------
let playAbort = null;
$("play").addEventListener("submit", (ev) => { ev.preventDefault(); sendPlay(); });
$("p-stop").addEventListener("click", () => { if (playAbort) playAbort.abort(); });

function playBody(mode) {
  const prompt = $("p-prompt").value;
  const body = {
    max_tokens: Number($("p-max").value) || 16,
    temperature: Number($("p-temp").value),
    top_p: Number($("p-topp").value),
    stream: true,
    // the last chunk's usage says where copy 0's time went (usage.timing), drawn as its timeline
    stream_options: { include_usage: true },
    return_timing: true,
  };
  if ($("p-seed").value !== "") body.seed = Number($("p-seed").value);
  if (mode === "chat") body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return body;
}

async function sendPlay() {
  const mode = $("p-mode").value;
  // a browser opens at most 6 connections per host, and the event stream holds one
  const copies = Math.max(1, Math.min(5, Number($("p-copies").value) || 1));
  const out = $("p-out");
  out.replaceChildren();
  const span = document.createElement("span");
  span.className = "prompt";
  span.textContent = mode === "chat" ? "" : $("p-prompt").value;
  out.append(span);
  const text = document.createTextNode("");
  out.append(text);
  $("p-timeline").replaceChildren();
  playAbort = new AbortController();
  $("p-send").disabled = true;
  $("p-stop").disabled = false;
  $("p-status").textContent = "sending";
  const t0 = performance.now();
  const times = [];
  let tokens = 0;
  const ids = [];
  const one = async (k) => {
    const resp = await fetch(mode === "chat" ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(playBody(mode)),
      signal: playAbort.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || "HTTP " + resp.status);
    }
    const id = resp.headers.get("X-Request-Id");
    if (id) { ids.push(id); state.play.add(id); state.dirty = true; }
    if (k === 0) $("p-id").textContent = id || "–";
    await readSSE(resp, (raw) => {
        const data = raw.trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (k === 0 && chunk.usage && chunk.usage.timing) showTimeline(chunk.usage.timing);
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const delta = mode === "chat" ? (choice.delta && choice.delta.content) || "" : choice.text || "";
        if (delta && k === 0) {
          times.push(performance.now());
          tokens++;
          text.data += delta;
          out.scrollTop = out.scrollHeight;
          showPlayStats(t0, times, tokens);
        }
    });
  };
  try {
    $("p-status").textContent = "streaming";
    await Promise.all(Array.from({ length: copies }, (_, k) => one(k)));
    $("p-status").textContent = "done";
  } catch (e) {
    $("p-status").textContent = e.name === "AbortError" ? "stopped" : "error: " + e.message;
  } finally {
    for (const id of ids) state.play.delete(id);
    state.dirty = true;
    $("p-send").disabled = false;
    $("p-stop").disabled = true;
    playAbort = null;
  }
}

// one request's timeline, from the engine's timestamps: queue, prefill (its chunks), decode (its steps)
function showTimeline(t) {
  const box = $("p-timeline");
  box.replaceChildren();
  const parts = [
    ["queue", t.queue_ms, "waiting to be scheduled"],
    ["prefill", t.prefill_ms, `${t.prefill_chunks} chunk(s), ${t.cached_prompt_tokens} prompt tokens from the cache` +
      (t.kv_loaded_tokens ? `, ${t.kv_loaded_tokens} loaded in ${ms(t.kv_load_ms)}` : "")],
    ["decode", t.decode_ms, `${t.decode_steps} step(s)`],
  ].filter(([, v]) => v !== null && v !== undefined);
  const total = Math.max(t.total_ms || 0, parts.reduce((a, [, v]) => a + v, 0), 1e-9);
  const bar = document.createElement("div");
  bar.className = "tl-bar";
  const legend = document.createElement("div");
  legend.className = "legend mono";
  for (const [name, v, what] of parts) {
    const seg = document.createElement("span");
    seg.className = "tl-" + name;
    seg.style.width = (100 * v / total).toFixed(2) + "%";
    seg.title = `${name}: ${ms(v)} (${what})`;
    bar.append(seg);
    const item = document.createElement("span");
    item.innerHTML = `<i class="tl-${name}"></i>`;
    item.append(`${name} ${ms(v)} · ${what}`);
    legend.append(item);
  }
  const more = document.createElement("span");
  more.textContent = `TTFT ${ms(t.ttft_ms)} · total ${ms(t.total_ms)}` +
    (t.preemptions ? ` · preempted ${t.preemptions}x (recomputed)` : "");
  legend.append(more);
  box.append(bar, legend);
}

function showPlayStats(t0, times, tokens) {
  $("p-ttft").textContent = ms(times[0] - t0);
  if (times.length > 1) {
    const itl = (times[times.length - 1] - times[0]) / (times.length - 1);
    $("p-itl").textContent = ms(itl);
    $("p-tps").textContent = fmt(1000 / itl, 1);
  }
  $("p-tokens").textContent = tokens;
}

connect();
requestAnimationFrame(frame);
