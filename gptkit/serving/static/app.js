// The gptkit playground: streams /v1/completions into the page, shades each generated token by its
// probability, draws one layer's attention over the text from /playground/attention beside the logit lens
// (/playground/lens) and the induction heads (/playground/induction), and chats through /v1/chat/completions.
// No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  model: null, abort: null, tokens: [], attention: null, lens: null, lensText: null, induction: null, chat: [],
};

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "muted";
}

async function errorMessage(response) {
  try { return (await response.json()).error.message; } catch (e) { return response.status + " " + response.statusText; }
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) { $("model-name").textContent = "cannot list models: " + (await errorMessage(response)); return; }
  const card = (await response.json()).data[0];
  state.model = card.id;
  $("model-name").textContent = card.id + " · context " + card.context_length + " tokens";
  const maxTokens = $("max_tokens");  // the default must leave room for a prompt in a short context
  if (parseInt(maxTokens.value, 10) >= card.context_length) maxTokens.value = Math.max(1, Math.floor(card.context_length / 2));
}

function numberField(body, id, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return;
  body[id] = integer ? parseInt(raw, 10) : parseFloat(raw);
}

function shade(p) {  // red for unlikely, green for likely tokens
  return "hsl(" + Math.round(120 * p) + ", 70%, " + Math.round(88 - 6 * p) + "%)";
}

function addToken(info) {
  const span = document.createElement("span");
  const p = Math.exp(info.logprob);
  span.className = "tok";
  span.textContent = info.text;
  span.style.background = shade(p);
  span.title = "p = " + p.toFixed(4);
  span.dataset.index = state.tokens.length;
  state.tokens.push(info);
  $("output-generated").appendChild(span);
}

function showToken(index) {
  const info = state.tokens[index];
  document.querySelectorAll(".tok.selected").forEach((el) => el.classList.remove("selected"));
  document.querySelector('.tok[data-index="' + index + '"]').classList.add("selected");
  const rows = Object.entries(info.top || {}).sort((a, b) => b[1] - a[1])
    .map(([text, lp]) => "<tr><td>" + escapeHtml(JSON.stringify(text)) + "</td><td>" + Math.exp(lp).toFixed(4) + "</td></tr>")
    .join("");
  $("token-info").innerHTML = "Token " + escapeHtml(JSON.stringify(info.text)) + ": p = " +
    Math.exp(info.logprob).toFixed(4) + "<table><tr><td>most likely</td><td>p</td></tr>" + rows + "</table>";
}

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function withSettings(body) {  // the sampling settings of the controls panel, for either endpoint
  numberField(body, "max_tokens", true);
  numberField(body, "temperature", false);
  numberField(body, "top_k", true);
  numberField(body, "top_p", false);
  numberField(body, "min_p", false);
  numberField(body, "repetition_penalty", false);
  numberField(body, "seed", true);
  return body;
}

// POST a streaming request and call onChoice with the first choice of each server-sent event; returns the
// finish reason, or throws an Error with the server's message.
async function streamChoices(path, body, onChoice) {
  const response = await fetch(path, {
    method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return finish;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") continue;
      const choice = JSON.parse(data).choices[0];
      if (!choice) continue;
      onChoice(choice);
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
}

function busy(on) {
  $("generate").disabled = on;
  $("chat-send").disabled = on;
  $("stop").disabled = !on;
  state.abort = on ? new AbortController() : null;
}

async function generate() {
  const prompt = $("prompt").value;
  if (!prompt) { setStatus("Type a prompt first.", true); return; }
  if (!state.model) await loadModel();
  const body = withSettings({ model: state.model, prompt: prompt, stream: true, logprobs: 5 });
  state.tokens = [];
  state.attention = null;
  $("output-prompt").textContent = prompt;
  $("output-generated").textContent = "";
  $("token-info").textContent = "No token selected.";
  busy(true);
  setStatus("generating…");
  const started = performance.now();
  try {
    const finish = await streamChoices("/v1/completions", body, (choice) => {
      const lp = choice.logprobs;
      if (lp && lp.tokens.length) {
        lp.tokens.forEach((text, i) => addToken({ text: text, logprob: lp.token_logprobs[i], top: lp.top_logprobs[i] }));
      } else if (choice.text) {
        $("output-generated").appendChild(document.createTextNode(choice.text));
      }
    });
    const seconds = (performance.now() - started) / 1000;
    setStatus(state.tokens.length + " tokens in " + seconds.toFixed(2) + " s (" +
      (state.tokens.length / seconds).toFixed(1) + " tokens/s), finish: " + finish);
    if (!$("view-attention").hidden) await showAttention();
  } catch (err) {
    setStatus(err.name === "AbortError" ? "stopped" : "error: " + err.message, err.name !== "AbortError");
  } finally {
    busy(false);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("chat-log").appendChild(div);
  return div;
}

async function sendChat() {
  const text = $("chat-input").value;
  if (!text.trim()) { $("chat-status").textContent = "Type a message first."; return; }
  if (!state.model) await loadModel();
  const system = $("chat-system").value.trim();
  state.chat.push({ role: "user", content: text });
  addMessage("user", text);
  $("chat-input").value = "";
  const reply = addMessage("assistant", "");
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.chat);
  busy(true);
  $("chat-status").textContent = "replying…";
  try {
    const finish = await streamChoices("/v1/chat/completions", withSettings({ model: state.model, messages: messages, stream: true }),
      (choice) => { if (choice.delta && choice.delta.content) reply.textContent += choice.delta.content; });
    state.chat.push({ role: "assistant", content: reply.textContent });
    $("chat-status").textContent = "finish: " + finish;
  } catch (err) {
    state.chat.pop();  // the turn did not happen: the user may send it again
    reply.remove();
    $("chat-status").textContent = err.name === "AbortError" ? "stopped" : "error: " + err.message;
  } finally {
    busy(false);
  }
}

function newChat() {
  state.chat = [];
  $("chat-log").textContent = "";
  $("chat-status").textContent = "";
}

async function showAttention() {
  const text = $("output-prompt").textContent + $("output-generated").textContent || $("prompt").value;
  if (!text) { $("heatmap-info").textContent = "Generate (or type a prompt) first."; return; }
  const body = { text: text, layer: parseInt($("layer").value || "0", 10) };
  if ($("head").value !== "") body.head = parseInt($("head").value, 10);
  const response = await fetch("/playground/attention", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) { $("heatmap-info").textContent = await errorMessage(response); return; }
  const data = await response.json();
  fillSelect($("layer"), data.layers, data.layer, "layer ");
  fillSelect($("head"), data.heads, data.head, "head ", true);
  state.attention = data;
  drawHeatmap();
  await showLens(text);
  await showInduction();
}

async function showLens(text) {  // the lens of every position at once: hovering then needs no request
  if (state.lensText === text) return;
  const body = JSON.stringify({ text: text });
  const response = await fetch("/playground/lens", { method: "POST", headers: headers(), body: body });
  if (!response.ok) { $("lens-info").textContent = await errorMessage(response); return; }
  state.lens = await response.json();
  state.lensText = text;
  const strip = $("lens-tokens");
  strip.textContent = "";
  state.lens.positions.forEach((row, i) => {
    const span = document.createElement("span");
    span.className = "lens-tok";
    span.textContent = row.token;
    span.dataset.pos = i;
    strip.appendChild(span);
  });
  $("lens-info").textContent = "No token selected.";
}

function showLensAt(i) {
  const row = state.lens && state.lens.positions[i];
  if (!row) return;
  $("lens-tokens").querySelectorAll(".selected").forEach((el) => el.classList.remove("selected"));
  $("lens-tokens").children[i].classList.add("selected");
  const labels = state.lens.labels;
  const rows = row.layers.map((layer, k) => {
    const [text, p] = layer.top[0];
    const decided = k === row.decided_at;
    return '<tr class="layer' + (decided ? " decided" : "") + '"><td>' + escapeHtml(labels[k]) + "</td><td>" +
      escapeHtml(JSON.stringify(text)) + "</td><td>" + p.toFixed(3) + '</td><td><span class="bar" style="width: ' +
      Math.round(60 * layer.prediction_p) + 'px"></span> ' + layer.prediction_p.toFixed(3) +
      (decided ? " ← decided" : "") + "</td></tr>";
  }).join("");
  $("lens-info").innerHTML = "After token " + row.position + " " + escapeHtml(JSON.stringify(row.token)) +
    " the model predicts " + escapeHtml(JSON.stringify(row.prediction)) + ', <span id="lens-decided">decided at ' +
    escapeHtml(labels[row.decided_at]) + '</span>.<table id="lens-table"><tr><th>layer</th><th>top</th><th>p</th>' +
    "<th>p(" + escapeHtml(JSON.stringify(row.prediction)) + ")</th></tr>" + rows + "</table>";
}

async function showInduction() {  // the same for every text: fetched once
  if (state.induction) return;
  const response = await fetch("/playground/induction", { headers: headers() });
  if (!response.ok) { $("induction").textContent = await errorMessage(response); return; }
  const data = state.induction = await response.json();
  const best = data.strongest;
  let html = "<table><tr><th></th>";
  for (let h = 0; h < data.heads; h++) html += "<th>head " + h + "</th>";
  html += "</tr>";
  data.scores.forEach((row, l) => {
    html += "<tr><th>layer " + l + "</th>";
    row.forEach((score, h) => {
      const strongest = l === best.layer && h === best.head ? " strongest" : "";
      html += '<td class="score' + strongest + '" data-layer="' + l + '" data-head="' + h + '" style="background: ' +
        "rgba(47, 111, 237, " + Math.sqrt(Math.max(0, score)).toFixed(3) + ')">' + score.toFixed(3) + "</td>";
    });
    html += "</tr>";
  });
  $("induction").innerHTML = '<span id="induction-strongest">Strongest: layer ' + best.layer + " head " + best.head +
    " (" + best.score.toFixed(3) + ")</span>; chance (uniform attention) " + data.chance.toFixed(3) + "." + html +
    "</table>Loss on the first copy " + data.first_half_loss.toFixed(2) + ", on the repeat " +
    data.repeated_half_loss.toFixed(2) + " (" + data.length + " random tokens, then the same again).";
}

function selectHead(event) {  // a heatmap cell of the induction table: show that head's attention
  const cell = event.target.closest("td.score");
  if (!cell || !state.induction) return;
  fillSelect($("layer"), state.induction.layers, null, "layer ");
  fillSelect($("head"), state.induction.heads, null, "head ", true);
  $("layer").value = cell.dataset.layer;
  $("head").value = cell.dataset.head;
  showAttention();
}

function fillSelect(select, count, chosen, label, withMean) {
  const wanted = (withMean ? 1 : 0) + count;
  if (select.options.length === wanted) return;
  select.innerHTML = withMean ? '<option value="">mean of heads</option>' : "";
  for (let i = 0; i < count; i++) select.add(new Option(label + i, String(i)));
  select.value = chosen === null || chosen === undefined ? "" : String(chosen);
}

const HEATMAP_MARGIN = 48;  // canvas pixels left and above the map for the token labels
const HEATMAP_LABEL_PX = 10;  // the labels' font size: below it, a 560-pixel map's labels (past ~50 tokens) blur

function heatmapCell(n) {  // the side of one cell, in canvas pixels
  return Math.max(1, Math.floor(($("heatmap").width - HEATMAP_MARGIN) / n));
}

function drawHeatmap() {
  const data = state.attention;
  const canvas = $("heatmap");
  const ctx = canvas.getContext("2d");
  const n = data.tokens.length;
  const cell = heatmapCell(n), m = HEATMAP_MARGIN;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const w = data.attention[i][j];
      ctx.fillStyle = "rgba(47, 111, 237, " + Math.sqrt(w) + ")";  // sqrt so that small weights stay visible
      ctx.fillRect(m + j * cell, m + i * cell, cell, cell);
    }
  }
  // Rows (queries, left) and columns (keys, above) are labelled with their tokens in a readable 10-pixel font: every
  // token while cells are that tall, else every k-th (its position with it), so that labels never overlap.
  const every = Math.ceil((HEATMAP_LABEL_PX + 1) / cell);
  ctx.fillStyle = "#333";
  ctx.font = HEATMAP_LABEL_PX + "px monospace";
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  const label = (i) => {
    const s = JSON.stringify(data.tokens[i]).slice(1, -1), short = s.length > 6 ? s.slice(0, 5) + "…" : s;
    return every > 1 ? (i + ":" + short).slice(0, 7) : short;
  };
  for (let i = 0; i < n; i += every) {
    ctx.fillText(label(i), m - 3, m + (i + 0.5) * cell);
    ctx.save();
    ctx.translate(m + (i + 0.5) * cell, m - 3);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    ctx.fillText(label(i), 0, 0);
    ctx.restore();
  }
  canvas.dataset.drawn = String(n);
  canvas.dataset.labelled = String(true);
  canvas.dataset.labelEvery = String(every);
  const shown = data.offset ? "the last " + n + " tokens (the model's context; the " + data.offset +
    " before them are not read)" : n + " tokens";
  $("heatmap-info").textContent = shown + "; rows are queries, columns keys; hover a cell to see its weight.";
}

function heatmapHover(event) {
  const data = state.attention;
  if (!data) return;
  const canvas = $("heatmap");
  const rect = canvas.getBoundingClientRect();
  const n = data.tokens.length;
  const scale = rect.width / canvas.width;  // the canvas may be drawn smaller than its pixels
  const cell = heatmapCell(n) * scale, m = HEATMAP_MARGIN * scale;
  const i = Math.floor((event.clientY - rect.top - m) / cell), j = Math.floor((event.clientX - rect.left - m) / cell);
  if (i < 0 || j < 0 || i >= n || j >= n) return;
  showLensAt(i);
  const p = data.probs[i];
  $("heatmap-info").textContent = "query " + i + " " + JSON.stringify(data.tokens[i]) + " → key " + j + " " +
    JSON.stringify(data.tokens[j]) + ": weight " + data.attention[i][j].toFixed(4) +
    (p === null ? "" : "; p(query token) = " + p.toFixed(4));
}

function selectTab(name) {
  for (const tab of ["text", "attention", "chat"]) {
    $("view-" + tab).hidden = name !== tab;
    $("tab-" + tab).classList.toggle("active", name === tab);
  }
  if (name === "attention" && !state.attention) showAttention();
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) generate(); });
$("output-generated").addEventListener("click", (e) => { if (e.target.dataset.index) showToken(e.target.dataset.index); });
$("output-generated").addEventListener("mouseover", (e) => { if (e.target.dataset.index) showToken(e.target.dataset.index); });
$("tab-text").addEventListener("click", () => selectTab("text"));
$("tab-attention").addEventListener("click", () => selectTab("attention"));
$("tab-chat").addEventListener("click", () => selectTab("chat"));
$("chat-send").addEventListener("click", sendChat);
$("chat-new").addEventListener("click", newChat);
$("chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) sendChat(); });
$("refresh-attention").addEventListener("click", showAttention);
$("layer").addEventListener("change", showAttention);
$("head").addEventListener("change", showAttention);
$("heatmap").addEventListener("mousemove", heatmapHover);
const lensTokenEvent = (e) => { if (e.target.dataset.pos) showLensAt(parseInt(e.target.dataset.pos, 10)); };
$("lens-tokens").addEventListener("click", lensTokenEvent);
$("lens-tokens").addEventListener("mouseover", lensTokenEvent);
$("induction").addEventListener("click", selectHead);
$("api_key").value = localStorage.getItem("gptkit-api-key") || "";
$("api_key").addEventListener("change", () => { localStorage.setItem("gptkit-api-key", $("api_key").value); loadModel(); });
loadModel();
