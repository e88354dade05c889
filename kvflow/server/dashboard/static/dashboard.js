// kvflow's live dashboard: reads /dashboard/events (server-sent events, schema in
// kvflow/server/dashboard/schema.py and docs/dashboard.md) and draws the requests' Gantt rows, the
// engine steps on the same time axis, the KV block map, and uPlot charts of the last N minutes.
// Times are the server's monotonic seconds; `offset` maps them to this page's clock.
"use strict";

(function () {
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  const C = {
    queued: color("--kv-queued"), prefill: color("--kv-prefill"), decode: color("--kv-decode"),
    preempted: color("--kv-preempted"), finished: color("--kv-finished"), cached: color("--kv-cached"),
    shared: color("--kv-shared"), free: color("--kv-free"), p50: color("--kv-p50"), p99: color("--kv-p99"),
    length: "#555555", abort: color("--kv-fail"), ink: "#222222", grid: "#e4e4e4",
  };
  // Used blocks take their request's colour: dark tones, none of them a state colour above.
  const REQUEST_COLORS = ["#0072b2", "#1b3a6b", "#3d7a5c", "#6b4c9a", "#34495e", "#2f4f4f", "#5b6770", "#7a2e4f"];
  // A model with several cache groups (kvflow/kv_cache/kv_cache_config.py) colours used blocks by
  // group instead: a hue per kind, and the groups of one kind in steps of lightness.
  const KIND_HUES = { full_attention: 210, mla: 230, sliding_attention: 150, linear_attention: 285 };
  const KIND_WORDS = {
    full_attention: "full attention", mla: "latent attention (MLA)",
    sliding_attention: "sliding window", linear_attention: "linear-attention state",
  };
  const GROUP_LIGHTNESS = [34, 46, 28, 40, 52]; // % per group of one kind, dark enough for the stripes
  const STEP_SPAN_S = 30; // the server keeps each step of the last 30 s (window.py)
  const LABEL_W = 92; // px left of the time axis (request ids), shared by the Gantt and the steps
  const HIST_BINS = 40;
  const GANTT_H = 250, STEPS_H = 100, CHART_H = 140; // px: the page fits 1280x800

  const S = {
    config: null, F: null, offset: 0, rowH: 14, steps: [], seconds: new Map(), requests: new Map(), itl: [],
    running: [], waiting: [], kv: null, totals: null, frames: 0, hover: null, rows: [],
  };
  window.kvflowDashboard = S; // for the browser test and the curious

  const $ = (id) => document.getElementById(id);
  const fmt = (v, digits = 1) => (v === null || v === undefined || !isFinite(v) ? "-" : Number(v).toFixed(digits));
  const nowServer = () => performance.now() / 1000 - S.offset;
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";");

  // ------------------------------------------------------------------------------- the stream

  const params = new URLSearchParams(location.search);
  const key = params.get("api_key");
  if (key) { // the server set a cookie with it: keep the key out of the address bar from here on
    params.delete("api_key");
    history.replaceState(null, "", location.pathname + (params.toString() ? "?" + params : ""));
  }
  // The cookie set with the page carries the key; the event stream also gets it in its URL (never
  // shown) in case cookies are blocked. Links a user sees never carry it.
  const withKey = (url) => (key ? url + "?api_key=" + encodeURIComponent(key) : url);

  function connect() {
    const source = new EventSource(withKey("/dashboard/events"));
    source.onopen = () => setConn(true);
    source.onerror = () => setConn(false);
    source.onmessage = (event) => {
      const frame = JSON.parse(event.data);
      if (frame.type === "hello") reset(frame);
      apply(frame);
      S.frames += 1;
      schedule();
    };
  }

  function setConn(ok) {
    const el = $("conn");
    el.textContent = ok ? "live" : "reconnecting…";
    el.className = "conn " + (ok ? "ok" : "bad");
  }

  function reset(hello) {
    S.config = hello.config;
    S.F = {};
    for (const [kind, names] of Object.entries(hello.fields)) {
      S.F[kind] = Object.fromEntries(names.map((name, i) => [name, i]));
    }
    S.steps = []; S.seconds = new Map(); S.requests = new Map(); S.itl = []; S.kv = null;
    $("model").textContent = hello.config.model.split("/").filter(Boolean).pop() || hello.config.model;
    $("model").title = hello.config.model;
    $("doctor-link").hidden = !hello.config.doctor;
  }

  function apply(frame) {
    S.offset = performance.now() / 1000 - frame.now;
    const windowS = S.config.window_s;
    for (const row of frame.steps) S.steps.push(row);
    for (const row of frame.seconds) S.seconds.set(row[0], row);
    for (const obj of frame.requests) { S.requests.delete(obj.id); S.requests.set(obj.id, obj); }
    for (const row of frame.itl) S.itl.push(row);
    S.running = frame.running; S.waiting = frame.waiting;
    if (frame.kv) S.kv = frame.kv;
    S.totals = frame.totals;
    prune(frame.now, windowS);
  }

  function prune(now, windowS) {
    const t = S.F.step.t;
    let i = 0;
    while (i < S.steps.length && S.steps[i][t] < now - STEP_SPAN_S) i++;
    if (i) S.steps.splice(0, i);
    i = 0;
    while (i < S.itl.length && S.itl[i][0] < now - windowS) i++;
    if (i) S.itl.splice(0, i);
    for (const sec of S.seconds.keys()) if (sec < now - windowS - 1) S.seconds.delete(sec);
    const active = new Set([...S.running, ...S.waiting]);
    for (const [id, r] of S.requests) {
      if (!active.has(id) && r.state !== "finished") r.state = "finished"; // left without a final row
      if (r.state === "finished" && (r.finished ?? now) < now - windowS) S.requests.delete(id);
    }
  }

  // ------------------------------------------------------------------------------- rendering

  let pending = false;
  let lastHist = 0;
  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; render(); });
  }

  function render() {
    if (!S.config) return;
    const now = nowServer();
    drawStats(now);
    drawGantt(now);
    drawSteps(now);
    drawBlockMap();
    drawSeries(now);
    if (performance.now() - lastHist > 1000) { // sorting every gap: once a second is plenty
      lastHist = performance.now();
      drawHistograms(now);
    }
  }

  function drawStats(now) {
    $("stat-running").textContent = S.running.length;
    $("stat-waiting").textContent = S.waiting.length;
    const totals = S.totals || { finished: {}, preemptions: 0 };
    $("stat-finished").textContent = Object.values(totals.finished).reduce((a, b) => a + b, 0);
    $("stat-preemptions").textContent = totals.preemptions;
    const Fs = S.F.second;
    let tokens = 0, drafts = 0, accepted = 0;
    for (const row of S.seconds.values()) {
      if (row[0] >= Math.floor(now) - 5 && row[0] < Math.floor(now)) tokens += row[Fs.output_tokens];
      drafts += row[Fs.spec_draft_tokens]; accepted += row[Fs.spec_accepted_tokens];
    }
    $("stat-throughput").textContent = fmt(tokens / 5, 0);
    $("stat-spec-box").hidden = drafts === 0;
    if (drafts) $("stat-spec").textContent = fmt((100 * accepted) / drafts, 0) + "%";
    const list = $("running-list");
    list.replaceChildren(...S.running.map((id) => {
      const li = document.createElement("li");
      li.dataset.id = id; li.textContent = shortId(id);
      return li;
    }));
  }

  function shortId(id) { return id.length > 14 ? "…" + id.slice(-13) : id; }

  function fitCanvas(canvas, cssHeight) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(cssHeight * dpr)) {
      canvas.width = Math.round(w * dpr); canvas.height = Math.round(cssHeight * dpr);
      canvas.style.height = cssHeight + "px";
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, cssHeight);
    return { ctx, w, h: cssHeight };
  }

  function timeAxis(ctx, x0, x1, y, span, now, h) {
    const step = [1, 2, 5, 10, 15, 30, 60, 120].find((s) => span / s <= 8) || 300;
    ctx.fillStyle = C.ink; ctx.strokeStyle = C.grid; ctx.font = "10px system-ui, sans-serif"; ctx.textAlign = "center";
    for (let ago = 0; ago <= span; ago += step) {
      const x = x1 - ((x1 - x0) * ago) / span;
      ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, h); ctx.stroke();
      ctx.fillText(ago === 0 ? "now" : "-" + ago + " s", x, y);
    }
  }

  const span = () => Number($("span").value);

  function ganttRows(now, spanS) {
    const rows = [];
    for (const r of S.requests.values()) {
      const end = r.state === "finished" ? r.finished ?? r.last_token ?? now : now;
      if (end >= now - spanS) rows.push(r);
    }
    rows.sort((a, b) => a.arrival - b.arrival);
    return rows;
  }

  function drawGantt(now) {
    const canvas = $("gantt");
    const spanS = span();
    const all = ganttRows(now, spanS);
    const { ctx, w, h } = fitCanvas(canvas, GANTT_H);
    const axisH = 14;
    const rowH = Math.max(5, Math.min(14, (h - axisH) / Math.max(all.length, 1)));
    const maxRows = Math.floor((h - axisH) / rowH);
    const rows = all.slice(-maxRows);
    S.rows = rows; S.rowH = rowH;
    canvas.dataset.rows = rows.length;
    canvas.dataset.requests = S.requests.size;
    const x0 = LABEL_W, x1 = w - 6;
    const X = (t) => x1 - ((x1 - x0) * (now - t)) / spanS;
    timeAxis(ctx, x0, x1, h - 3, spanS, now, h - axisH);
    const bar = (t0, t1, y, fill) => {
      const a = Math.max(X(t0), x0), b = Math.min(X(t1), x1);
      if (b <= x0 || a >= x1) return;
      ctx.fillStyle = fill; ctx.fillRect(a, y, Math.max(b - a, 1), rowH - 1);
    };
    ctx.font = Math.min(11, rowH) + "px ui-monospace, monospace"; ctx.textAlign = "right";
    rows.forEach((r, i) => {
      const y = i * rowH;
      const end = r.state === "finished" ? r.finished ?? r.last_token ?? now : now;
      if (S.hover && S.hover.id === r.id) { ctx.fillStyle = "#fff3c4"; ctx.fillRect(0, y, w, rowH); }
      if (rowH >= 8) { ctx.fillStyle = C.ink; ctx.fillText(shortId(r.id), x0 - 4, y + rowH - 3); }
      bar(r.arrival, r.first_scheduled ?? end, y, C.queued);
      if (r.first_token !== null) bar(r.first_token, end, y, C.decode);
      r.chunks.forEach(([t, _n], k) => { // a chunk lasts until the next event of the request
        const next = Math.min(...[r.chunks[k + 1]?.[0], r.first_token > t ? r.first_token : undefined,
          ...r.preemptions.map((p) => (p[0] > t ? p[0] : undefined)), end].filter((v) => v !== undefined));
        bar(t, next, y, C.prefill);
        const x = X(t);
        if (x > x0) { ctx.fillStyle = "#fff"; ctx.fillRect(x, y, 1, rowH - 1); } // chunk boundary
      });
      for (const [p0, p1] of r.preemptions) bar(p0, p1 ?? end, y, C.preempted);
      if (r.state === "finished") {
        ctx.fillStyle = r.reason === "abort" ? C.abort : r.reason === "length" ? C.length : C.finished;
        const x = X(end);
        if (x >= x0 && x <= x1) ctx.fillRect(x - 1, y, 3, rowH - 1);
      }
    });
    if (!rows.length) {
      ctx.fillStyle = C.queued; ctx.textAlign = "center"; ctx.font = "13px system-ui, sans-serif";
      ctx.fillText("no requests in the last " + spanS + " s: send some load", (x0 + x1) / 2, (h - axisH) / 2);
    }
  }

  function drawSteps(now) {
    const canvas = $("steps");
    const spanS = Math.min(span(), STEP_SPAN_S);
    const { ctx, w, h } = fitCanvas(canvas, STEPS_H);
    const F = S.F.step, axisH = 14, plotH = h - axisH - 2;
    const x0 = LABEL_W, x1 = w - 6;
    const X = (t) => x1 - ((x1 - x0) * (now - t)) / spanS;
    const shown = S.steps.filter((s) => s[F.t] >= now - spanS);
    canvas.dataset.steps = shown.length;
    timeAxis(ctx, x0, x1, h - 3, spanS, now, h - axisH);
    let maxTok = 1, maxMs = 1;
    for (const s of shown) { maxTok = Math.max(maxTok, s[F.prefill_tokens] + s[F.decode_tokens]); maxMs = Math.max(maxMs, s[F.dur_ms]); }
    ctx.textAlign = "right"; ctx.fillStyle = C.ink; ctx.font = "10px system-ui, sans-serif";
    ctx.fillText(maxTok + " tok", x0 - 4, 10);
    ctx.fillText(fmt(maxMs, 0) + " ms", x0 - 4, 22);
    for (const s of shown) {
      const a = X(s[F.t]), width = Math.max(1, ((x1 - x0) * s[F.dur_ms]) / 1000 / spanS);
      const hp = (plotH * s[F.prefill_tokens]) / maxTok, hd = (plotH * s[F.decode_tokens]) / maxTok;
      ctx.fillStyle = C.prefill; ctx.fillRect(a, plotH - hp, width, hp);
      ctx.fillStyle = C.decode; ctx.fillRect(a, plotH - hp - hd, width, hd);
    }
    ctx.strokeStyle = C.ink; ctx.lineWidth = 1; ctx.beginPath();
    shown.forEach((s, i) => {
      const x = X(s[F.t]), y = plotH - (plotH * s[F.dur_ms]) / maxMs;
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    ctx.stroke();
  }

  function requestColor(id) {
    let hash = 0;
    for (let i = 0; i < id.length; i++) hash = (hash * 31 + id.charCodeAt(i)) | 0;
    return REQUEST_COLORS[Math.abs(hash) % REQUEST_COLORS.length];
  }

  // Colour of each cache group (hue by kind, lightness by its rank among the groups of that kind).
  function groupColors(kinds) {
    const seen = {};
    return kinds.map((kind) => {
      const rank = (seen[kind] = (seen[kind] ?? -1) + 1);
      const hue = KIND_HUES[kind] ?? 30;
      return `hsl(${hue}, 55%, ${GROUP_LIGHTNESS[rank % GROUP_LIGHTNESS.length]}%)`;
    });
  }

  let legendKinds = null;
  function drawGroupLegend(kinds, colors) {
    const key = kinds.join(",");
    if (legendKinds === key) return;
    legendKinds = key;
    const el = $("kv-used-legend");
    if (kinds.length <= 1) {
      el.innerHTML = '<i style="background:var(--kv-decode)"></i>used (colour per request)';
      return;
    }
    const first = {};
    kinds.forEach((kind, g) => { if (!(kind in first)) first[kind] = g; });
    el.innerHTML = "used by cache group:" + Object.keys(first).map((kind) => {
      const n = kinds.filter((k) => k === kind).length;
      return `<i style="background:${colors[first[kind]]}"></i>${esc(KIND_WORDS[kind] ?? kind)}` + (n > 1 ? ` (${n} groups)` : "");
    }).join(" ");
  }

  let blockLayout = null;
  function drawBlockMap() {
    const canvas = $("blockmap");
    const n = S.config.num_blocks;
    const width = canvas.clientWidth;
    const cell = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 260) / Math.max(n, 1)))));
    const cols = Math.max(1, Math.floor(width / cell));
    const { ctx, h } = fitCanvas(canvas, Math.ceil(n / cols) * cell + 1);
    blockLayout = { cell, cols };
    const kv = S.kv;
    const cachedInUse = new Set(kv ? kv.cached_in_use : []);
    const hovered = S.hover ? S.hover.id : null;
    const kinds = (kv && kv.cache_group_kinds) || [];
    const colors = groupColors(kinds);
    const byGroup = kv && kv.cache_group && kinds.length > 1; // else: one group, colour per request
    drawGroupLegend(kinds, colors);
    for (let i = 0; i < n; i++) {
      const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
      const code = kv ? kv.owner[i] : -1;
      let fill = C.free;
      if (code === -2) fill = C.cached;
      const group = code >= 0 ? kv.groups[code] : null;
      if (group && byGroup) fill = colors[kv.cache_group[i]] ?? C.shared;
      else if (group) fill = group.length > 1 ? C.shared : requestColor(group[0]);
      ctx.fillStyle = fill; ctx.fillRect(x, y, cell - 1, cell - 1);
      if (group && group.length > 1 && cell >= 5) { // shared: striped, as in the legend
        ctx.fillStyle = "#fff"; ctx.fillRect(x + 1, y + cell - 3, cell - 3, 1);
      }
      if (group && cachedInUse.has(i) && cell >= 6) { ctx.fillStyle = C.cached; ctx.fillRect(x, y, 2, 2); }
      if (hovered && group && group.includes(hovered)) {
        ctx.strokeStyle = "#000"; ctx.lineWidth = 1.5; ctx.strokeRect(x + 0.75, y + 0.75, cell - 2.5, cell - 2.5);
      }
    }
    const used = kv ? kv.used : 0;
    $("kv-used").textContent = used;
    $("kv-cached").textContent = kv ? kv.cached_free : 0;
    $("kv-shared").textContent = kv ? kv.shared : 0;
    $("kv-free").textContent = n - used - (kv ? kv.cached_free : 0); // used + cached + free = all blocks
    $("kv-caption").textContent = `(${n} blocks of ${S.config.block_size} tokens, ${fmt((100 * used) / n, 0)}% used)`;
    void h;
  }

  // ------------------------------------------------------------------------------- uPlot charts

  const charts = {};
  S.charts = charts; // the browser test reads what each panel holds
  // `shape` names the chart's series set: when it changes (speculation turned up), the chart is rebuilt.
  function chart(id, opts, data, shape = "") {
    const el = $(id);
    const width = Math.max(200, el.clientWidth);
    if (charts[id] && charts[id].shape !== shape) { charts[id].destroy(); delete charts[id]; }
    if (!charts[id]) {
      charts[id] = new uPlot({ width, height: CHART_H, legend: { show: true, live: false }, cursor: { drag: { x: false } }, ...opts }, data, el);
      charts[id].shape = shape;
    } else {
      if (charts[id].width !== width) charts[id].setSize({ width, height: CHART_H });
      charts[id].setData(data);
    }
  }

  const secondsAgoAxis = { scale: "x", values: (u, ticks) => ticks.map((t) => (t === 0 ? "now" : t + " s")) };

  function drawSeries(now) {
    const F = S.F.second;
    const rows = [...S.seconds.values()].sort((a, b) => a[0] - b[0]).filter((r) => r[0] < Math.floor(now));
    const xs = rows.map((r) => r[0] - Math.floor(now));
    chart("usage-chart", {
      scales: { x: { time: false }, pct: { range: [0, 100] }, n: { range: (u, lo, hi) => [0, Math.max(1, hi)] } },
      axes: [secondsAgoAxis, { scale: "pct", label: "KV used %", size: 44 }, { scale: "n", side: 1, grid: { show: false }, size: 36 }],
      series: [{}, { label: "KV used % (max)", scale: "pct", stroke: C.decode, width: 2 },
        { label: "running (max)", scale: "n", stroke: C.finished, width: 1.5 },
        { label: "waiting (max)", scale: "n", stroke: C.queued, width: 1.5 },
        { label: "preemptions", scale: "n", stroke: C.preempted, fill: C.preempted, paths: uPlot.paths.bars({ size: [0.8, 12] }) }],
    }, [xs, rows.map((r) => 100 * r[F.kv_usage_max]), rows.map((r) => r[F.running_max]), rows.map((r) => r[F.waiting_max]),
      rows.map((r) => r[F.preemptions])]);
    // With speculative decoding on, the share of draft tokens accepted each second joins the chart.
    const spec = rows.some((r) => r[F.spec_draft_tokens] > 0);
    const acceptance = rows.map((r) => (r[F.spec_draft_tokens] ? (100 * r[F.spec_accepted_tokens]) / r[F.spec_draft_tokens] : null));
    chart("throughput-chart", {
      scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, Math.max(1, hi)] }, pct: { range: [0, 100] } },
      axes: [secondsAgoAxis, { label: "tokens/s", size: 50 },
        ...(spec ? [{ scale: "pct", side: 1, grid: { show: false }, size: 40, label: "% accepted" }] : [])],
      series: [{}, { label: "output", stroke: C.decode, width: 2 }, { label: "prefill", stroke: C.prefill, width: 1.5 },
        ...(spec ? [{ label: "drafts accepted %", scale: "pct", stroke: C.shared, width: 1.5, dash: [4, 3] }] : [])],
    }, [xs, rows.map((r) => r[F.output_tokens]), rows.map((r) => r[F.prefill_tokens]), ...(spec ? [acceptance] : [])],
    spec ? "spec" : "");
  }

  // The percentile of kvflow/stats.py: linear interpolation between order statistics.
  function percentile(sorted, q) {
    if (!sorted.length) return null;
    const k = ((sorted.length - 1) * q) / 100, lo = Math.floor(k), hi = Math.min(lo + 1, sorted.length - 1);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (k - lo);
  }

  const histTop = {};
  function histogram(id, captionId, values, label) {
    const sorted = Float64Array.from(values).sort();
    const p50 = percentile(sorted, 50), p99 = percentile(sorted, 99);
    $(captionId).textContent = sorted.length
      ? `p50 ${fmt(p50)} ms · p99 ${fmt(p99)} ms · n=${sorted.length} (last ${Math.round(S.config.window_s / 60)} min)`
      : "(none yet)";
    // The range ends past p99 (rarer outliers pile into the last bin) so that the body stays readable.
    const top = sorted.length ? Math.max(p99 * 1.5, p50 * 3, 1e-3) : 1;
    const width = top / HIST_BINS;
    const xs = Array.from({ length: HIST_BINS }, (_, i) => (i + 0.5) * width);
    const counts = new Array(HIST_BINS).fill(0);
    for (const v of sorted) counts[Math.min(HIST_BINS - 1, Math.floor(v / width))] += 1;
    const marks = (u) => {
      const ctx = u.ctx;
      for (const [v, c] of [[p50, C.p50], [p99, C.p99]]) {
        if (v === null) continue;
        const x = u.valToPos(v, "x", true);
        ctx.save(); ctx.strokeStyle = c; ctx.lineWidth = 2 * devicePixelRatio; ctx.setLineDash([5, 3]);
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke(); ctx.restore();
      }
    };
    histTop[id] = top; // read by the x range on every redraw (a fixed range would keep the first one)
    chart(id, {
      scales: { x: { time: false, range: () => [0, histTop[id]] }, y: { range: (u, lo, hi) => [0, Math.max(1, hi)] } },
      axes: [{ label: label + " (ms)", values: (u, t) => t.map((v) => fmt(v, v < 10 ? 1 : 0)) }, { label: "count", size: 44 }],
      series: [{ label: "ms", value: (u, v) => fmt(v, 1) },
        { label: "requests", stroke: C.decode, fill: C.decode + "aa", paths: uPlot.paths.bars({ size: [0.95, 40] }) }],
      hooks: { draw: [marks] },
    }, [xs, counts]);
    if (charts[id]) charts[id].hooks.draw = [marks];
  }

  // Queue time (first scheduled less arrival) p50 per priority, when the window holds several.
  function queueByPriority(since) {
    const waits = new Map();
    for (const r of S.requests.values()) {
      if (r.first_scheduled === null || r.arrival < since) continue;
      const p = r.priority ?? 0;
      if (!waits.has(p)) waits.set(p, []);
      waits.get(p).push((r.first_scheduled - r.arrival) * 1000);
    }
    if (waits.size < 2) return "";
    const parts = [...waits.keys()].sort((a, b) => a - b).map((p) => {
      const sorted = Float64Array.from(waits.get(p)).sort();
      return `${p}: ${fmt(percentile(sorted, 50))} ms (n=${sorted.length})`;
    });
    return "queued p50 by priority · " + parts.join(" · ");
  }

  function drawHistograms(now) {
    const windowS = S.config.window_s;
    const ttft = [];
    for (const r of S.requests.values()) if (r.ttft_ms !== null && r.first_token >= now - windowS) ttft.push(r.ttft_ms);
    histogram("ttft-chart", "ttft-caption", ttft, "TTFT");
    $("queue-by-priority").textContent = queueByPriority(now - windowS);
    histogram("itl-chart", "itl-caption", S.itl.map((g) => g[1]), "ITL");
  }

  // ------------------------------------------------------------------------------- hover

  const tooltip = $("tooltip");
  function showTip(event, html) {
    tooltip.innerHTML = html; tooltip.hidden = false;
    tooltip.style.left = Math.min(event.clientX + 14, innerWidth - 370) + "px";
    tooltip.style.top = event.clientY + 14 + "px";
  }
  function hideTip() { tooltip.hidden = true; if (S.hover) { S.hover = null; schedule(); } }

  function requestTip(r) {
    const rows = [
      ["state", r.state + (r.reason ? " (" + r.reason + ")" : "")],
      ["priority", r.priority ?? 0],
      ["TTFT", fmt(r.ttft_ms) + " ms"],
      // While running, the server computes them over the request's last 256 gaps (schema.py).
      ["ITL p50" + (r.state === "finished" ? "" : " (recent)"), fmt(r.itl_p50_ms) + " ms"],
      ["ITL p99" + (r.state === "finished" ? "" : " (recent)"), fmt(r.itl_p99_ms) + " ms"],
      ["prompt tokens", r.prompt_tokens], ["cached tokens", r.cached_tokens], ["output tokens", r.output_tokens],
      ["prefill chunks", r.chunks.length], ["preemptions", r.preemptions.length],
    ];
    return `<b>${esc(r.id)}</b><table>` + rows.map(([k, v]) => `<tr><th>${k}</th><td>${esc(v)}</td></tr>`).join("") +
      "</table><i>click: where its time went</i>";
  }

  // A click on a row opens its story (kvflow/server/dashboard/request_story.py): where its TTFT and
  // its slowest gaps went. The same text as `kvflow doctor --request ID`.
  function requestStoryUrl(id) {
    return location.pathname.replace(/\/$/, "") + "/request/" + encodeURIComponent(id);
  }

  $("gantt").addEventListener("mousemove", (event) => {
    const rect = event.target.getBoundingClientRect();
    const r = S.rows[Math.floor((event.clientY - rect.top) / S.rowH)];
    if (!r) return hideTip();
    if (!S.hover || S.hover.id !== r.id) { S.hover = r; schedule(); }
    showTip(event, requestTip(r));
  });
  $("gantt").addEventListener("mouseleave", hideTip);
  $("gantt").addEventListener("click", (event) => {
    const rect = event.target.getBoundingClientRect();
    const r = S.rows[Math.floor((event.clientY - rect.top) / S.rowH)];
    if (r) window.open(requestStoryUrl(r.id), "_blank", "noopener");
  });

  $("blockmap").addEventListener("mousemove", (event) => {
    if (!blockLayout || !S.kv) return hideTip();
    const rect = event.target.getBoundingClientRect();
    const { cell, cols } = blockLayout;
    const col = Math.floor((event.clientX - rect.left) / cell), row = Math.floor((event.clientY - rect.top) / cell);
    const i = row * cols + col;
    if (col >= cols || i >= S.config.num_blocks) return hideTip();
    const code = S.kv.owner[i];
    const what = code === -1 ? "free" : code === -2 ? "free, caches a prefix (reusable)"
      : (S.kv.groups[code].length > 1 ? "shared prefix: " : "used by ") + S.kv.groups[code].map(esc).join(", ");
    const g = S.kv.cache_group ? S.kv.cache_group[i] : -1;
    const kind = g >= 0 ? S.kv.cache_group_kinds[g] : null;
    const group = kind ? `<br>cache group ${g}: ${esc(KIND_WORDS[kind] ?? kind)}` : "";
    showTip(event, `<b>block ${i + 1}</b><br>${what}${group}`);
  });
  $("blockmap").addEventListener("mouseleave", hideTip);
  $("span").addEventListener("change", schedule);
  window.addEventListener("resize", schedule);
  setInterval(schedule, 1000); // the time axis moves on while the server is idle

  connect();
})();
