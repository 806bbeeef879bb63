// flexorch plan viewer: polls /api/steps and draws the selected step (devices x time for SP steps, stages x time
// for pipelined ones), its baselines, the run's step times and the step table with Plotly.js; a step of several
// [[tasks]] colours its groups by task, with a legend of the tasks' losses and a panel of how they were placed; a
// device slower than view.slow_below (0.8x the others) is shaded, with its speed at the picture's right.
// Data shapes: see flexorch/dashboards/viewer_data.py (step_view, pipeline_view, task_view).
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
function byTask(view) {  // a step of several [[tasks]] whose groups' tasks are known: colour = task
  return Array.isArray(view.tasks) && view.tasks.length > 0 && view.groups.some((g) => g.task !== null);
}

function taskLegend(t) {  // a task's legend entry: its name and its loss this step
  return t.loss === null || t.loss === undefined ? t.name : `${t.name} · loss ${fmt(t.loss, 4)}`;
}

function groupTrace(gs, which, name, color, label, hoverHead) {
  return {
    type: "bar",
    orientation: "h",
    name,
    y: gs.map((g) => g.first_rank + (g.degree - 1) / 2),
    width: gs.map((g) => g.degree * 0.92),
    base: gs.map((g) => g[`${which}_start_ms`] ?? 0),
    x: gs.map((g) => Math.max(g[`${which}_ms`], 1e-3)),
    marker: { color, line: { color: "white", width: 0.5 }, pattern: recomputePattern(gs) },
    text: gs.map(label),
    textposition: "inside",
    insidetextanchor: "start",
    textangle: 0,
    customdata: gs.map((g) => [g.micro_batch, g.ranks.join(","), g.kind, g.sequences, g.tokens, g.longest,
      g[`${which}_ms`], g.degree, hoverHead(g), g.recompute ? `<br>${RECOMPUTE[g.recompute]}` : "", paceText(g)]),
    hovertemplate:  // %{x} of a bar with a base is where it ends: the length comes from customdata
      "%{customdata[8]}micro-batch %{customdata[0]}, ranks %{customdata[1]}<br>degree %{customdata[7]}" +
      " %{customdata[2]}, %{customdata[3]} sequences, %{customdata[4]} tokens (longest %{customdata[5]})" +
      "%{customdata[9]}%{customdata[10]}<br>%{base:.1f} ms + %{customdata[6]:.1f} ms<extra></extra>",
  };
}

// 'auto' recompute: each group's mode, as a pattern on its bar (plain: none) and a line of its hover
const RECOMPUTE = { none: "no recompute", selective: "selective recompute (MLPs)", full: "full recompute" };
const PATTERNS = { none: "", selective: ".", full: "/" };

function recomputePattern(gs) {
  if (!gs.some((g) => g.recompute)) return undefined;
  const shape = gs.map((g) => PATTERNS[g.recompute] ?? "");
  return { shape, fillmode: "overlay", fgcolor: "#111", fgopacity: 0.4, size: 9, solidity: 0.25 };
}

function recomputeText(v) {  // the step summary's part: how many groups ran in which mode, which packing ran
  const modes = v.groups.map((g) => g.recompute).filter((m) => m);
  if (!modes.length) return "";
  const count = (m) => modes.filter((x) => x === m).length;
  const parts = ["none", "selective", "full"].filter((m) => count(m)).map((m) => `${m} in ${count(m)}`);
  const p = v.recompute_packing;
  let packed = "";
  if (p && p.packing) {
    const label = { full: "full recompute's", none: "no recompute's", selective: "selective recompute's" };
    const others = ["full", "none", "selective"].filter((m) => m !== p.packing && isNum(p[`${m}_ms`]))
      .map((m) => `packed for ${label[m]}: ${fmt(p[`${m}_ms`], 1)} ms`);
    packed = `; packed for ${label[p.packing]} bytes (${fmt(p[`${p.packing}_ms`], 1)} ms predicted` +
      (others.length ? `; ${others.join(", ")}` : "") + ")";
  }
  return ` · recompute: ${parts.join(", ")} of ${modes.length} groups${packed} (bars: hatched = full recompute, ` +
    "dotted = selective, plain = none)";
}

function groupLabel(g) {
  return g.degree > 1 ? `${g.degree} ${g.kind} · ${g.sequences} seq` : `${g.sequences} seq`;
}

function planTraces(view, which) {
  const shown = view.groups.filter((g) => g[`${which}_ms`] !== null);
  if (byTask(view)) {  // one trace per task, in task order (the legend: task names and losses); then any unknown
    const traces = view.tasks.map((t) => {
      const gs = shown.filter((g) => g.task === t.index);
      const head = `${t.name}${t.loss === null ? "" : ` (loss ${fmt(t.loss, 4)})`}<br>`;
      return gs.length ? groupTrace(gs, which, taskLegend(t), t.colour, (g) => `${t.name} · ${groupLabel(g)}`,
        () => head) : null;
    }).filter((tr) => tr !== null);
    const unknown = shown.filter((g) => g.task === null);
    if (unknown.length) traces.push(groupTrace(unknown, which, "several tasks", "#777", groupLabel, () => ""));
    return traces;
  }
  const byDegree = new Map();
  for (const g of shown) {
    if (!byDegree.has(g.degree)) byDegree.set(g.degree, []);
    byDegree.get(g.degree).push(g);
  }
  return [...byDegree.keys()].sort((a, b) => b - a).map((d) =>
    groupTrace(byDegree.get(d), which, `degree ${d}`, colour(d), groupLabel, () => ""));
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

function nodeLines(view) {  // a boundary between consecutive ranks on different nodes, named by the node below it
  const nodes = view.nodes;
  if (!Array.isArray(nodes)) return { shapes: [], annotations: [] };
  const shapes = [], annotations = [];
  for (let r = 0; r < nodes.length; r++) {
    if (r > 0 && nodes[r] !== nodes[r - 1]) {
      shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: r - 0.5, y1: r - 0.5,
        line: { color: "#c0392b", width: 1.5 } });
    }
    if (r === 0 || nodes[r] !== nodes[r - 1]) {
      annotations.push({ xref: "paper", x: 1, xanchor: "right", y: r - 0.5, yanchor: "top", showarrow: false,
        text: `node ${nodes[r] ?? "?"}`, font: { size: 10, color: "#c0392b" } });
    }
  }
  return { shapes, annotations };
}

// ---------------------------------------------------------------- slow devices: worker speeds below slow_below
function paceText(g) {  // a group on a device off 1.0 runs at its slowest member's speed
  return isNum(g.speed) && g.speed !== 1 ? `<br>at ${fmt(g.speed, 2)}x (its slowest member's speed)` : "";
}

function slowRuns(view) {  // consecutive slow ranks at one speed (a slow node) make one band and one label
  const runs = [];
  for (const r of view.slow_ranks || []) {
    const speed = view.speeds[r], last = runs[runs.length - 1];
    if (last && last.first + last.count === r && last.speed === speed) last.count += 1;
    else runs.push({ first: r, count: 1, speed });
  }
  return runs;
}

function slowText(run, below) {
  const who = run.count === 1 ? `rank ${run.first}` : `ranks ${run.first}-${run.first + run.count - 1}`;
  return `${who}: ${fmt(run.speed, 2)}x the others (slow: below ${below}x)`;
}

function slowMarks(view) {  // each slow run's rows tinted behind the bars, its speed at the picture's right
  const shapes = [], annotations = [];
  for (const run of slowRuns(view)) {
    shapes.push({ type: "rect", xref: "paper", x0: 0, x1: 1, y0: run.first - 0.5, y1: run.first + run.count - 0.5,
      fillcolor: "rgba(229, 57, 53, 0.18)", line: { width: 0 }, layer: "below" });
    annotations.push({ xref: "paper", x: 1, xanchor: "left", y: run.first + (run.count - 1) / 2, yanchor: "middle",
      showarrow: false, text: `${fmt(run.speed, 2)}x`, hovertext: slowText(run, view.slow_below),
      font: { size: 10, color: "#b2182b" } });
  }
  return { shapes, annotations };
}

function slowSummary(v) {  // the step summary's part: which devices are slow
  const runs = slowRuns(v);
  if (!runs.length) return "";
  return ` · slow devices (shaded): ${runs.map((run) => slowText(run, v.slow_below).split(" (")[0]).join(", ")}`;
}

function drawPlan(div, view, which, title) {
  if (!div._fullLayout) div.textContent = "";  // a skipped step left a note there
  const slow = slowMarks(view);
  const layout = {
    title: { text: title, font: { size: 14 } },
    barmode: "overlay",
    bargap: 0,
    uniformtext: { mode: "hide", minsize: 9 },  // a label that does not fit its bar is left to the hover
    margin: { l: 60, r: slow.shapes.length ? 46 : 10, t: 40, b: 40 },
    xaxis: { title: { text: "time (ms)" }, rangemode: "tozero" },
    yaxis: { title: { text: "device (rank)" }, autorange: "reversed", range: [view.world_size - 0.5, -0.5],
             dtick: view.world_size <= 16 ? 1 : undefined, zeroline: false },
    shapes: [...slow.shapes, ...microBatchLines(view, which), ...nodeLines(view).shapes],
    annotations: [...nodeLines(view).annotations, ...slow.annotations],
    legend: { orientation: "h", y: -0.18 },
    showlegend: true,
  };
  const tasks = byTask(view);
  if (tasks) layout.legend = { orientation: "h", y: -0.22, title: { text: "task:", side: "left" } };
  return Plotly.react(div, planTraces(view, which), layout, { displayModeBar: false, responsive: true }).then(() => {
    div.dataset.step = String(view.step);
    div.dataset.layout = "sp";
    div.dataset.colour = tasks ? "task" : "degree";
    div.dataset.ops = "0";
    div.dataset.nodes = String(nodeLines(view).annotations.length);
    div.dataset.slow = (view.slow_ranks || []).join(",");
    div.dataset.groups = String(view.groups.filter((g) => g[`${which}_ms`] !== null).length);
    div.dataset.recompute = view.groups.filter((g) => g[`${which}_ms`] !== null && g.recompute)
      .map((g) => g.recompute).join(",");
  });
}

// ---------------------------------------------------------------- stages x time, one bar per pipeline op
const HUES = [210, 30, 0, 175, 120, 50, 290, 340, 20, 260, 90, 190];  // as flexorch/dashboards/pipeline_svg.py

function opColour(i, kind) {
  return `hsl(${HUES[i % HUES.length]}, 55%, ${kind === "B" ? 38 : 72}%)`;
}

function rankSpan(ranks) {
  if (!ranks.length) return "none";
  const lo = Math.min(...ranks), hi = Math.max(...ranks);
  return ranks.length === 1 ? `rank ${lo}` : hi - lo + 1 === ranks.length ? `ranks ${lo}-${hi}` : `ranks ${ranks.join(",")}`;
}

function stageLabel(pipe, r) {
  return `stage ${r} (${rankSpan(pipe.stage_ranks[r])})`;
}

function pipelineTraces(view, which) {
  const pipe = view.pipeline;
  // chains are numbered inside each back-to-back pipeline: one colour per (pipeline, chain), in unit order
  const hue = new Map();
  for (const o of [...pipe.ops].sort((a, b) => a.unit - b.unit)) {
    const key = `${o.pipeline}:${o.chain}`;
    if (!hue.has(key)) hue.set(key, hue.size);
  }
  return [["F", "forward (light)"], ["B", "backward (dark); colour = sequence chain"]].map(([kind, name]) => {
    const ops = pipe.ops.filter((o) => o.kind === kind && o[`${which}_ms`] !== null);
    return {
      type: "bar",
      orientation: "h",
      name,
      y: ops.map((o) => o.stage),
      width: ops.map(() => 0.84),
      base: ops.map((o) => o[`${which}_start_ms`] ?? 0),
      x: ops.map((o) => Math.max(o[`${which}_ms`], 1e-3)),
      marker: { color: ops.map((o) => opColour(hue.get(`${o.pipeline}:${o.chain}`), kind)),
                line: { color: "white", width: 0.5 } },
      text: ops.map((o) => `${o.unit}`),
      textposition: "inside",
      insidetextanchor: "middle",
      textangle: 0,
      customdata: ops.map((o) => [stageLabel(pipe, o.stage), o.unit, kind === "F" ? "forward" : "backward", o.tokens,
        o.pieces, o.sequences, o.checkpointed ?? "?", o.chain, o.pipeline, o[`${which}_ms`]]),
      hovertemplate:
        "%{customdata[0]}: unit %{customdata[1]} %{customdata[2]}<br>%{customdata[3]} tokens in %{customdata[4]} " +
        "piece(s) of %{customdata[5]} sequence(s), chain %{customdata[7]}, pipeline %{customdata[8]}<br>" +
        "%{customdata[6]} layer(s) checkpointed<br>%{base:.1f} ms + %{customdata[9]:.1f} ms<extra></extra>",
    };
  });
}

function pipelineBoundaries(view, which) {  // the end of each back-to-back pipeline but the last
  const ends = new Map();
  for (const o of view.pipeline.ops) {
    if (o[`${which}_ms`] === null) continue;
    const end = (o[`${which}_start_ms`] ?? 0) + o[`${which}_ms`];
    ends.set(o.pipeline, Math.max(ends.get(o.pipeline) ?? 0, end));
  }
  const last = Math.max(...ends.keys());
  return [...ends.entries()].filter(([p]) => p !== last).map(([, x]) => ({
    type: "line", x0: x, x1: x, yref: "paper", y0: 0, y1: 1, line: { dash: "dash", color: "#000", width: 1 },
  }));
}

function drawPipeline(div, view, which, title) {
  if (!div._fullLayout) div.textContent = "";  // a skipped step left a note there
  const pipe = view.pipeline;
  const stages = [...Array(pipe.stages).keys()];
  const layout = {
    title: { text: title, font: { size: 14 } },
    barmode: "overlay",
    bargap: 0,
    uniformtext: { mode: "hide", minsize: 8 },  // a unit number that does not fit its bar is left to the hover
    margin: { l: 150, r: 10, t: 40, b: 76 },
    xaxis: { title: { text: "time (ms)", standoff: 4 }, rangemode: "tozero" },
    yaxis: { autorange: "reversed", range: [pipe.stages - 0.5, -0.5], tickvals: stages,
             ticktext: stages.map((r) => stageLabel(pipe, r)), zeroline: false },
    shapes: pipelineBoundaries(view, which),
    legend: { orientation: "h", x: 0, y: -0.3 },
    showlegend: true,
  };
  return Plotly.react(div, pipelineTraces(view, which), layout, { displayModeBar: false, responsive: true }).then(() => {
    div.dataset.step = String(view.step);
    div.dataset.layout = "pipeline";
    div.dataset.slow = "";
    div.dataset.colour = "chain";
    div.dataset.groups = "0";
    div.dataset.ops = String(pipe.ops.filter((o) => o[`${which}_ms`] !== null).length);
  });
}

function pipelineNote(view) {
  const p = view.pipeline;
  const used = p.stage_ranks.flat();
  const idle = view.world_size - used.length;
  const b2b = p.pipelines > 1
    ? ` in ${p.pipelines} back-to-back pipelines (memory: each drains before the next starts, black dashed lines)`
    : " in one pipeline";
  const ckpt = p.ops.filter((o) => o.kind === "B" && o.checkpointed > 0).length;
  const baseline = (view.status || "").startsWith("pipeline-")  // the trainer ran a baseline's schedule instead
    ? ` Schedule: ${view.status.slice("pipeline-".length)} (simulated faster than the elastic plan, so it ran).`
    : "";
  return `Pipelined step: ${p.stages} stages x ${p.degree} device(s) per stage (Ulysses SP inside a stage; ` +
    `layers per stage ${p.layers.join(", ")})` + (idle > 0 ? `, ${idle} rank(s) sit this step out` : "") +
    `. ${p.units} units (granularity ${p.granularity})${b2b}; simulated bubble ${fmt(p.bubble_share * 100, 1)} %; ` +
    `${ckpt} of ${p.units * p.stages} backward(s) recompute checkpointed layers. One bar per forward (light) and ` +
    "backward (dark) of a unit on a stage, labelled with the unit; one colour per sequence chain (the segments of " +
    "a split sequence share it)." + baseline;
}

// ---------------------------------------------------------------- several [[tasks]]: placement, losses, legend
const METHODS = {
  spindle: "Spindle (each task on its own block of workers, in waves)",
  in_turn: "in turn (each task on every worker, one after another)",
};

function hasTasks(v) {
  return Array.isArray(v.tasks) && v.tasks.length > 0;
}

function msText(v) {
  return `${fmt(v, 1)} ms`;
}

function multitaskText(mt) {  // how the plan placed the tasks: the method, Spindle's bound and gap, the plan's times
  if (!mt) return "";
  const out = [`placed ${METHODS[mt.method] ?? (mt.method || "?")}`];
  const spindle = [];
  if (isNum(mt.bound_ms)) spindle.push(`bound ${msText(mt.bound_ms)}`);
  if (isNum(mt.makespan_ms)) spindle.push(`makespan ${msText(mt.makespan_ms)}`);
  if (isNum(mt.gap)) spindle.push(`gap ${fmt(mt.gap * 100, 1)} %`);
  if (spindle.length) out.push(`Spindle's cost model: ${spindle.join(", ")}`);
  const plan = [];
  if (isNum(mt.simulated_ms)) plan.push(`simulated ${msText(mt.simulated_ms)}`);
  if (isNum(mt.dataflow_ms)) plan.push(`dataflow ${msText(mt.dataflow_ms)}`);
  if (plan.length) out.push(`the plan: ${plan.join(", ")}`);
  if (isNum(mt.solve_s)) out.push(`solve ${fmt(mt.solve_s * 1000, 0)} ms`);
  return out.join(" · ");
}

function taskLine(t) {  // one task in the step table: loss, documents, loss targets
  const loss = t.loss === null ? "" : ` ${fmt(t.loss, 4)}`;
  return `${t.name}${loss} · ${fmt(t.docs)} docs · ${fmt(t.targets)} targets`;
}

function taskCell(v) {
  if (!hasTasks(v)) return "";
  const mt = v.multitask;
  const head = mt ? [[mt.method, isNum(mt.gap) ? `gap ${fmt(mt.gap * 100, 1)} %` : ""].filter((s) => s).join(", ")] : [];
  return head.concat(v.tasks.map(taskLine)).join("\n");
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = String(text ?? "");
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function drawTasks(v) {  // the per-step panel: how the tasks were placed, and each task's numbers (its legend)
  const show = !v.skipped && hasTasks(v);
  $("tasks-note").style.display = show ? "block" : "none";
  const body = $("task-table").querySelector("tbody");
  body.innerHTML = "";
  if (!show) return;
  const n = v.tasks.length;
  $("task-placement").textContent = `${n} task${n > 1 ? "s" : ""}` +
    (v.multitask ? `, ${multitaskText(v.multitask)}` : "") + ". Colour = task (legend under the pictures).";
  $("task-problem").textContent = v.task_note ? `Note: ${v.task_note}.` : "";
  $("task-problem").style.display = v.task_note ? "block" : "none";
  const parts = (v.multitask && v.multitask.parts) || [];
  for (const t of v.tasks) {
    const tr = document.createElement("tr");
    tr.dataset.task = String(t.index);
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = t.colour;
    const name = cell(tr, t.name, "name");
    name.prepend(sw);
    const mine = parts.filter((p) => p.task === t.index);
    const ranks = mine.length
      ? mine.map((p) => rankSpan([...Array(p.devices).keys()].map((k) => p.first_rank + k))).join("; ")
      : rankSpan(t.ranks);
    cell(tr, ranks, "name");
    cell(tr, mine.map((p) => `${fmt(p.start_ms, 1)} + ${fmt(p.time_ms, 1)}`).join("; "));
    cell(tr, fmt(t.docs));
    cell(tr, fmt(t.tokens));
    cell(tr, fmt(t.targets));
    cell(tr, t.loss === null ? "" : fmt(t.loss, 4));
    cell(tr, t.groups);
    body.appendChild(tr);
  }
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
    margin: { l: 60, r: 10, t: 10, b: 40 },
    xaxis: { title: { text: "step" }, tickformat: "d",
             dtick: x.length && Math.max(...x) - Math.min(...x) <= 20 ? 1 : undefined },  // no repeated ticks
    yaxis: { title: { text: "ms" }, rangemode: "tozero" }, shapes, legend: { orientation: "h", y: 1.12 },
  }, { displayModeBar: false });
}

// ---------------------------------------------------------------- recoveries: what happened, and its phases
function pyFixed(x, digits) {  // Python's f"{x:.1f}" / f"{x:.0f}": an exact tie goes to the even digit (toFixed: up)
  const q = digits === 0 ? 2 : 4;  // a tie is x = odd / 2 (0 digits) or odd / 4 (1 digit), exact in binary
  if (Number.isInteger(x * q) && (x * q) % 2 !== 0) {
    const lo = Math.floor(x * 10 ** digits);
    return ((lo % 2 === 0 ? lo : lo + 1) / 10 ** digits).toFixed(digits);
  }
  return x.toFixed(digits);
}

function secs(ms) {  // as the CLI's progress line: seconds with one decimal
  return `${pyFixed(ms / 1e3, 1)} s`;
}

function isNum(v) {
  return typeof v === "number" && !Number.isNaN(v);
}

function drainNode(d) {  // "node 10.0.0.7 draining (preemption, 45 s)", as the CLI's line
  const left = isNum(d.deadline_left_s) ? `${pyFixed(Math.max(d.deadline_left_s, 0), 0)} s` : "no deadline";
  return `node ${d.node_ip || String(d.node || "?").slice(0, 12)} draining (${d.reason || "unknown"}, ${left})`;
}

function recoveryWorkers(r) {
  if (r.what === "grow") return r.joined && r.joined.length ? `workers ${r.joined.join(", ")} joined` : "";
  if (r.what === "drain") {  // a planned leave of a draining node's workers, or their stay (fallback)
    const who = `${drainNode(r)}: workers ${(r.workers || []).join(", ")}`;
    return r.fallback ? `${who} stayed` : `${who} left after step ${r.after_step}`;
  }
  return r.lost && r.lost.length ? `lost worker${r.lost.length > 1 ? "s" : ""} ${r.lost.join(", ")}` : "";
}

function recoveryWorld(r) {
  return r.world_before && r.world_after ? `world ${r.world_before.length} -> ${r.world_after.length}` : "";
}

function recoveryActions(r) {  // what was done about it: [decisions or the roll-back, whether the step ran again]
  if (r.what === "drain") return [r.fallback || "planned leave", r.fallback ? "" : "nothing re-run"];
  if (r.rollback) return [`back to the checkpoint of step ${r.to_step ?? "?"} (from step ${r.from_step ?? "?"})`, ""];
  const redo = r.step_completed === true ? "the step's update had finished, kept"
    : r.step_completed === false ? "re-ran the step" : "";
  return [(r.decisions || []).join("/"), redo];
}

// the time it cost, in the CLI's words: "recovered in 12.0 s: detect 10.1 s, re-form 0.4 s, re-run 1.5 s" for a
// failure during the step (detect counts 0 where the record has none, as on the CLI line: the phases add up to the
// total), then how the failure was seen; a grow's admission in ms; a roll-back's or an earlier failure's re-form
function recoveryTime(r) {
  if (r.what === "grow") return isNum(r.recovery_ms) ? `admitted in ${pyFixed(r.recovery_ms, 0)} ms` : "";
  if (r.what === "drain") {
    if (r.fallback || !isNum(r.recovery_ms)) return "";
    return `left in ${secs(r.recovery_ms)}: handoff ${secs(r.handoff_ms)}, re-form ${secs(r.reform_ms)}`;
  }
  const phases = [];
  if (isNum(r.total_ms)) phases.push(`detect ${secs(isNum(r.detect_ms) ? r.detect_ms : 0)}`);
  else if (isNum(r.detect_ms)) phases.push(`detect ${secs(r.detect_ms)}`);
  // a lost driver replaced by a new one (driver_restart): its re-form is the new driver's start, as on the CLI line
  if (isNum(r.recovery_ms)) phases.push(`${r.driver_restart ? "new driver" : "re-form"} ${secs(r.recovery_ms)}`);
  if (isNum(r.rerun_ms)) phases.push(`re-run ${secs(r.rerun_ms)}`);
  let text = isNum(r.total_ms) ? `recovered in ${secs(r.total_ms)}: ${phases.join(", ")}` : phases.join(", ");
  if (r.driver_restart && isNum(r.redone_steps)) text += ` (${r.redone_steps} steps trained again)`;
  if (isNum(r.detect_ms) && (r.detected_by === "heartbeat" || r.detected_by === "ray")) {
    text += ` (detected by ${r.detected_by === "heartbeat" ? "heartbeat" : "Ray"})`;
  }
  return text;
}

function recoveryText(r) {  // one line of the step table's recoveries cell
  const head = r.what === "grow" ? "grow" : r.rollback ? `${r.what || "roll-back"}: roll-back` : r.what || "change";
  const [done, redo] = recoveryActions(r);
  const rest = [recoveryWorkers(r), done, recoveryWorld(r), redo].filter((s) => s).join(", ");
  const time = recoveryTime(r);
  return `${head}${rest ? `: ${rest}` : ""}${time ? `; ${time}` : ""}`;
}

function recoveriesOf(v) {
  return (v.recoveries || []).filter((r) => r && typeof r === "object");
}

function addRecoveries(views) {  // the run's recoveries, one row each; the section shows once there is one
  const body = $("recovery-table").querySelector("tbody");
  for (const v of views) {
    for (const r of recoveriesOf(v)) {
      const tr = document.createElement("tr");
      const what = r.rollback ? `${r.what || ""} (roll-back)`.trim() : r.what || "change";
      const action = [recoveryActions(r).filter((s) => s).join(", "), r.reason].filter((s) => s).join("; ");
      [v.step, what, recoveryWorkers(r), recoveryWorld(r), action, recoveryTime(r)].forEach((c) => {
        const td = document.createElement("td");
        td.textContent = String(c ?? "");
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }
  $("recoveries").style.display = body.rows.length ? "block" : "none";
}

// ---------------------------------------------------------------- step table and selection
function addRows(views, offset) {
  const body = $("step-table").querySelector("tbody");
  views.forEach((v, i) => {
    const tr = document.createElement("tr");
    tr.dataset.index = String(offset + i);
    if (v.skipped) tr.classList.add("skipped");
    const recov = recoveriesOf(v).map(recoveryText).join("\n");
    if (v.fallback) tr.classList.add("fallback");
    const status = v.fallback && !v.skipped ? `${v.status} (${v.fallback.reason})` : v.status;
    const cells = [v.step, v.source, v.world_size, v.shape ?? "(skipped)", status, v.sequences, fmt(v.longest),
      fmt(v.solve_s * 1000), fmt(v.predicted_ms, 1), fmt(v.measured_ms, 1), fmt(v.loss, 4), fmt(v.tokens_per_s),
      recov, taskCell(v)];
    cells.forEach((c, j) => {
      const td = document.createElement("td");
      td.textContent = String(c ?? "");
      if (j === 3) td.className = "shape";
      if (j === 4) td.className = "status";
      if (j === 12) {
        td.className = "recoveries";
        td.title = recoveriesOf(v).map((r) => r.reason).filter((s) => s).join("\n");
      }
      if (j === 13) td.className = "tasks";  // shown once a step of the run has tasks
      tr.appendChild(td);
    });
    if (hasTasks(v)) $("step-table").classList.add("has-tasks");
    tr.addEventListener("click", () => { state.follow = false; $("follow").checked = false; select(offset + i); });
    body.appendChild(tr);
  });
  addRecoveries(views);
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
  const piped = !v.skipped && v.pipeline !== null && v.pipeline !== undefined;
  $("step-summary").textContent = v.skipped
    ? `step ${v.step}: skipped (${v.reason})`
    : `step ${v.step}: ${v.world_size} devices, ${v.sequences} sequences (longest ${fmt(v.longest)}), ` +
      (piped ? `${v.pipeline.units} pipeline unit(s)` : `${v.micro_batches} micro-batch(es)`) + `, shape ${v.shape}` +
      (v.fallback ? ` · not the planner's plan (${v.fallback.reason}): ${v.fallback.message}` : "") +
      (v.solver_crashes ? ` · ${v.solver_crashes} MILP solve(s) crashed` : "") +
      (hasTasks(v) ? ` · ${v.tasks.length} tasks` + (v.multitask ? ` (${v.multitask.method})` : "") : "") +
      recomputeText(v) + slowSummary(v);
  $("pipeline-note").style.display = piped ? "block" : "none";
  $("pipeline-note").textContent = piped ? pipelineNote(v) : "";
  drawTasks(v);
  const trained = v.source === "train";
  if (v.skipped) {
    Plotly.purge($("plan-predicted"));
    $("plan-predicted").textContent = `step ${v.step} was skipped: ${v.reason}`;
  } else if (piped) {
    drawPipeline($("plan-predicted"), v, "predicted", `step ${v.step}: predicted (pipeline simulator), ` +
      `${fmt(v.predicted_ms, 1)} ms · bubble ${fmt(v.pipeline.bubble_share * 100, 1)} %`);
  } else {
    drawPlan($("plan-predicted"), v, "predicted", `step ${v.step}: predicted (cost model), ${fmt(v.predicted_ms, 1)} ms`);
  }
  $("measured-card").style.display = trained && !v.skipped ? "block" : "none";
  if (trained && !v.skipped) {
    const mb = piped ? v.pipeline.measured_bubble_share : null;
    const bubble = mb === null || mb === undefined ? "" : ` · bubble ${fmt(mb * 100, 1)} %`;
    (piped ? drawPipeline : drawPlan)($("plan-measured"), v, "measured",
      `step ${v.step}: measured, ${fmt(v.measured_ms, 1)} ms${bubble}`);
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
        $("recovery-table").querySelector("tbody").innerHTML = "";
        $("step-table").classList.remove("has-tasks");
        $("recoveries").style.display = "none";
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
