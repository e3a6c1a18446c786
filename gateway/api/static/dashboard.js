// agentgw dashboard: polls GET /dashboard/state and redraws. Plain DOM (textContent only, so
// session ids and reasons from clients are never parsed as HTML), no libraries, no build step.
"use strict";

const POLL_MS = Number(new URLSearchParams(location.search).get("interval_ms")) || 1000;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

const fmt = {
  int: (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US")),
  pct: (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %"),
  ms: (v) => (v == null ? "–" : (1000 * v).toFixed(v < 0.01 ? 2 : 0) + " ms"),
  s: (v) => (v == null ? "–" : v < 60 ? v.toFixed(1) + " s" : (v / 60).toFixed(1) + " min"),
  short: (id) => (id && id.length > 28 ? id.slice(0, 25) + "…" : id),
};

function fill(tbody, rows, cols) {
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" }, el("td", { colspan: cols }, "none"))]));
}

function bar(frac) {
  const inner = el("span");
  inner.style.width = Math.max(0, Math.min(100, 100 * (frac || 0))).toFixed(1) + "%";
  return el("span", { class: "bar" }, inner);
}

function renderEngines(pools) {
  const rows = [];
  for (const pool of pools) {
    pool.engines.forEach((e, i) => {
      const t = e.cached_tokens;
      rows.push(
        el("tr", { class: i === 0 ? "pool-start" : "", "data-engine": e.name },
          el("td", {}, i === 0 ? `${pool.name} (${pool.role})` : ""),
          el("td", { title: e.url }, e.name),
          el("td", {}, el("span", { class: "badge " + (e.healthy ? "ok" : "bad") }, e.healthy ? "healthy" : `ejected (${e.failures} failures)`)),
          el("td", { class: "num" }, e.running),
          el("td", { class: "num" }, e.waiting),
          el("td", { class: "num" }, e.inflight),
          el("td", {}, bar(e.kv_usage), fmt.pct(e.kv_usage)),
          el("td", { class: "num" }, `${fmt.int(t.gpu)} / ${fmt.int(t.cpu)} / ${fmt.int(t.storage)}`),
          el("td", { class: "num sessions-home" }, e.sessions_home),
          el("td", {}, e.controllable ? "engine_ext" : "–"),
        ));
    });
  }
  fill(document.querySelector("#engines tbody"), rows, 10);
}

function renderSessions(s, now) {
  document.getElementById("sessions-count").textContent = `${s.listed} most recently active (at most ${s.limit})`;
  const rows = s.items.map((x) => {
    const d = x.last_decision;
    const pins = x.pins.map((p) => `${p.engine} ${fmt.s(p.until - now)} (${p.by})`).join(", ");
    return el("tr", { "data-session": x.session_id },
      el("td", { class: "sid", title: x.session_id }, fmt.short(x.session_id), x.parent ? el("span", { class: "meta" }, ` ← ${fmt.short(x.parent)}`) : ""),
      el("td", { class: "home" }, x.home || "–", el("span", { class: "meta" }, x.pool ? ` (${x.pool})` : "")),
      el("td", { class: "num turns" }, x.turns),
      el("td", { class: "num" }, x.inflight),
      el("td", { class: "num" }, fmt.int(x.context_tokens)),
      el("td", { class: "num" }, fmt.int(x.cached_tokens_est)),
      el("td", { class: "reason" }, d ? `${d.reason} → ${d.engine}` : "–",
        d ? el("span", { class: "meta" }, ` (${fmt.int(d.cached_tokens_est)} cached, ${fmt.int(d.uncached_tokens_est)} new)`) : ""),
      el("td", {}, pins || "–"),
      el("td", {}, x.migration ? `${x.migration.kind}: ${x.migration.state}` : "–"),
      el("td", { class: "num" }, fmt.s(x.idle_s)),
    );
  });
  fill(document.querySelector("#sessions tbody"), rows, 10);
}

function route(m) { return `${m.source} → ${m.targets.length ? m.targets.join(", ") : "(itself)"}`; }

function renderMigrations(m) {
  fill(document.querySelector("#migrations-inflight tbody"), m.in_flight.map((x) =>
    el("tr", {}, el("td", { title: x.session_id }, fmt.short(x.session_id)), el("td", {}, x.kind),
      el("td", {}, route(x)), el("td", {}, x.reason), el("td", { class: "num" }, fmt.s(x.age_s)))), 5);
  fill(document.querySelector("#migrations-recent tbody"), m.recent.map((x) => {
    const ready = Object.entries(x.ready_s).map(([t, s]) => `${t} ${fmt.s(s)}`).join(", ");
    const cls = x.state === "done" ? "ok" : x.state === "failed" ? "bad" : "warn";
    return el("tr", {}, el("td", { title: x.session_id }, fmt.short(x.session_id)), el("td", {}, x.kind),
      el("td", {}, route(x)), el("td", { title: x.error || "" }, el("span", { class: "badge " + cls }, x.state)),
      el("td", {}, ready || "–"));
  }), 5);
  fill(document.querySelector("#migration-outcomes tbody"), Object.entries(m.outcomes).sort().map(([kind, o]) =>
    el("tr", {}, el("td", {}, kind), ...["started", "completed", "cancelled", "failed"].map((k) => el("td", { class: "num" }, fmt.int(o[k] || 0))))), 5);
  const mv = m.moved_next_turn;
  document.getElementById("moved-next-turn").textContent = m.enabled
    ? `first turn after a move: ${fmt.int(mv.hit || 0)} hits, ${fmt.int(mv.miss || 0)} misses (hit: ≥ 90 % of the prompt cached)`
    : "migrations are disabled (migration.enabled = false)";
}

function renderTraffic(t) {
  const w = t.window;
  document.getElementById("rps").textContent = w ? w.rps.toFixed(2) : "–";
  document.getElementById("hit-rate").textContent = w ? fmt.pct(w.hit_rate) : "–";
  document.getElementById("hit-sources").textContent = w && Object.keys(w.cached_by_source).length
    ? Object.entries(w.cached_by_source).map(([k, v]) => `${k} ${fmt.int(v)}`).join(" · ") + " cached tokens"
    : w ? `${fmt.int(w.prompt_tokens)} prompt tokens` : "";
  document.getElementById("ttft").textContent = w ? `${fmt.ms(w.ttft_p50_s)} / ${fmt.ms(w.ttft_p95_s)}` : "–";
  document.getElementById("ttft-mean").textContent = w && w.ttft_count ? `mean ${fmt.ms(w.ttft_mean_s)} over ${fmt.int(w.ttft_count)} responses` : "";
  document.getElementById("window").textContent = w ? fmt.s(w.window_s) : "–";
  const dec = Object.entries(t.decisions).sort((a, b) => b[1] - a[1]);
  fill(document.querySelector("#decisions tbody"), dec.map(([r, n]) => el("tr", {}, el("td", {}, r), el("td", { class: "num" }, fmt.int(n)))), 2);
  chart(document.getElementById("chart-hit"), t.series, [{ key: "hit_rate", color: "#2f6fde", max: 1, label: () => "hit rate (top: 100 %)" }]);
  chart(document.getElementById("chart-ttft"), t.series, [
    { key: "ttft_p95_s", color: "#c0392b", label: (m) => `TTFT p95 (top: ${fmt.ms(m)})` },
    { key: "rps", color: "#1f8a4c", label: (m) => `requests/s (top: ${m.toFixed(1)})` },
  ]);
}

function chart(canvas, series, lines) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#dde1e8"; g.beginPath(); g.moveTo(0, h - 0.5); g.lineTo(w, h - 0.5); g.stroke();
  if (series.length < 2) { g.fillStyle = "#677085"; g.fillText("collecting samples…", 8, 16); return; }
  const t0 = series[0].t, t1 = series[series.length - 1].t;
  lines.forEach((line, li) => {
    const vals = series.map((p) => p[line.key]).filter((v) => v != null);
    const max = line.max || Math.max(1e-9, ...vals) * 1.15;
    g.strokeStyle = line.color; g.lineWidth = 1.5; g.beginPath();
    let pen = false;
    for (const p of series) {
      const v = p[line.key];
      if (v == null) { pen = false; continue; }
      const x = ((p.t - t0) / Math.max(1e-9, t1 - t0)) * (w - 4) + 2, y = h - 4 - (v / max) * (h - 18);
      if (pen) g.lineTo(x, y); else g.moveTo(x, y);
      pen = true;
    }
    g.stroke();
    g.fillStyle = line.color;
    g.fillText(line.label(max), 8 + li * 200, 12);
  });
}

function render(s) {
  const ready = document.getElementById("ready");
  ready.textContent = s.ready ? "ready" : "not ready";
  ready.className = "badge " + (s.ready ? "ok" : "bad");
  document.getElementById("profile").textContent = s.profile;
  document.getElementById("backend").textContent = s.session_backend;
  renderEngines(s.pools);
  renderSessions(s.sessions, s.now);
  renderMigrations(s.migrations);
  renderTraffic(s.traffic);
  document.getElementById("updated").textContent = new Date(s.now * 1000).toLocaleTimeString();
}

// The data needs an admin key when the gateway has keys configured: taken from the page's
// fragment (#key=..., never sent to the server by the browser) or asked for, kept for this tab.
const KEY_SLOT = "agentgw-admin-key";
const fragKey = new URLSearchParams(location.hash.slice(1)).get("key");
if (fragKey) { sessionStorage.setItem(KEY_SLOT, fragKey); history.replaceState(null, "", location.pathname + location.search); }

function askKey(status) {
  const form = document.getElementById("key-form");
  form.hidden = false;
  document.getElementById("key-why").textContent = status === 401 ? "admin key needed" : "this key is not an admin key";
  form.onsubmit = (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_SLOT, document.getElementById("key").value);
    form.hidden = true;
  };
}

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const key = sessionStorage.getItem(KEY_SLOT);
    const headers = key ? { authorization: `Bearer ${key}` } : {};
    const r = await fetch("/dashboard/state", { cache: "no-store", headers });
    if (r.status === 401 || r.status === 403) askKey(r.status);
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
    conn.textContent = "live"; conn.className = "badge ok";
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (err) {
    conn.textContent = `offline: ${err.message}`; conn.className = "badge bad";
  }
  setTimeout(poll, POLL_MS);
}

poll();
