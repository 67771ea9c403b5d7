// The JobManager's web page: plain JavaScript and SVG, no build step, no external resources.
// It reads the REST API (see /openapi.json) and refreshes itself every refresh-interval ms.
"use strict";

const state = { token: sessionStorage.getItem("keyedstate-token") || "", job: null, checkpoint: null, refreshMs: 3000 };

function $(sel) { return document.querySelector(sel); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

class AuthNeeded extends Error {}

async function api(path) {
  const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
  const response = await fetch(path.replace(/^\//, ""), { headers, cache: "no-store" });
  if (response.status === 401) throw new AuthNeeded((await response.json()).errors.join("; "));
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).errors.join("; "); } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response.json();
}

function bytes(n) {
  if (n == null || n < 0) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function ms(n) {
  if (n == null || n < 0) return "–";
  return n < 1000 ? n + " ms" : (n / 1000).toFixed(n < 10000 ? 2 : 1) + " s";
}

function time(ts) {
  if (ts == null || ts <= 0) return "–";
  return new Date(ts).toISOString().replace("T", " ").replace("Z", "");
}

function status(text) { return el("span", { class: "st-" + text }, text); }

function fill(tbody, rows) { tbody.replaceChildren(...rows); }

function renderCluster(overview, tms) {
  $("#tm-count").textContent = overview.taskmanagers;
  $("#slots-total").textContent = overview["slots-total"];
  $("#slots-free").textContent = overview["slots-available"];
  $("#jobs-running").textContent = overview["jobs-running"];
  $("#version").textContent = "keyedstate " + overview["flink-version"];
  fill($("#taskmanagers tbody"), tms.taskmanagers.map((tm) => el("tr", { "data-taskmanager": tm.id },
    el("td", {}, tm.id), el("td", {}, tm.path), el("td", {}, status(tm.status)),
    el("td", { class: "slots" }, tm.slotsNumber), el("td", { class: "free" }, tm.freeSlots),
    el("td", {}, time(tm.timeSinceLastHeartbeat)),
    el("td", { class: "muted" }, tm.slots.map((s) => s.free ? "free" : s.jobId + "/" + s.operatorId + "/" + s.subtaskIndex).join(", ")),
    el("td", { class: "slot-processes" }, slotProcesses(tm.slotProcesses)))));
}

// "–" for a TaskManager that serves every slot itself (taskmanager.slot-processes 1).
function slotProcesses(processes) {
  if (!processes.length) return "–";
  return processes.map((p) => "#" + p.index + " " + p.address + " pid " + (p.pid || "replacing") +
    " (slots " + p.slots.join(", ") + ")").join("; ");
}

function renderJobs(jobs) {
  fill($("#job-table tbody"), jobs.jobs.map((j) => el("tr", { "data-job": j.jid },
    el("td", {}, j.jid), el("td", { class: "status" }, status(j.state)),
    el("td", {}, j.tasks.running + "/" + j.tasks.total),
    el("td", { class: "restarts" }, j.restarts), el("td", { class: "routing-version" }, j["routing-version"]),
    el("td", {}, j["committed-epoch"]), el("td", {}, j["durable-epoch"]),
    el("td", {}, j["latest-checkpoint-id"] || "–"), el("td", { class: "muted" }, j["failure-cause"]))));
  const select = $("#job-select");
  const ids = jobs.jobs.map((j) => j.jid);
  if (select.options.length !== ids.length || ids.some((id, i) => select.options[i].value !== id)) {
    select.replaceChildren(...ids.map((id) => el("option", { value: id }, id)));
  }
  if (!ids.includes(state.job)) state.job = ids.length ? ids[0] : null;
  if (state.job) select.value = state.job;
}

function renderChart(history) {
  const chart = $("#chk-chart");
  const W = 800, H = 220, L = 60, R = 70, T = 22, B = 30;
  const points = history.slice().reverse().filter((c) => c.status !== "IN_PROGRESS");
  chart.replaceChildren();
  chart.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  chart.append(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  chart.append(svg("line", { class: "axis", x1: W - R, y1: T, x2: W - R, y2: H - B }));
  if (!points.length) {
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no checkpoint yet"));
    return;
  }
  const maxDur = Math.max(1, ...points.map((c) => c.end_to_end_duration));
  const maxSize = Math.max(1, ...points.map((c) => Math.max(c.state_size, c.checkpointed_size)));
  const x = (i) => points.length === 1 ? (L + W - R) / 2 : L + (i * (W - L - R)) / (points.length - 1);
  const yDur = (v) => H - B - (v / maxDur) * (H - T - B);
  const ySize = (v) => H - B - (v / maxSize) * (H - T - B);
  chart.append(svg("text", { x: L - 4, y: T + 8, "text-anchor": "end" }, ms(maxDur)));
  chart.append(svg("text", { x: L - 4, y: H - B, "text-anchor": "end" }, "0"));
  chart.append(svg("text", { x: W - R + 4, y: T + 8 }, bytes(maxSize)));
  chart.append(svg("text", { x: W - R + 4, y: H - B }, "0"));
  chart.append(svg("text", { x: L - 4, y: T - 4, "text-anchor": "end" }, "duration"));
  chart.append(svg("text", { x: W - R + 4, y: T - 4 }, "size"));
  const line = (cls, f) => svg("polyline", { class: cls, points: points.map((c, i) => x(i) + "," + f(c)).join(" ") });
  // Sizes only for completed checkpoints: a failed one has no size, not a size of zero.
  const sizeLine = (cls, f) => svg("polyline", { class: cls,
    points: points.map((c, i) => [c, i]).filter(([c]) => c.status === "COMPLETED").map(([c, i]) => x(i) + "," + f(c)).join(" ") });
  chart.append(sizeLine("line-size", (c) => ySize(c.state_size)));
  chart.append(sizeLine("line-incr", (c) => ySize(c.checkpointed_size)));
  chart.append(line("line-duration", (c) => yDur(c.end_to_end_duration)));
  points.forEach((c, i) => {
    chart.append(svg("text", { x: x(i), y: H - B + 14, "text-anchor": "middle" }, "#" + c.id));
    const failed = c.status === "FAILED";
    const dot = svg("circle", { class: failed ? "pt-duration pt-failed" : "pt-duration", cx: x(i), cy: yDur(c.end_to_end_duration), r: 4,
      "data-checkpoint-id": c.id, "data-duration": c.end_to_end_duration });
    dot.append(svg("title", {}, "#" + c.id + " " + c.status + ": " + ms(c.end_to_end_duration)));
    chart.append(dot);
    if (!failed) {
      const size = svg("circle", { class: "pt-size", cx: x(i), cy: ySize(c.state_size), r: 3,
        "data-checkpoint-id": c.id, "data-size": c.state_size });
      size.append(svg("title", {}, "#" + c.id + ": " + bytes(c.state_size)));
      chart.append(size);
    }
  });
}

function renderCheckpoints(stats) {
  for (const k of ["total", "in_progress", "completed", "failed", "restored"]) $("#count-" + k).textContent = stats.counts[k];
  renderChart(stats.history);
  const ids = stats.history.map((c) => c.id);
  if (!ids.includes(state.checkpoint)) state.checkpoint = ids.length ? ids[0] : null;
  fill($("#chk-history tbody"), stats.history.map((c) => {
    const row = el("tr", { class: "selectable" + (c.id === state.checkpoint ? " selected" : ""), "data-checkpoint-id": c.id },
      el("td", {}, c.id), el("td", { class: "status" }, status(c.status)), el("td", {}, c.checkpoint_type),
      el("td", {}, time(c.trigger_timestamp)), el("td", { class: "duration" }, ms(c.end_to_end_duration)),
      el("td", { class: "checkpointed-size" }, bytes(c.checkpointed_size)), el("td", { class: "full-size" }, bytes(c.state_size)),
      el("td", { class: "acks" }, c.num_acknowledged_subtasks + "/" + c.num_subtasks), el("td", {}, c.epoch),
      el("td", { class: "failure" }, c.status === "FAILED" ? c.failure_reason + ": " + c.failure_message : ""));
    row.addEventListener("click", () => { state.checkpoint = c.id; refresh(); });
    return row;
  }));
}

async function renderAcks(job) {
  $("#acks-checkpoint").textContent = state.checkpoint == null ? "–" : "#" + state.checkpoint;
  if (state.checkpoint == null) { fill($("#acks tbody"), []); return; }
  const base = "/jobs/" + encodeURIComponent(job) + "/checkpoints/details/" + state.checkpoint;
  const details = await api(base);
  const rows = [];
  for (const op of Object.keys(details.tasks)) {
    for (const s of details.tasks[op].subtasks) {
      const done = s.status === "completed";
      rows.push(el("tr", { "data-operator": op, "data-subtask": s.index },
        el("td", {}, op), el("td", {}, s.index), el("td", { class: "status" }, status(s.status)),
        el("td", {}, done ? time(s.ack_timestamp) : "–"), el("td", {}, done ? ms(s.end_to_end_duration) : "–"),
        el("td", { class: "sync" }, done ? ms(s.checkpoint.sync) : "–"), el("td", { class: "async" }, done ? ms(s.checkpoint.async) : "–"),
        el("td", {}, done ? bytes(s.checkpointed_size) : "–"), el("td", {}, done ? bytes(s.state_size) : "–")));
    }
  }
  fill($("#acks tbody"), rows);
}

async function refresh() {
  try {
    const [overview, tms, jobs] = await Promise.all([api("/overview"), api("/taskmanagers"), api("/jobs/overview")]);
    renderCluster(overview, tms);
    renderJobs(jobs);
    if (state.job) {
      try {
        renderCheckpoints(await api("/jobs/" + encodeURIComponent(state.job) + "/checkpoints"));
        await renderAcks(state.job);
      } catch (e) {
        if (e instanceof AuthNeeded) throw e;
        fill($("#chk-history tbody"), [el("tr", {}, el("td", { colSpan: 10, class: "muted" }, e.message))]);
      }
    }
    $("#refreshed").textContent = new Date().toISOString().substring(11, 19);
    $("#error").hidden = true;
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (e) {
    if (e instanceof AuthNeeded) $("#login").hidden = false;
    $("#error").textContent = e.message;
    $("#error").hidden = false;
  }
}

async function load() {
  try {
    const config = await api("/config");
    state.refreshMs = Math.max(500, config["refresh-interval"]);
  } catch (e) {
    if (e instanceof AuthNeeded) { $("#login").hidden = false; $("#error").textContent = e.message; $("#error").hidden = false; return; }
  }
  await refresh();
  if (!state.timer) state.timer = setInterval(refresh, state.refreshMs);
}

function init() {
  $("#job-select").addEventListener("change", (e) => { state.job = e.target.value; state.checkpoint = null; refresh(); });
  $("#login").addEventListener("submit", (e) => {
    e.preventDefault();
    state.token = $("#token").value.trim();
    sessionStorage.setItem("keyedstate-token", state.token);
    $("#login").hidden = true;
    load();
  });
  load();
}

init();
