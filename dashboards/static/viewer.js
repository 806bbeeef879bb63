// flexorch plan viewer: polls /api/steps and draws the selected step (devices x time), its baselines, the run's
// step times and the step table with Plotly.js. Data shapes: see dashboards/viewer_data.py (step_view).
"use strict";

const COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
                 "#9c755f", "#bab0ac", "#86bcb6"];
const state = { records: [], selected: -1, follow: true, pollS: 2 };
const $ = (id) => document.getElementById(id);

function colour(degree) {
  const i = Math.round(Math.log2(Math.max(1, degree)));
  return COLOURS[Math.min(i, COLOURS.length - 1)];
}

function fmt(v, digits = 0) {
  if (v === null || v === undefined || Number.isNaN(v)) return "";
  return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function showError(msg) {
  const el = $("error");
  el.style.display = msg ? "block" : "none";
  el.textContent = msg ? `Cannot show every step: ${msg}` : "";
}

// ---------------------------------------------------------------- devices x time, one bar per SP group
function planTraces(view, which) {
  const byDegree = new Map();
  for (const g of view.groups) {
    if (g[`${which}_ms`] === null) continue;
    if (!byDegree.has(g.degree)) byDegree.set(g.degree, []);
    byDegree.get(g.degree).push(g);
  }
  return [...byDegree.keys()].sort((a, b) => b - a).map((d) => {
    const gs = byDegree.get(d);
    return {
      type: "bar",
      orientation: "h",
      name: `degree ${d}`,
      y: gs.map((g) => g.first_rank + (g.degree - 1) / 2),
      width: gs.map((g) => g.degree * 0.92),
      base: gs.map((g) => g[`${which}_start_ms`] ?? 0),
      x: gs.map((g) => Math.max(g[`${which}_ms`], 1e-3)),
      marker: { color: colour(d), line: { color: "white", width: 0.5 } },
      text: gs.map((g) => (g.degree > 1 ? `${g.degree} ${g.kind} · ${g.sequences} seq` : `${g.sequences} seq`)),
      textposition: "inside",
      insidetextanchor: "start",
      textangle: 0,
      customdata: gs.map((g) => [g.micro_batch, g.ranks.join(","), g.kind, g.sequences, g.tokens, g.longest]),
      hovertemplate:
        "micro-batch %{customdata[0]}, ranks %{customdata[1]}<br>degree " + d +
        " %{customdata[2]}, %{customdata[3]} sequences, %{customdata[4]} tokens (longest %{customdata[5]})" +
        "<br>%{base:.1f} ms + %{x:.1f} ms<extra></extra>",
    };
  });
}

function microBatchLines(view, which) {
  const ends = new Map();
  for (const g of view.groups) {
    if (g[`${which}_ms`] === null) continue;
    const end = (g[`${which}_start_ms`] ?? 0) + g[`${which}_ms`];
    ends.set(g.micro_batch, Math.max(ends.get(g.micro_batch) ?? 0, end));
  }
  return [...ends.values()].map((x) => ({
    type: "line", x0: x, x1: x, yref: "paper", y0: 0, y1: 1, line: { dash: "dash", color: "#555", width: 1 },
  }));
}

function drawPlan(div, view, which, title) {
  if (!div._fullLayout) div.textContent = "";  // a skipped step left a note there
  const layout = {
    title: { text: title, font: { size: 14 } },
    barmode: "overlay",
    bargap: 0,
    uniformtext: { mode: "hide", minsize: 9 },  // a label that does not fit its bar is left to the hover
    margin: { l: 60, r: 10, t: 40, b: 40 },
    xaxis: { title: { text: "time (ms)" }, rangemode: "tozero" },
    yaxis: { title: { text: "device (rank)" }, autorange: "reversed", range: [view.world_size - 0.5, -0.5],
             dtick: view.world_size <= 16 ? 1 : undefined, zeroline: false },
    shapes: microBatchLines(view, which),
    legend: { orientation: "h", y: -0.18 },
    showlegend: true,
  };
  return Plotly.react(div, planTraces(view, which), layout, { displayModeBar: false, responsive: true }).then(() => {
    div.dataset.step = String(view.step);
    div.dataset.groups = String(view.groups.filter((g) => g[`${which}_ms`] !== null).length);
  });
}

function drawBaselines(view) {
  const rows = [];
  if (view.measured_ms !== null) rows.push(["measured", view.measured_ms, "#2e7d32"]);
  rows.push(["flexorch plan (predicted)", view.predicted_ms, "#1565c0"]);
  if (view.bound_ms > 0) rows.push(["lower bound", view.bound_ms, "#90a4ae"]);
  const base = Object.entries(view.baselines_ms || {}).filter(([, v]) => v !== null).sort((a, b) => a[1] - b[1]);
  for (const [name, v] of base) rows.push([name, v, "#bdbdbd"]);
  const missing = Object.entries(view.baselines_ms || {}).filter(([, v]) => v === null).map(([k]) => k);
  $("baselines-note").textContent = missing.length ? `cannot hold the batch: ${missing.join(", ")}` : "";
  const layout = {
    title: { text: `step ${view.step}: step time (ms), solve ${fmt(view.solve_s * 1000, 0)} ms`, font: { size: 14 } },
    margin: { l: 170, r: 10, t: 40, b: 36 },
    yaxis: { autorange: "reversed" },
  };
  return Plotly.react($("baselines-chart"), [{
    type: "bar", orientation: "h", y: rows.map((r) => r[0]), x: rows.map((r) => r[1]),
    marker: { color: rows.map((r) => r[2]) }, hovertemplate: "%{y}: %{x:.1f} ms<extra></extra>",
  }], layout, { displayModeBar: false });
}

function drawRun() {
  const recs = state.records.filter((r) => !r.skipped);
  const x = recs.map((r) => r.step);
  const traces = [
    { name: "predicted", x, y: recs.map((r) => r.predicted_ms), mode: "lines+markers", line: { color: "#1565c0" } },
  ];
  if (recs.some((r) => r.measured_ms !== null)) {
    traces.push({ name: "measured", x, y: recs.map((r) => r.measured_ms), mode: "lines+markers",
                  line: { color: "#2e7d32" } });
    traces.push({ name: "compute (slowest rank)", x, y: recs.map((r) => r.compute_ms), mode: "lines",
                  line: { color: "#66bb6a", dash: "dot" } });
  }
  const bestStatic = recs.map((r) => {
    const v = Object.entries(r.baselines_ms || {}).filter(([k, b]) => k.startsWith("static-") && b !== null);
    return v.length ? Math.min(...v.map(([, b]) => b)) : null;
  });
  if (bestStatic.some((v) => v !== null)) {
    traces.push({ name: "best static layout (predicted)", x, y: bestStatic, mode: "lines",
                  line: { color: "#9e9e9e", dash: "dash" } });
  }
  const shapes = state.selected >= 0 ? [{ type: "line", x0: state.records[state.selected].step,
    x1: state.records[state.selected].step, yref: "paper", y0: 0, y1: 1, line: { color: "#e65100", width: 1 } }] : [];
  Plotly.react($("run-chart"), traces, {
    margin: { l: 60, r: 10, t: 10, b: 40 }, xaxis: { title: { text: "step" }, tickformat: "d" },
    yaxis: { title: { text: "ms" }, rangemode: "tozero" }, shapes, legend: { orientation: "h", y: 1.12 },
  }, { displayModeBar: false });
}

// ---------------------------------------------------------------- step table and selection
function addRows(views, offset) {
  const body = $("step-table").querySelector("tbody");
  views.forEach((v, i) => {
    const tr = document.createElement("tr");
    tr.dataset.index = String(offset + i);
    if (v.skipped) tr.classList.add("skipped");
    const recov = (v.recoveries || []).map((r) => r.what || "change").join(", ");
    const cells = [v.step, v.source, v.world_size, v.shape ?? "(skipped)", v.status, v.sequences, fmt(v.longest),
      fmt(v.solve_s * 1000), fmt(v.predicted_ms, 1), fmt(v.measured_ms, 1), fmt(v.loss, 4), fmt(v.tokens_per_s),
      recov];
    cells.forEach((c, j) => {
      const td = document.createElement("td");
      td.textContent = String(c ?? "");
      if (j === 3) td.className = "shape";
      if (j === 4) td.className = "status";
      tr.appendChild(td);
    });
    tr.addEventListener("click", () => { state.follow = false; $("follow").checked = false; select(offset + i); });
    body.appendChild(tr);
  });
}

function select(i) {
  if (!state.records.length) return;
  i = Math.max(0, Math.min(i, state.records.length - 1));
  state.selected = i;
  const v = state.records[i];
  $("step-slider").value = String(i);
  document.querySelectorAll("#step-table tbody tr.selected").forEach((tr) => tr.classList.remove("selected"));
  const row = document.querySelector(`#step-table tbody tr[data-index="${i}"]`);
  if (row) row.classList.add("selected");
  $("step-summary").textContent = v.skipped
    ? `step ${v.step}: skipped (${v.reason})`
    : `step ${v.step}: ${v.world_size} devices, ${v.sequences} sequences (longest ${fmt(v.longest)}), ` +
      `${v.micro_batches} micro-batch(es), shape ${v.shape}`;
  const trained = v.source === "train";
  if (v.skipped) {
    Plotly.purge($("plan-predicted"));
    $("plan-predicted").textContent = `step ${v.step} was skipped: ${v.reason}`;
  } else {
    drawPlan($("plan-predicted"), v, "predicted", `step ${v.step}: predicted (cost model), ${fmt(v.predicted_ms, 1)} ms`);
  }
  $("measured-card").style.display = trained && !v.skipped ? "block" : "none";
  if (trained && !v.skipped) {
    drawPlan($("plan-measured"), v, "measured", `step ${v.step}: measured, ${fmt(v.measured_ms, 1)} ms`);
  }
  if (!v.skipped) drawBaselines(v);
  drawRun();
}

function onNew(views, offset) {
  addRows(views, offset);
  $("step-slider").max = String(state.records.length - 1);
  if (state.follow || state.selected < 0) select(state.records.length - 1);
  else drawRun();
}

async function poll() {
  let wait = state.pollS;
  try {
    const resp = await fetch(`/api/steps?since=${state.records.length}`, { cache: "no-store" });
    const data = await resp.json();
    if (!resp.ok) {
      showError(data.error || `HTTP ${resp.status}`);
    } else {
      state.pollS = data.poll_s || state.pollS;
      wait = state.pollS;
      $("run-name").textContent = data.run;
      if (data.total < state.records.length) {  // the file was rewritten (a resumed run drops later records)
        state.records = [];
        state.selected = -1;
        $("step-table").querySelector("tbody").innerHTML = "";
        wait = 0;
      } else if (data.records.length) {
        const offset = state.records.length;
        state.records.push(...data.records);
        onNew(data.records, offset);
      }
      $("waiting").style.display = data.waiting ? "block" : "none";
      showError(data.error);
      $("live").textContent = `${state.records.length} step(s); live, refreshed ${new Date().toLocaleTimeString()}`;
    }
  } catch (e) {
    $("live").textContent = `the viewer server is not answering (${e.message}); retrying`;
  }
  setTimeout(poll, wait * 1000);
}

$("prev").addEventListener("click", () => { state.follow = false; $("follow").checked = false; select(state.selected - 1); });
$("next").addEventListener("click", () => { select(state.selected + 1); });
$("step-slider").addEventListener("input", (e) => { state.follow = false; $("follow").checked = false; select(Number(e.target.value)); });
$("follow").addEventListener("change", (e) => { state.follow = e.target.checked; if (state.follow) select(state.records.length - 1); });
document.addEventListener("keydown", (e) => {
  if (e.key === "ArrowLeft") $("prev").click();
  if (e.key === "ArrowRight") $("next").click();
});
poll();
