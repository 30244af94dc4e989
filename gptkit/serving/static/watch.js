// gptkit watch: asks /api/run every second for what the run appended since the last ask, and draws the run with
// SVG and a canvas: the losses, the ICL and induction scores, each evaluation's heads and ablation, a mixture of
// experts' load per layer, Olsson's map of the loss at each position, and the samples. Layers and heads are
// numbered from 0. No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;  // how soon a new evaluation shows
const PLAY_MS = 700;  // the player's time on each evaluation
const SVG = "http://www.w3.org/2000/svg";
const FILES = ["metrics", "insight", "samples"];
const EVALUATION_KEYS = ["val_loss", "train_eval_loss", "icl_score", "evaluation"];  // a record that is an evaluation
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];  // Olsson's map colours
const PALETTE = Array.from({ length: 256 }, (_, i) => viridis(i / 255));  // made once: a map has 1e5 cells
const run = { cursor: null, name: null, config: null, metrics: [], insight: [], samples: [] };
const view = { selected: 0, follow: true, player: null, map: null };

// ----- reading the run

async function poll() {
  try {
    const response = await fetch("/api/run" + (run.cursor ? "?since=" + encodeURIComponent(run.cursor) : ""));
    const data = await response.json();
    if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
    if (absorb(data)) render();
    setStatus("", false);
  } catch (err) {
    setStatus("cannot read the run: " + err.message, true);
  }
  setTimeout(poll, POLL_MS);
}

function absorb(data) {  // adds a response to the run; returns whether anything changed
  let changed = data.name !== run.name || JSON.stringify(data.config) !== JSON.stringify(run.config);
  Object.assign(run, { cursor: data.cursor, name: data.name, config: data.config });
  for (const name of FILES) {
    const part = data.files[name];
    if (part.reset) run[name] = [];  // the file was rewritten (a resumed run): it came again from its start
    changed = changed || part.reset || part.records.length > 0;
    run[name] = run[name].concat(part.records);
  }
  return changed;
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "muted";
}

const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
const series = (key) => run.metrics.filter((r) => isNumber(r[key])).map((r) => [r.step, r[key]]);
const signed = (v) => (isNumber(v) ? (v >= 0 ? "+" : "") + v.toFixed(3) : "?");

function phaseStep() {  // where the newest record that has located it puts the phase change
  for (let i = run.metrics.length - 1; i >= 0; i--) {
    if (Number.isInteger(run.metrics[i].phase_change_step)) return run.metrics[i].phase_change_step;
  }
  return null;
}

// ----- the page

function render() {
  renderHeader();
  const phase = phaseStep();
  lineChart($("chart-loss"), [
    { label: "training", points: series("loss"), color: "#98a2b3" },
    { label: "validation", points: series("val_loss"), color: "#2f6fed", dots: true },
  ], phase, "No losses logged yet.");
  lineChart($("chart-icl"), [{ label: "ICL score", points: series("icl_score"), color: "#7a5af8", dots: true }],
    phase, "No ICL scores (not logged by this run, or no evaluation yet).");
  // Induction scores lie in [0, 1] (1: a perfect induction head): the axis always spans it, so that a small model's
  // scores near chance read as near chance instead of filling the chart with their noise.
  lineChart($("chart-induction"), [
    { label: "strongest head", points: series("induction_score"), color: "#e8590c", dots: true },
    { label: "uniform attention", points: series("induction_chance"), color: "#667085", dashed: true },
  ], phase, "No induction scores (not logged by this run, or no evaluation yet).", [0, 1]);
  lineChart($("chart-repeat"), [
    { label: "repeated half", points: series("induction_loss"), color: "#0e9384", dots: true },
    { label: "first half", points: series("first_half_loss"), color: "#98a2b3", dots: true },
  ], phase, "No induction losses (not logged by this run, or no evaluation yet).");
  lineChart($("chart-ablation"), [
    { label: "repeated-half loss change", points: series("ablation_repeat_change"), color: "#0e9384", dots: true },
    { label: "ICL score change", points: series("ablation_icl_change"), color: "#7a5af8", dots: true },
  ], phase, "No ablations (not logged by this run, or no evaluation yet).");
  lineChart($("chart-experts"), expertLoadLines(), phase,
    "No expert load (a dense model, or no evaluation yet).");
  renderSelected();
  renderSamples();
}

function expertLoadLines() {  // per MoE layer: [step, std / mean of its tokens per expert] at each evaluation
  const records = run.metrics.filter((r) => Array.isArray(r.moe_tokens_per_expert));
  if (!records.length) return [];
  const cv = (counts) => {
    const mean = counts.reduce((a, b) => a + b, 0) / counts.length;
    return mean ? Math.sqrt(counts.reduce((a, c) => a + (c - mean) ** 2, 0) / counts.length) / mean : 0;
  };
  const layers = records[records.length - 1].moe_tokens_per_expert.length;
  const lines = Array.from({ length: layers }, (_, l) => ({
    label: "MoE layer " + l, color: `hsl(${(l * 360) / layers}, 65%, 45%)`, dots: true,
    points: records.filter((r) => r.moe_tokens_per_expert[l]).map((r) => [r.step, cv(r.moe_tokens_per_expert[l])]),
  }));
  const steps = records.map((r) => r.step);
  return lines.concat([{ label: "0.3", color: "#667085", dashed: true,
    points: [[Math.min(...steps), 0.3], [Math.max(...steps), 0.3]] }]);
}

function renderHeader() {
  const config = run.config;
  $("run-name").textContent = run.name;
  $("run-shape").textContent = !config ? "no config.yaml" : config.error || describeConfig(config);
  $("config").textContent = (config && config.text) || "";
  const last = run.metrics.reduce((most, r) => Math.max(most, r.step), -1), phase = phaseStep();
  const evaluations = run.metrics.filter((r) => EVALUATION_KEYS.some((key) => key in r));
  const stopped = evaluations.filter((r) => r.evaluation === "stopped").length;
  const parts = [last < 0 ? "No records yet: the run has just started"
    : "step " + last + (config && config.max_steps ? " of " + config.max_steps : "")];
  parts.push(evaluations.length + (evaluations.length === 1 ? " evaluation" : " evaluations") +
    (stopped ? " (" + stopped + " stopped before it finished)" : ""));
  if (phase !== null) parts.push("phase change at step " + phase + " (where the ICL score falls fastest)");
  $("summary").textContent = parts.join(" · ");
}

function describeConfig(config) {
  const m = config.model || {}, shape = [];
  if (m.n_layer !== undefined) shape.push(m.n_layer + " layers × " + m.n_head + " heads");
  if (m.n_kv_head !== undefined && m.n_kv_head !== m.n_head) shape.push(m.n_kv_head + " key/value heads");
  if (m.n_embd !== undefined) shape.push(m.n_embd + " wide");
  if (m.block_size !== undefined) shape.push("context " + m.block_size);
  if (m.vocab_size !== undefined) shape.push("vocabulary " + m.vocab_size);
  if (m.position !== undefined) shape.push(m.position + " positions");
  const what = config.objective ? "objective " + config.objective + (config.method ? ` (${config.method})` : "") : "";
  return [shape.join(", "), what].filter(Boolean).join(" · ");
}

// ----- the selected evaluation: the slider, the heads, the ablation (and its column on Olsson's map)

function renderSelected() {
  const count = run.insight.length, slider = $("eval-slider");
  if (view.follow || view.selected >= count) view.selected = Math.max(0, count - 1);
  $("player").hidden = count === 0;
  slider.max = Math.max(0, count - 1);
  slider.value = view.selected;
  const record = run.insight[view.selected];
  $("eval-label").textContent = record ? `evaluation ${view.selected + 1} of ${count} · step ${record.step}` : "";
  renderHeads(record);
  renderAblation(record);
  drawOlsson();
}

function select(index) {
  view.selected = index;
  view.follow = index === run.insight.length - 1;  // at the newest: keep following new ones
  renderSelected();
}

function togglePlay() {
  if (view.player) return stopPlaying();
  if (view.selected === run.insight.length - 1) select(0);
  $("play").textContent = "Pause";
  view.player = setInterval(() => {
    if (view.selected >= run.insight.length - 1) return stopPlaying();
    select(view.selected + 1);
  }, PLAY_MS);
}

function stopPlaying() {
  clearInterval(view.player);
  view.player = null;
  $("play").textContent = "Play";
}

function renderHeads(record) {
  const box = $("heads");
  box.textContent = "";
  if (!record) {
    const evaluated = run.metrics.some((r) => "val_loss" in r);
    box.textContent = evaluated ? "No per-head scores (insight.jsonl) yet: a run with train.observe off, not a " +
      "language-model run, or of an older gptkit writes none." : "Waiting for the first evaluation.";
    return;
  }
  const grid = Array.isArray(record.induction) ? record.induction.filter(Array.isArray) : [];
  if (!grid.length) { box.textContent = "This evaluation has no per-head induction scores."; return; }
  let best = null;
  grid.forEach((row, layer) => row.forEach((score, head) => {
    if (isNumber(score) && (!best || score > best.score)) best = { layer, head, score };
  }));
  const table = element("table", "heads", box), top = element("tr", "", table);
  element("th", "", top);
  grid[0].forEach((_, head) => element("th", "", top, "head " + head));
  grid.forEach((row, layer) => {
    const tr = element("tr", "", table);
    element("th", "", tr, "layer " + layer);
    row.forEach((score, head) => {
      const strongest = best && best.layer === layer && best.head === head;
      const td = element("td", strongest ? "score strongest" : "score", tr, isNumber(score) ? score.toFixed(2) : "–");
      Object.assign(td.dataset, { layer, head });
      if (!isNumber(score)) return;
      const shade = Math.min(1, Math.max(0, score));
      Object.assign(td.style, { background: `hsl(220, 80%, ${100 - 55 * shade}%)`, color: shade > 0.6 ? "#fff" : "" });
    });
  });
  const chance = record.induction_chance, strongest = best ? `layer ${best.layer} head ${best.head}` : "none";
  element("p", "note", box, "Strongest: " + strongest + (best ? ` (${best.score.toFixed(3)})` : "") +
    (isNumber(chance) ? "; uniform attention scores " + chance.toFixed(3) : "") + ". 1 is a perfect induction head.");
}

function renderAblation(record) {
  const box = $("ablation"), a = record && record.ablation;
  box.textContent = "";
  if (!a || typeof a !== "object") { box.textContent = record ? "No ablation at this evaluation." : ""; return; }
  element("p", "note", box, "Mean-ablating layer " + a.layer + " head " + a.head + " (the strongest induction head) " +
    "changes the ICL score by " + signed(a.icl_change) + " and the loss on the repeated half by " +
    signed(a.repeat_change) + " nats (positive: the model does worse without it).");
  const heads = Array.isArray(a.layer_heads) ? a.layer_heads : [];
  if (!heads.length) return;
  element("p", "note", box, "Each head of layer " + a.layer + " ablated alone (bold: head " + a.head + "):");
  const chart = element("div", "chart", box);
  chart.id = "ablation-chart";
  barChart(chart, heads, a.head);
}

// ----- samples

function renderSamples() {
  const box = $("samples");
  box.textContent = run.samples.length ? "" : "No samples yet: gptkit train writes them at evaluations.";
  const order = run.samples.map((_, i) => i).sort((i, j) => run.samples[j].step - run.samples[i].step || i - j);
  for (const i of order) {
    const sample = run.samples[i], div = element("div", "sample", box);
    element("div", "meta", div, "step " + sample.step + (sample.kind ? " · " + sample.kind : ""));
    const text = element("div", "text", div);
    element("span", "prompt", text, sample.prompt || "");
    element("span", "completion", text, sample.completion || "");
  }
}

// ----- drawing

function element(tag, className, parent, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  parent.appendChild(el);
  return el;
}

function svgNode(tag, attrs, parent, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  if (text !== undefined) el.textContent = text;
  parent.appendChild(el);
  return el;
}

function extent(values) {  // [min, max], widened when all values are equal (a loop: spreading 1e5 values overflows)
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; return [lo - pad, hi + pad]; }
  return [lo, hi];
}

function ticks([lo, hi], count) {  // round numbers (1, 2 or 5 times a power of ten) across [lo, hi]
  const raw = (hi - lo) / count, power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((f) => f * power).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

const label = (v) => (Math.abs(v) >= 10000 ? v / 1000 + "k" : String(Number(v.toPrecision(4))));
const scale = ([d0, d1], r0, r1) => (v) => r0 + ((v - d0) / (d1 - d0)) * (r1 - r0);

function thin(points, most) {  // every k-th point (and the last), so that a long run's curve stays quick to draw
  const k = Math.ceil(points.length / most);
  return k <= 1 ? points : points.filter((_, i) => i % k === 0 || i === points.length - 1);
}

function frame(box, xDomain, yDomain, xTicks) {  // an SVG with its grid and axis labels; returns it and its scales
  const W = 560, H = 230, M = { left: 52, right: 14, top: 30, bottom: 28 };
  const svg = svgNode("svg", { viewBox: "0 0 " + W + " " + H }, box);
  const x = scale(xDomain, M.left, W - M.right), y = scale(yDomain, H - M.bottom, M.top);
  for (const t of ticks(yDomain, 5)) {
    svgNode("line", { x1: M.left, x2: W - M.right, y1: y(t), y2: y(t), class: "grid" }, svg);
    svgNode("text", { x: M.left - 6, y: y(t) + 4, "text-anchor": "end" }, svg, label(t));
  }
  for (const t of xTicks ? ticks(xDomain, 6) : []) {
    svgNode("text", { x: x(t), y: H - M.bottom + 16, "text-anchor": "middle" }, svg, label(t));
  }
  svgNode("line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: "axis" }, svg);
  return { svg, x, y, W, H, M };
}

function legend(svg, items, M) {
  let left = M.left;
  for (const item of items) {
    svgNode("rect", { x: left, y: 8, width: 14, height: 8, fill: item.color }, svg);
    svgNode("text", { x: left + 18, y: 16 }, svg, item.label);
    left += 30 + 6 * item.label.length;
  }
}

function lineChart(box, lines, phase, empty, span = []) {  // span: values the y-axis always includes
  box.textContent = "";
  const points = lines.flatMap((line) => line.points);
  if (!points.length) { box.textContent = empty; return; }
  const steps = points.map((p) => p[0]).concat(phase === null ? [] : [phase]);
  const { svg, x, y, H, M } = frame(box, extent(steps), extent(points.map((p) => p[1]).concat(span)), true);
  for (const line of lines.filter((l) => l.points.length)) {
    const drawn = thin(line.points, 1500);
    svgNode("polyline", { points: drawn.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" "),
      fill: "none", stroke: line.color, "stroke-width": 1.6, "stroke-dasharray": line.dashed ? "5 4" : "none",
      "data-label": line.label, "data-points": line.points.length }, svg);
    if (line.dots) drawn.forEach((p) => svgNode("circle", { cx: x(p[0]), cy: y(p[1]), r: 2.6, fill: line.color }, svg));
  }
  legend(svg, lines.filter((l) => l.points.length), M);
  if (phase !== null) phaseMarker(svg, x(phase), M.top, H - M.bottom, phase);
}

function phaseMarker(svg, px, top, bottom, step) {
  svgNode("line", { x1: px, x2: px, y1: top, y2: bottom, class: "phase-line" }, svg);
  svgNode("text", { x: px + 4, y: top + 10, class: "phase-label" }, svg, "phase change · step " + step);
}

function barChart(box, heads, ablated) {  // each head's two changes, side by side; the ablated head's label marked
  const values = heads.flatMap((h) => [h.icl_change, h.repeat_change]).filter(isNumber).concat([0]);
  const { svg, y, W, H, M } = frame(box, [0, 1], extent(values), false);
  const slot = (W - M.left - M.right) / heads.length, bar = Math.min(24, slot / 3);
  const changes = [{ key: "icl_change", label: "ICL score change", color: "#7a5af8" },
    { key: "repeat_change", label: "repeated-half loss change", color: "#0e9384" }];
  heads.forEach((h, i) => {
    const mid = M.left + slot * (i + 0.5);
    changes.forEach((c, k) => {
      if (!isNumber(h[c.key])) return;
      const top = Math.min(y(h[c.key]), y(0)), height = Math.abs(y(h[c.key]) - y(0));
      svgNode("rect", { x: mid + (k - 1) * bar, y: top, width: bar - 2, height, fill: c.color }, svg);
    });
    const where = { x: mid, y: H - M.bottom + 16, "text-anchor": "middle", class: h.head === ablated ? "strong" : "" };
    svgNode("text", where, svg, h.head);
  });
  svgNode("text", { x: M.left - 6, y: H - M.bottom + 16, "text-anchor": "end" }, svg, "head");
  svgNode("line", { x1: M.left, x2: W - M.right, y1: y(0), y2: y(0), class: "axis" }, svg);
  legend(svg, changes, M);
}

function viridis(t) {  // t in [0, 1] along the viridis colour map's five stops
  const at = t * (VIRIDIS.length - 1), i = Math.min(Math.floor(at), VIRIDIS.length - 2);
  return "rgb(" + VIRIDIS[i].map((a, k) => Math.round(a + (at - i) * (VIRIDIS[i + 1][k] - a))).join(",") + ")";
}

const colour = (t) => PALETTE[Math.round(255 * Math.min(1, Math.max(0, t)))];

function drawOlsson() {  // columns: evaluations, at their steps; rows: token positions on a log scale
  const canvas = $("olsson"), ctx = canvas.getContext("2d");
  const rows = run.insight.filter((r) => Array.isArray(r.position_loss) && r.position_loss.some(isNumber));
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  Object.assign(canvas.dataset, { columns: rows.length, phase: phaseStep() ?? "" });
  view.map = rows.length ? mapLayout(rows, canvas.width, canvas.height) : null;
  if (!view.map) { $("olsson-info").textContent = "Waiting for per-position losses (insight.jsonl)."; return; }
  const { edges, x, y, T, lo, hi } = view.map;
  rows.forEach((r, i) => {
    const left = Math.floor(x(edges[i])), width = Math.ceil(x(edges[i + 1])) - left;
    let drawn = null;
    r.position_loss.forEach((loss, p) => {
      const top = Math.floor(y(p + 2));  // position p spans p + 1 to p + 2
      if (!isNumber(loss) || top === drawn) return;  // far positions share a pixel row: the first one shows
      ctx.fillStyle = colour((loss - lo) / (hi - lo));
      ctx.fillRect(left, top, width, Math.ceil(y(p + 1)) - top);
      drawn = top;
    });
  });
  mapFurniture(ctx, view.map, rows.indexOf(run.insight[view.selected]));
  $("olsson-info").textContent = `${rows.length} evaluations × ${T} positions; loss from ${lo.toFixed(3)} to ` +
    `${hi.toFixed(3)}. Hover for values.`;
}

function mapLayout(rows, W, H) {  // where Olsson's map puts each column and position
  const M = { left: 48, right: 70, top: 24, bottom: 30 }, steps = rows.map((r) => r.step), n = steps.length;
  const half = (i) => (n > 1 ? (steps[i + 1] - steps[i]) / 2 : 0.5);
  const edges = steps.map((s, i) => (i === 0 ? s - half(0) : (steps[i - 1] + s) / 2));  // each column's left edge
  edges.push(steps[n - 1] + half(n - 2));
  const phase = phaseStep(), domain = extent(edges.concat(phase === null ? [] : [phase]));
  const T = Math.max(...rows.map((r) => r.position_loss.length));
  const [lo, hi] = extent(rows.flatMap((r) => r.position_loss.filter(isNumber)));
  const y = (v) => M.top + (H - M.top - M.bottom) * (1 - Math.log(v) / Math.log(T + 1));  // v: position + 1
  return { rows, edges, domain, phase, T, lo, hi, M, W, H, x: scale(domain, M.left, W - M.right), y };
}

function mapFurniture(ctx, map, selected) {  // the axes, the colour key, the selected column and the phase change
  const { edges, domain, phase, T, lo, hi, M, W, H, x, y } = map;
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#667085";
  ctx.textAlign = "right";
  for (const p of [0, 1, 3, 10, 30, 100, 300, 1000, 3000, 10000].filter((p) => p < T)) {
    ctx.fillText(p, M.left - 6, y(p + 1.5) + 4);
  }
  ctx.textAlign = "center";
  for (const t of ticks(domain, 6)) ctx.fillText(label(t), x(t), H - M.bottom + 16);
  ctx.fillText("position", M.left - 24, M.top - 10);
  ctx.textAlign = "left";
  ctx.fillText(hi.toFixed(2), W - M.right + 30, M.top + 8);
  ctx.fillText(lo.toFixed(2), W - M.right + 30, H - M.bottom);
  ctx.fillText("loss", W - M.right + 14, M.top - 10);
  for (let k = 0; k <= 100; k++) {
    ctx.fillStyle = colour(1 - k / 100);
    ctx.fillRect(W - M.right + 14, M.top + (k / 101) * (H - M.top - M.bottom), 12, 3);
  }
  if (selected >= 0) {
    ctx.strokeStyle = "#1d2330";
    ctx.strokeRect(x(edges[selected]), M.top, x(edges[selected + 1]) - x(edges[selected]), H - M.top - M.bottom);
  }
  if (phase === null) return;
  ctx.strokeStyle = ctx.fillStyle = "#d92d20";
  ctx.setLineDash([4, 3]);
  ctx.beginPath(); ctx.moveTo(x(phase), M.top); ctx.lineTo(x(phase), H - M.bottom); ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillText("phase change · step " + phase, x(phase) + 4, M.top - 10);
}

function hoverOlsson(event) {
  const map = view.map, canvas = $("olsson"), box = canvas.getBoundingClientRect();
  if (!map) return;
  const px = (event.clientX - box.left) * (canvas.width / box.width);
  const py = (event.clientY - box.top) * (canvas.height / box.height);
  const column = map.rows.findIndex((_, i) => px >= map.x(map.edges[i]) && px < map.x(map.edges[i + 1]));
  const share = 1 - (py - map.M.top) / (map.H - map.M.top - map.M.bottom);  // log(position + 1) / log(T + 1)
  const position = Math.floor(Math.exp(share * Math.log(map.T + 1))) - 1;
  if (column < 0 || position < 0 || position >= map.T) return;
  const loss = map.rows[column].position_loss[position];
  $("olsson-info").textContent = `step ${map.rows[column].step} · position ${position} · loss ` +
    (isNumber(loss) ? loss.toFixed(4) : "none");
}

$("eval-slider").addEventListener("input", (event) => select(Number(event.target.value)));
$("play").addEventListener("click", togglePlay);
$("olsson").addEventListener("mousemove", hoverOlsson);
poll();
