// inferd gateway dashboard: polls /dashboard/fleet once a second and draws the fleet. No libraries.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 300;
const $ = (id) => document.getElementById(id);
const state = { snap: null, prev: null, history: [], polls: 0 };
window.fleet = state; // for tests

function apiKey() {
  const q = new URLSearchParams(location.search).get("key");
  if (q) sessionStorage.setItem("inferd-gw-key", q);
  return sessionStorage.getItem("inferd-gw-key") || "";
}
$("key-btn").addEventListener("click", () => {
  const key = window.prompt("API key (a tenant's, or the operator's)", apiKey());
  if (key !== null) sessionStorage.setItem("inferd-gw-key", key);
});

function setConn(text, cls) { const el = $("conn"); el.textContent = text; el.className = "pill " + cls; }
const sum = (o) => Object.values(o || {}).reduce((a, b) => a + (typeof b === "object" ? sum(b) : b), 0);
const pct = (v) => (v == null ? "–" : (100 * v).toFixed(1) + "%");
const num = (v) => (v == null ? "–" : Number.isInteger(v) ? String(v) : v.toFixed(1));

function cell(tr, content) {
  const td = document.createElement("td");
  if (content instanceof Node) td.append(content); else td.textContent = content;
  tr.append(td);
  return td;
}
function bar(frac, label) {
  const span = document.createElement("span");
  const b = document.createElement("span");
  b.className = "bar";
  const i = document.createElement("i");
  i.style.width = Math.min(100, Math.max(0, 100 * frac)) + "%";
  if (frac > 0.9) i.className = "hot";
  b.append(i);
  span.append(b, label);
  return span;
}
function rows(id, items, fill) {
  const body = $(id).tBodies[0];
  body.replaceChildren(...items.map((it) => { const tr = document.createElement("tr"); fill(tr, it); return tr; }));
}

async function poll() {
  try {
    const key = apiKey();
    const resp = await fetch("/dashboard/fleet", { headers: key ? { Authorization: "Bearer " + key } : {} });
    if (resp.status === 401) { setConn("needs API key: click key", "bad"); return; }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const snap = await resp.json();
    setConn("live", "live");
    state.prev = state.snap;
    state.snap = snap;
    state.polls++;
    render();
  } catch (e) {
    setConn("offline: " + e.message, "bad");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function render() {
  const s = state.snap, p = state.prev;
  $("models").textContent = "models: " + s.models.join(", ");
  const dt = p ? Math.max(0.001, s.ts - p.ts) : 1;
  const rps = p ? (sum(s.requests_by_status) - sum(p.requests_by_status)) / dt : 0;
  const rej = p ? (sum(s.rejections) - sum(p.rejections)) / dt : 0;
  const inFlight = s.replicas.reduce((a, r) => a + r.in_flight, 0);
  state.history.push({ ts: s.ts, rps, rej, inFlight, queued: s.queue.size });
  while (state.history.length && state.history[0].ts < s.ts - HISTORY_S) state.history.shift();
  $("k-replicas").textContent = `${s.replicas.filter((r) => r.available).length}/${s.replicas.length}`;
  $("k-inflight").textContent = inFlight;
  $("k-queue").textContent = s.queue.size;
  $("k-rps").textContent = rps.toFixed(1);
  $("k-rej").textContent = rej.toFixed(1);
  const hit = s.pools.reduce((a, x) => a + x.prefix_blocks_hit, 0), miss = s.pools.reduce((a, x) => a + x.prefix_blocks_miss, 0);
  $("k-aff").textContent = hit + miss ? pct(hit / (hit + miss)) : "–";

  const maxPicks = Math.max(1, ...s.replicas.map((r) => r.picks));
  rows("replicas", s.replicas, (tr, r) => {
    cell(tr, r.pool);
    cell(tr, r.url);
    const st = cell(tr, r.available ? "up" : r.ejected_for_s > 0 ? `ejected ${r.ejected_for_s}s` : "down");
    st.className = r.available ? "up" : "down";
    cell(tr, String(r.in_flight));
    cell(tr, String(r.in_flight_tokens));
    cell(tr, num(r.running));
    cell(tr, num(r.waiting));
    cell(tr, r.kv_usage == null ? "–" : bar(r.kv_usage, pct(r.kv_usage)));
    cell(tr, pct(r.prefix_hit_rate));
    cell(tr, bar(r.picks / maxPicks, String(r.picks)));
    cell(tr, r.load_age_s == null ? "no scrape yet" : r.load_age_s + " s");
  });
  rows("pools", s.pools, (tr, x) => {
    const total = x.prefix_blocks_hit + x.prefix_blocks_miss;
    cell(tr, x.name); cell(tr, x.model || "–"); cell(tr, String(x.replicas));
    cell(tr, String(x.prefix_blocks_hit)); cell(tr, String(x.prefix_blocks_miss));
    cell(tr, total ? bar(x.prefix_blocks_hit / total, pct(x.prefix_blocks_hit / total)) : "–");
  });
  $("statuses").textContent = "answered by status: " +
    (Object.entries(s.requests_by_status).map(([k, v]) => `${k}: ${v}`).join(" · ") || "none yet") +
    ` · retries ${s.retries}` +
    (Object.keys(s.upstream_errors).length
      ? " · upstream errors: " + Object.entries(s.upstream_errors).map(([k, v]) => `${k}: ${v}`).join(" · ") : "");
  const rejRows = [];
  for (const [tenant, reasons] of Object.entries(s.rejections)) for (const [reason, n] of Object.entries(reasons)) rejRows.push([tenant, reason, n]);
  rows("rejections", rejRows, (tr, [t, reason, n]) => { cell(tr, t); cell(tr, reason); cell(tr, String(n)); });
  rows("tenants", s.tenants, (tr, t) => {
    cell(tr, t.id); cell(tr, String(t.priority));
    cell(tr, t.max_concurrent ? bar(t.in_flight / t.max_concurrent, `${t.in_flight}/${t.max_concurrent}`) : String(t.in_flight));
    t.dimensions.forEach((_, i) => {
      const lim = t.limits[i], used = t.used[i];
      cell(tr, lim < 0 ? `${num(used)} (no limit)` : bar(used / Math.max(lim, 1e-9), `${num(used)}/${num(lim)}`));
    });
    cell(tr, t.reset_s == null ? "no window" : t.reset_s + " s");
  });
  drawChart("c-rps", [{ k: "rps", c: "#5fb3ff", label: "req/s" }, { k: "rej", c: "#ff5f5f", label: "rejected/s" }]);
  drawChart("c-flight", [{ k: "inFlight", c: "#6ad48a", label: "in flight" }, { k: "queued", c: "#f2c14e", label: "queued" }]);
}

function drawChart(id, series) {
  const c = $(id);
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(50, Math.floor(c.clientWidth * dpr)), h = Math.floor(Number(c.getAttribute("height")) * dpr);
  if (c.width !== w || c.height !== h) { c.width = w; c.height = h; c.style.height = c.getAttribute("height") + "px"; }
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const hist = state.history;
  if (!hist.length) return;
  const now = hist[hist.length - 1].ts;
  let max = 0;
  for (const s of series) for (const p of hist) max = Math.max(max, p[s.k]);
  const top = 14 * dpr, bottom = h - 4 * dpr, scale = max > 0 ? max * 1.1 : 1;
  ctx.font = `${10 * dpr}px sans-serif`;
  ctx.fillStyle = "#8a94a3";
  ctx.fillText(max > 0 ? `${max.toFixed(1)}` : "no traffic yet", 4 * dpr, 10 * dpr);
  let x0 = w - 4 * dpr;
  ctx.textAlign = "right";
  for (const s of [...series].reverse()) { ctx.fillStyle = s.c; ctx.fillText(s.label, x0, 10 * dpr); x0 -= ctx.measureText(s.label).width + 10 * dpr; }
  ctx.textAlign = "left";
  for (const s of series) {
    ctx.strokeStyle = s.c;
    ctx.lineWidth = 1.5 * dpr;
    ctx.beginPath();
    hist.forEach((p, i) => {
      const x = w - ((now - p.ts) / HISTORY_S) * w, y = bottom - (p[s.k] / scale) * (bottom - top);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
}

poll();
