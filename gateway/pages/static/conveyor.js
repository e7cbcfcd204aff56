// Conveyor's pages: the hover card of a timeline and the console's refresh. No library, no
// build step; DOM text only (textContent), never HTML built from data.
"use strict";

(function () {
  const REFRESH_MS = 1000;
  const REQUESTS_EVERY = 5; // the audit list is read every 5th refresh
  const HISTORY = 180; // refreshes kept for the sparklines (3 minutes at 1 s)
  const MAX_ROWS = 100;
  const SVG = "http://www.w3.org/2000/svg";
  const BUCKET_S = 10; // the history's bars
  const NUM_BUCKETS = 30; // 5 minutes
  const RECENT_S = 900; // records read for the history and the slowest list

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  // ---- the timeline's hover card ----------------------------------------------------------
  function showTip(segment, x, y) {
    const tip = document.getElementById("tip");
    const d = segment.dataset;
    tip.replaceChildren(el("strong", d.label), el("div", d.times, "tip-times"), el("div", d.sentence));
    if (d.phases) tip.append(el("div", d.phases, "tip-phases"));
    if (d.cause) tip.append(el("div", "caused by " + d.cause, "tip-cause"));
    if (d.tokensPerS) tip.append(el("div", Number(d.tokensPerS).toFixed(1) + " tokens/s", "tip-rate"));
    tip.hidden = false;
    const width = tip.offsetWidth;
    tip.style.left = Math.max(8, Math.min(x + 12, window.innerWidth - width - 8)) + "px";
    tip.style.top = (y + 16 + window.scrollY) + "px";
  }

  function hideTip() {
    document.getElementById("tip").hidden = true;
  }

  function setUpTimeline() {
    for (const segment of document.querySelectorAll("#timeline .seg")) {
      segment.addEventListener("mousemove", (e) => showTip(segment, e.clientX, e.clientY));
      segment.addEventListener("mouseleave", hideTip);
      segment.addEventListener("focus", () => {
        const box = segment.getBoundingClientRect();
        showTip(segment, box.left, box.bottom);
      });
      segment.addEventListener("blur", hideTip);
    }
  }

  // ---- the console ------------------------------------------------------------------------
  const state = { refreshes: 0, last: null, tokens: [], preemptions: [] };

  function setValue(id, value, text) {
    const node = document.getElementById(id);
    node.dataset.value = String(value);
    node.textContent = text;
  }

  function percent(fraction) {
    return (100 * fraction).toFixed(1) + " %";
  }

  function timelineLink(requestId) {
    const link = el("a", requestId);
    link.href = "/admin/requests/" + encodeURIComponent(requestId) + "/timeline";
    return link;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell instanceof Node) td.append(cell);
      else td.textContent = cell === null || cell === undefined ? "–" : String(cell);
      tr.append(td);
    }
    return tr;
  }

  function sequencesOf(engine) {
    return [].concat(engine.running, engine.waiting, engine.swapped);
  }

  function tokensGenerated(previous, engine) {
    // output tokens added since the previous refresh: the engine's count; without it (an older
    // replica), those of the sequences seen both times
    if (engine.num_output_tokens !== undefined && previous.num_output_tokens !== undefined) {
      return Math.max(0, engine.num_output_tokens - previous.num_output_tokens);
    }
    const before = new Map(sequencesOf(previous).map((s) => [s.sequence_id, s.num_output_tokens]));
    let total = 0;
    for (const s of sequencesOf(engine)) {
      if (before.has(s.sequence_id)) total += Math.max(0, s.num_output_tokens - before.get(s.sequence_id));
    }
    return total;
  }

  function sumPreemptions(engine) {
    return Object.values(engine.num_preemptions || {}).reduce((a, b) => a + b, 0);
  }

  function spark(id, values) {
    const line = document.getElementById(id);
    const max = Math.max(1, ...values);
    const first = HISTORY - values.length; // the newest value at the right edge
    const points = values.map((v, i) => ((first + i) * 300 / (HISTORY - 1)).toFixed(1) + "," + (38 - 36 * v / max).toFixed(1));
    line.setAttribute("points", points.join(" "));
    document.getElementById(id + "-max").textContent = "max " + max.toFixed(max < 10 ? 1 : 0);
  }

  function remember(list, value) {
    list.push(value);
    if (list.length > HISTORY) list.shift();
  }

  function showRates(engine, now) {
    let tokensPerS = null;
    if (state.last) {
      const seconds = (now - state.last.at) / 1000;
      tokensPerS = seconds > 0 ? tokensGenerated(state.last.engine, engine) / seconds : 0;
      remember(state.tokens, tokensPerS);
      const preempted = Math.max(0, sumPreemptions(engine) - sumPreemptions(state.last.engine));
      remember(state.preemptions, seconds > 0 ? preempted / seconds : 0);
      spark("spark-tokens", state.tokens);
      spark("spark-preemptions", state.preemptions);
    }
    setValue("tokens-per-s", tokensPerS === null ? "" : tokensPerS.toFixed(3), tokensPerS === null ? "…" : tokensPerS.toFixed(1));
    const steps = engine.steps_per_s;
    setValue("steps-per-s", steps === null ? "" : steps, steps === null ? "–" : steps.toFixed(1));
    const modes = Object.entries(engine.num_preemptions || {}).map(([mode, n]) => mode + " " + n);
    setValue("preemptions", sumPreemptions(engine), sumPreemptions(engine) + (modes.length ? " (" + modes.join(", ") + ")" : ""));
  }

  function showGroups(engine) {
    const groups = new Map();
    for (const [status, list] of [["waiting", engine.waiting], ["running", engine.running], ["swapped", engine.swapped]]) {
      for (const s of list) {
        const key = JSON.stringify([s.priority, s.tenant]);
        if (!groups.has(key)) groups.set(key, { priority: s.priority, tenant: s.tenant, waiting: 0, running: 0, swapped: 0 });
        groups.get(key)[status] += 1;
      }
    }
    const sorted = [...groups.values()].sort((a, b) => a.priority - b.priority || a.tenant.localeCompare(b.tenant));
    document.getElementById("groups").replaceChildren(
      ...sorted.map((g) => row([g.priority, g.tenant, g.waiting, g.running, g.swapped])));
  }

  function showSequences(engine) {
    const all = sequencesOf(engine);
    const rows = all.slice(0, MAX_ROWS).map((s) => {
      const tr = row([timelineLink(s.request_id), s.status, s.priority, s.tenant, s.num_output_tokens,
        s.num_gpu_blocks + " / " + s.num_cpu_blocks, s.num_preemptions, s.age_s.toFixed(1) + " s"]);
      tr.dataset.requestId = s.request_id;
      tr.dataset.status = s.status;
      return tr;
    });
    document.getElementById("sequences").replaceChildren(...rows);
    const more = document.getElementById("sequences-more");
    more.hidden = all.length <= MAX_ROWS;
    more.textContent = (all.length - MAX_ROWS) + " more not shown";
  }

  function showEngine(engine, now) {
    setValue("num-waiting", engine.num_waiting, engine.num_waiting);
    setValue("num-running", engine.num_running, engine.num_running);
    setValue("num-swapped", engine.num_swapped, engine.num_swapped);
    setValue("kv-usage", engine.gpu_kv.usage, percent(engine.gpu_kv.usage) + " of " + engine.gpu_kv.num_blocks + " blocks");
    setValue("cpu-kv-usage", engine.cpu_kv.usage, percent(engine.cpu_kv.usage));
    document.getElementById("kv-bar").setAttribute("width", (100 * engine.gpu_kv.usage).toFixed(2));
    showRates(engine, now);
    showGroups(engine);
    showSequences(engine);
  }

  function totalSeconds(record) {
    if (!record.finished_at) return null;
    return (Date.parse(record.finished_at) - Date.parse(record.received_at)) / 1000;
  }

  function showSlowest(records) {
    const done = records.filter((r) => totalSeconds(r) !== null);
    done.sort((a, b) => totalSeconds(b) - totalSeconds(a));
    const rows = done.slice(0, 10).map((r) => {
      const tr = row([timelineLink(r.id), r.status, r.effective_priority, totalSeconds(r).toFixed(2) + " s",
        r.queue_time_s === null ? null : r.queue_time_s.toFixed(3) + " s", r.preempted_time_s.toFixed(3) + " s"]);
      tr.dataset.requestId = r.id;
      return tr;
    });
    document.getElementById("slowest").replaceChildren(...rows);
  }

  function buckets(records, serverNow, valueOf) {
    const sums = new Array(NUM_BUCKETS).fill(0);
    for (const r of records) {
      if (!r.finished_at) continue;
      const age = (serverNow - Date.parse(r.finished_at)) / 1000;
      const index = NUM_BUCKETS - 1 - Math.floor(Math.max(age, 0) / BUCKET_S);
      if (index >= 0) sums[index] += valueOf(r);
    }
    return sums;
  }

  function bars(id, values, text) {
    const svg = document.getElementById(id);
    const max = Math.max(...values);
    const width = 300 / values.length;
    svg.replaceChildren(...values.map((v, i) => {
      const bar = document.createElementNS(SVG, "rect");
      const height = max > 0 ? 38 * v / max : 0;
      bar.setAttribute("x", (i * width + 0.5).toFixed(1));
      bar.setAttribute("width", (width - 1).toFixed(1));
      bar.setAttribute("y", (40 - height).toFixed(1));
      bar.setAttribute("height", height.toFixed(1));
      return bar;
    }));
    svg.dataset.total = String(values.reduce((a, b) => a + b, 0));
    document.getElementById(id + "-max").textContent = text(max);
  }

  function showHistory(records, serverNow) {
    const tokens = buckets(records, serverNow, (r) => r.completion_tokens || 0);
    bars("history-tokens", tokens.map((n) => n / BUCKET_S), (max) => "max " + max.toFixed(1) + " tok/s");
    const preemptions = buckets(records, serverNow, (r) => r.num_preemptions_swap + r.num_preemptions_recompute);
    bars("history-preemptions", preemptions, (max) => "max " + max + " in 10 s");
  }

  async function showRecent(serverNow) {
    const since = new Date(serverNow - RECENT_S * 1000).toISOString();
    const page = await getJson("/admin/requests?limit=1000&received_after=" + encodeURIComponent(since));
    showHistory(page.items, serverNow);
    showSlowest(page.items);
  }

  async function getJson(path, withDate) {
    const response = await fetch(path, { headers: { Accept: "application/json" }, cache: "no-store" });
    if (!response.ok) throw new Error(path + " answered " + response.status);
    const body = await response.json();
    // the server's clock (its Date header) places the history, whatever the browser's clock says
    return withDate ? [body, Date.parse(response.headers.get("Date")) || Date.now()] : body;
  }

  async function refresh() {
    const status = document.getElementById("status");
    try {
      const now = Date.now();
      const [engine, serverNow] = await getJson("/admin/engine", true);
      showEngine(engine, now);
      if (state.refreshes % REQUESTS_EVERY === 0) await showRecent(serverNow);
      state.last = { engine: engine, at: now };
      state.refreshes += 1;
      status.dataset.refreshes = String(state.refreshes);
      status.textContent = "Live from /admin/engine · " + engine.model + " · updated " + new Date(now).toLocaleTimeString();
      status.classList.remove("failed");
    } catch (error) {
      status.textContent = "Could not refresh: " + error.message + " (retrying)";
      status.classList.add("failed");
    }
    window.setTimeout(refresh, REFRESH_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const page = document.body.dataset.page;
    if (page === "timeline") setUpTimeline();
    if (page === "console") refresh();
  });
})();
