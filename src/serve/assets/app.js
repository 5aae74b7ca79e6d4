// tinygpt's page: a playground that streams /v1/completions, and a dashboard of the
// runs under --runs (curves that grow while `tinygpt train` writes metrics.jsonl).
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = ["#3461d1", "#d1495b", "#2a9d8f", "#e9a23b", "#7b4bb7", "#3d8a3d", "#c0577d", "#5c6b80"];

// --- API access (with the key the server may ask for) -----------------------------

const keyInput = $("api-key");
keyInput.value = localStorage.getItem("tinygpt-api-key") || "";
keyInput.addEventListener("change", () => {
  localStorage.setItem("tinygpt-api-key", keyInput.value);
  start();
});

// What a failed fetch means to someone at the page (the browser says only "Failed to
// fetch" or "network error").
const UNREACHABLE = "the server does not answer (stopped, or the network is down): start it again; the page goes on once it answers";

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (keyInput.value) headers["Authorization"] = "Bearer " + keyInput.value;
  if (options.body) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new Error(UNREACHABLE);
  }
  if (response.status === 401) {
    keyInput.hidden = false;
    keyInput.focus();
  }
  return response;
}

async function errorText(response) {
  if (response.status === 401) {
    return "this server asks for an API key: type it into the box at the top right";
  }
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

// --- Tabs --------------------------------------------------------------------------
// Each tab has a URL (#playground, #runs): a reload or a shared link opens the same
// tab, and the browser's back button goes to the tab before. The panels' ids are not
// the hashes, so following one does not scroll the page.

function showTab(name) {
  const tabs = [...document.querySelectorAll(".tab")];
  if (!tabs.some((t) => t.dataset.tab === name)) name = tabs[0].dataset.tab;
  for (const t of tabs) {
    t.classList.toggle("active", t.dataset.tab === name);
    if (t.dataset.tab === name) t.setAttribute("aria-current", "page");
    else t.removeAttribute("aria-current");
  }
  for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.dataset.tab === name);
  if (name === "runs") charts.resize();
}
window.addEventListener("hashchange", () => showTab(location.hash.slice(1)));

// --- Playground ----------------------------------------------------------------------

for (const [input, shown] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
  $(input).addEventListener("input", () => { $(shown).textContent = $(input).value; });
}

let streaming = null; // the AbortController of the stream in flight

// The settings survive a reload (kept in this browser only).
const SETTINGS = ["max-tokens", "temperature", "top-p", "top-k", "seed", "stop-strings"];
for (const id of SETTINGS) {
  const kept = localStorage.getItem("tinygpt-" + id);
  if (kept !== null) $(id).value = kept;
  $(id).addEventListener("change", () => localStorage.setItem("tinygpt-" + id, $(id).value));
}
$("temperature-value").textContent = $("temperature").value;
$("top-p-value").textContent = $("top-p").value;

// The request's JSON. A seed goes as the digits typed: a JavaScript number holds whole
// numbers exactly only up to 2^53, and seeds run to 2^64 - 1.
function requestBody(fields, seed) {
  const json = JSON.stringify(fields);
  return seed === null ? json : json.slice(0, -1) + `,"seed":${seed}}`;
}

// Moves the focus off a button about to be disabled (it would fall to the page's start).
function handFocus(from, to) {
  if (document.activeElement === from) to.focus();
}

function showError(message) {
  const box = $("play-error");
  box.textContent = message;
  box.hidden = !message;
}

function unescapeStop(s) {
  return s.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
}

// Tokens a second while decoding: the tokens after the first over the time between the
// first's arrival and the last's. A fast model's stream comes in a few reads, its tokens
// together, so a span under RATE_MIN_SPAN_MS times nothing (a 300-token reply read 1 ms
// after its first token showed 300,000 tokens/s); the whole reply's rate stands in then.
const RATE_MIN_SPAN_MS = 50;
function decodeRate(tokens, first, last, totalSeconds) {
  if (first === null) return 0;
  const span = last - first;
  if (tokens > 1 && span >= RATE_MIN_SPAN_MS) return (tokens - 1) / (span / 1000);
  return tokens / Math.max(totalSeconds, 1e-3);
}

async function generate() {
  // One stream at a time: Ctrl+Enter in the prompt is a second way in.
  if (streaming) return;
  const output = $("output");
  const prompt = $("prompt").value;
  const maxTokens = $("max-tokens").value === "" ? 200 : Number($("max-tokens").value);
  const seed = $("seed").value.trim();
  if (!(Number.isInteger(maxTokens) && maxTokens >= 1)) {
    showError("Max tokens: give a whole number, 1 or more.");
    return;
  }
  if (seed !== "" && !/^-?[0-9]+$/.test(seed)) {
    showError("Seed: give a whole number, or leave it empty for a random one.");
    return;
  }
  showError("");
  output.textContent = "";
  const promptSpan = document.createElement("span");
  promptSpan.className = "prompt-text";
  promptSpan.textContent = prompt;
  const textSpan = document.createElement("span");
  output.append(promptSpan, textSpan);

  const body = {
    prompt,
    max_tokens: maxTokens,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    top_k: Number($("top-k").value) || 0,
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("stop-strings").value !== "") body.stop = [unescapeStop($("stop-strings").value)];

  streaming = new AbortController();
  handFocus($("generate"), $("stop"));
  $("generate").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null;
  let last = null;
  let tokens = 0;
  const stats = $("stats");
  stats.textContent = "waiting…";
  try {
    const response = await api("/v1/completions", {
      method: "POST", body: requestBody(body, seed === "" ? null : seed), signal: streaming.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let finish = null;
    for (;;) {
      let read;
      try {
        read = await reader.read();
      } catch (err) {
        if (err.name === "AbortError") throw err;
        throw new Error(UNREACHABLE);
      }
      const { value, done } = read;
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) tokens = chunk.usage.completion_tokens;
          for (const choice of chunk.choices) {
            if (choice.text) {
              last = performance.now();
              if (first === null) first = last;
              textSpan.textContent += choice.text;
              tokens += 1;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
          const seconds = (performance.now() - started) / 1000;
          stats.textContent = `${tokens} tokens · ${decodeRate(tokens, first, last, seconds).toFixed(0)} tokens/s`;
        }
      }
    }
    const total = (performance.now() - started) / 1000;
    const ttft = first === null ? "-" : ((first - started)).toFixed(0) + " ms";
    const rate = decodeRate(tokens, first, last, total);
    // "length" short of max_tokens: the server stopped and cut the reply short.
    const why = finish === "length" && tokens < maxTokens ? "cut short: the server stopped" : finish || "stopped";
    stats.textContent = `${tokens} tokens in ${total.toFixed(2)} s · first token ${ttft} · ${rate.toFixed(0)} tokens/s · ${why}`;
  } catch (err) {
    if (err.name !== "AbortError") {
      // Beside the buttons, where it is seen (the output may run far below).
      showError(String(err.message || err));
      stats.textContent = "";
    } else {
      // Counted in chunks, and a chunk may carry several tokens: at least this many.
      stats.textContent = `at least ${tokens} tokens · stopped`;
    }
  } finally {
    streaming = null;
    handFocus($("stop"), $("generate"));
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => streaming && streaming.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate();
});

// --- Runs dashboard ------------------------------------------------------------------

const runs = new Map(); // name -> { row, color, shown, next, records }

// A color no listed run has: the palette's first, then hues a golden angle apart (a
// ninth run took the first's color, and so did a run listed after a deletion).
function freeColor() {
  const used = new Set([...runs.values()].map((r) => r.color));
  const free = COLORS.find((c) => !used.has(c));
  if (free) return free;
  for (let i = 0; ; i++) {
    const color = `hsl(${Math.round((i * 137.508 + 20) % 360)}, 60%, 42%)`;
    if (!used.has(color)) return color;
  }
}

function chartSeries(field, dashed) {
  return [...runs.entries()].filter(([, r]) => r.shown).map(([name, r]) => ({
    label: name + (dashed ? " val" : " train"),
    points: r.records.filter((m) => typeof m[field] === "number").map((m) => [m.step, m[field]]),
    stroke: r.color,
    dash: dashed ? [6, 4] : undefined,
  }));
}

class Charts {
  constructor() { this.plots = {}; }

  // Axis numbers people read at a glance: 1.2e-4 for rates, 52k for speeds.
  static tick(kind) {
    if (kind === "small") return (u, values) => values.map((v) => v === 0 ? "0" : v.toExponential(1));
    if (kind === "large") return (u, values) => values.map((v) => Math.abs(v) >= 1000 ? (v / 1000).toFixed(0) + "k" : String(v));
    return undefined;
  }

  draw(id, series, ticks) {
    const el = $(id);
    const width = Math.max(el.clientWidth, 200);
    const height = id === "chart-loss" ? 420 : 170;
    const nonEmpty = series.filter((s) => s.points.length > 0);
    if (this.plots[id]) { this.plots[id].destroy(); delete this.plots[id]; }
    el.textContent = "";
    if (nonEmpty.length === 0) {
      el.innerHTML = '<p class="hint">No points yet.</p>';
      return;
    }
    const tables = nonEmpty.map((s) => [s.points.map((p) => p[0]), s.points.map((p) => p[1])]);
    const data = uPlot.join(tables);
    const opts = {
      width, height,
      // Past a few runs the legend outgrows the chart; the runs table's swatches name
      // the colors (train solid, val dashed) and its checkboxes pick the runs shown.
      legend: { show: id === "chart-loss" && nonEmpty.length <= 8 },
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { size: 64, values: Charts.tick(ticks) }],
      series: [{ label: "step" }, ...nonEmpty.map((s) => ({
        label: s.label, stroke: s.stroke, width: 2, dash: s.dash, spanGaps: true,
        points: { show: s.points.length < 30 },
      }))],
    };
    this.plots[id] = new uPlot(opts, data, el);
    el.dataset.points = String(nonEmpty.reduce((n, s) => n + s.points.length, 0));
    el.dataset.lastStep = String(data[0].reduce((a, b) => Math.max(a, b), 0));
  }

  redraw() {
    this.draw("chart-loss", [...chartSeries("loss", false), ...chartSeries("val_loss", true)]);
    this.draw("chart-lr", chartSeries("lr", false), "small");
    this.draw("chart-speed", chartSeries("tokens_per_s", false), "large");
  }

  resize() {
    for (const [id, plot] of Object.entries(this.plots)) {
      const el = $(id);
      plot.setSize({ width: Math.max(el.clientWidth, 200), height: plot.height });
    }
  }
}
const charts = new Charts();
window.addEventListener("resize", () => charts.resize());

function fmt(x, digits) {
  return typeof x === "number" ? x.toFixed(digits) : "–";
}

// What differs between runs, a setting a span; a narrow table breaks a long one after
// an underscore or an equals sign (`checkpoint_` / `interval=` / `20`), not mid-word.
function settingsHtml(settings) {
  return settings
    .map((s) => `<span class="setting">${escapeHtml(s).replace(/[_=]/g, "$&<wbr>")}</span>`)
    .join(" ");
}

function renderTable() {
  const body = document.querySelector("#runs-table tbody");
  body.textContent = "";
  for (const [name, run] of runs) {
    const tr = document.createElement("tr");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = run.shown;
    box.setAttribute("aria-label", "show " + name + " in the charts");
    box.addEventListener("change", () => { run.shown = box.checked; charts.redraw(); });
    const swatch = `<span class="swatch" style="background:${run.color}"></span>`;
    const skipped = run.row.skipped_lines > 0
      ? ` <span class="hint" title="lines that are not metrics records, or longer than the server reads">(${run.row.skipped_lines} line${run.row.skipped_lines === 1 ? "" : "s"} of metrics.jsonl skipped)</span>`
      : "";
    const cells = [
      "", `${swatch} ${escapeHtml(name)}${skipped}`, settingsHtml(run.row.differs || []) || "–",
      String(run.row.steps), fmt(run.row.best_val_loss, 4), fmt(run.row.tokens_per_s, 0),
    ];
    const tds = cells.map((html, i) => {
      const td = document.createElement("td");
      if (i === 0) td.append(box); else td.innerHTML = html;
      if (i >= 3) td.className = "num";
      tr.append(td);
      return td;
    });
    // Kept so each poll of the metrics moves these two at once with the charts (the
    // whole list is fetched again every few seconds only).
    run.cells = { steps: tds[3], best: tds[4] };
    body.append(tr);
  }
  const select = $("sample-run");
  const chosen = select.value;
  select.textContent = "";
  for (const [name, run] of runs) {
    if (!run.row.checkpoint) continue;
    const option = document.createElement("option");
    option.value = option.textContent = name;
    select.append(option);
  }
  if (chosen) select.value = chosen;
}

function escapeHtml(s) {
  return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// The dashboard's trouble, in words above it (or nothing once it is gone).
function runsTrouble(message) {
  $("runs-down").textContent = message;
  $("runs-down").hidden = !message;
}

async function refreshRuns() {
  const response = await api("/api/runs");
  if (response.status === 404) {
    $("runs-missing").hidden = false;
    $("runs-body").hidden = true;
    return false;
  }
  if (!response.ok) {
    runsTrouble(await errorText(response));
    return true;
  }
  runsTrouble("");
  const listed = await response.json();
  const present = new Set(listed.runs.map((row) => row.run));
  let removed = false;
  for (const name of [...runs.keys()]) {
    if (!present.has(name)) { runs.delete(name); removed = true; }
  }
  for (const row of listed.runs) {
    const known = runs.get(row.run);
    if (known) known.row = row;
    else runs.set(row.run, { row, color: freeColor(), shown: true, next: 0, file: "", records: [] });
  }
  renderTable();
  if (removed) charts.redraw();
  return true;
}

async function pollMetrics() {
  let grew = false;
  for (const [name, run] of [...runs]) {
    const query = `from=${run.next}&file=${encodeURIComponent(run.file)}`;
    const response = await api(`/api/runs/${encodeURIComponent(name)}/metrics?${query}`);
    if (response.status === 404) {
      // Deleted (or moved away) since it was listed: off the page.
      runs.delete(name);
      renderTable();
      grew = true;
      continue;
    }
    if (!response.ok) continue;
    const got = await response.json();
    // Read from elsewhere than asked: the file shrank, or is another file now (a run
    // replaced by `mv` or rsync).
    const restarted = got.from !== run.next;
    run.file = got.file;
    if (restarted) {
      // The run started over: so do its curves and counts.
      run.records = [];
      run.row.steps = 0;
      run.row.best_val_loss = null;
    }
    if (restarted || got.records.length > 0) {
      run.records.push(...got.records);
      grew = true;
      countRecords(run, got.records);
    }
    run.next = got.next;
  }
  if (grew) charts.redraw();
}

// The table's steps and best validation loss from records just polled, by the rule the
// server's summary follows (a training step's record, or an evaluation's with both
// losses), so the table keeps up with the charts between the list's refreshes.
function countRecords(run, records) {
  for (const m of records) {
    if (typeof m.step !== "number") continue;
    const evaluation = typeof m.train_loss === "number" && typeof m.val_loss === "number";
    if (typeof m.loss === "number" || evaluation) run.row.steps = Math.max(run.row.steps || 0, m.step);
    const best = run.row.best_val_loss;
    if (evaluation && (typeof best !== "number" || m.val_loss < best)) run.row.best_val_loss = m.val_loss;
  }
  if (!run.cells) return;
  run.cells.steps.textContent = String(run.row.steps);
  run.cells.best.textContent = fmt(run.row.best_val_loss, 4);
}

let polling = null;
async function watchRuns() {
  if (polling) return;
  try {
    if (!(await refreshRuns())) return;
    await pollMetrics();
  } catch (err) {
    runsTrouble(String(err.message || err));
  }
  charts.redraw();
  let ticks = 0;
  polling = setInterval(async () => {
    ticks += 1;
    try {
      if (ticks % 5 === 0) await refreshRuns();
      await pollMetrics();
    } catch (err) {
      runsTrouble(String(err.message || err));
    }
  }, 1000);
}

async function sampleRun() {
  const button = $("sample-go");
  if (button.disabled) return; // one sample at a time
  const name = $("sample-run").value;
  const out = $("sample-text");
  if (!name) { out.textContent = "No run has a checkpoint yet."; return; }
  out.textContent = "sampling…";
  button.disabled = true;
  const prompt = $("sample-prompt").value;
  try {
    const response = await api(`/api/runs/${encodeURIComponent(name)}/sample`, {
      method: "POST", body: JSON.stringify({ prompt, max_tokens: 300 }),
    });
    if (!response.ok) { out.textContent = await errorText(response); return; }
    const sample = await response.json();
    out.textContent = prompt + sample.text;
  } catch (err) {
    out.textContent = String(err.message || err);
  } finally {
    button.disabled = false;
  }
}
$("sample-go").addEventListener("click", sampleRun);
$("sample-prompt").addEventListener("keydown", (e) => { if (e.key === "Enter") sampleRun(); });

// --- Start ---------------------------------------------------------------------------

async function start() {
  let response;
  try {
    response = await api("/props");
  } catch (err) {
    $("model").textContent = String(err.message || err);
    setTimeout(start, 2000);
    return;
  }
  if (!response.ok) {
    $("model").textContent = await errorText(response);
    if (response.status === 503) setTimeout(start, 1000);
    return;
  }
  const props = await response.json();
  const millions = (props.parameters / 1e6).toFixed(2);
  $("model").textContent = `${props.model} · ${millions}M parameters · context ${props.context_length} · ${props.slots} slots`;
  $("max-tokens").max = props.max_tokens;
  watchRuns();
}
showTab(location.hash.slice(1));
start();
