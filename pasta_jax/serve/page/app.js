// The threads page: asks `pasta serve`'s own chat API for a streamed answer with `pasta_threads: true`, and shows
// each thread's text in its own column as the thread writes, a chart of which thread wrote at which step, and the
// composed answer (the stream's ordinary text). The event format is documented in pasta_jax/serve/shapes.py.
"use strict";

const COLORS = ["#2f6fb0", "#d9822b", "#3a9a5b", "#b8476a", "#7b5ea7", "#2a9d9f", "#a0782c", "#5c6b7a"];
const KEY_STORE = "pasta-api-key";
const $ = (id) => document.getElementById(id);

let methods = {};  // name -> {summary, streams, samples}
let running = null;  // the AbortController of the stream in flight
let run = null;  // the answer being shown: {method, threads: Map(id -> thread), answer, maxStep}

function headers() {
  const key = $("api-key").value.trim();
  const out = {"Content-Type": "application/json"};
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

function setStatus(text, kind = "") {
  $("status").textContent = text;
  $("status").className = kind;
}

async function errorText(reply) {
  try {
    const body = await reply.json();
    if (body && body.error && body.error.message) return `${reply.status}: ${body.error.message}`;
  } catch (_) {
    // not a JSON error body: the status says it
  }
  return `${reply.status} ${reply.statusText}`;
}

async function loadMethods() {
  const reply = await fetch("/pasta/methods", {headers: headers()});
  if (!reply.ok) {
    $("model").textContent = "not connected";
    setStatus(reply.status === 401 ? "This server needs an API key: enter it above." : await errorText(reply), "error");
    return;
  }
  const info = await reply.json();
  $("model").textContent = `model ${info.model} · max ${info.max_tokens} tokens`;
  const select = $("method");
  select.replaceChildren();
  methods = {};
  for (const method of info.methods) {
    methods[method.name] = method;
    const option = document.createElement("option");
    option.value = option.textContent = method.name;
    option.title = method.summary;
    select.append(option);
  }
  select.value = info.default;
  $("max-tokens").max = info.max_tokens;
  $("max-tokens").value = Math.min(Number($("max-tokens").value) || info.default_max_tokens, info.max_tokens);
  showMethod();
  setStatus("");
}

function showMethod() {
  const method = methods[$("method").value];
  $("method-summary").textContent = method ? method.summary : "";
  const samples = !method || method.samples;
  for (const id of ["temperature", "top-p", "seed"]) {
    $(id).disabled = !samples;
    $(id).title = samples ? "" : "this method does not sample";
  }
}

// A number field's value for the request: undefined when blank (the server's default), else a number, or an error.
function numberField(id, name, {integer = false} = {}) {
  const raw = $(id).value.trim();
  if (raw === "" || $(id).disabled) return undefined;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw new Error(`${name}: ${JSON.stringify(raw)} is not ${integer ? "a whole number" : "a number"}`);
  }
  return value;
}

function requestBody() {
  const prompt = $("prompt").value;
  if (!prompt.trim()) throw new Error("Type a prompt first.");
  const body = {messages: [{role: "user", content: prompt}], method: $("method").value, stream: true,
                pasta_threads: true};
  const fields = {temperature: numberField("temperature", "temperature"), top_p: numberField("top-p", "top p"),
                  max_tokens: numberField("max-tokens", "max tokens", {integer: true}),
                  seed: numberField("seed", "seed", {integer: true})};
  for (const [name, value] of Object.entries(fields)) {
    if (value !== undefined) body[name] = value;
  }
  return body;
}

function threadName(id, method) {
  if (method === "sot") return `point ${id + 1}`;
  return id === 0 ? "main" : `fork ${id}`;
}

function threadColumn(id) {
  let thread = run.threads.get(id);
  if (thread) return thread;
  const column = document.createElement("div");
  column.className = "thread writing";
  column.dataset.thread = id;
  const color = COLORS[id % COLORS.length];
  column.style.borderTopColor = color;
  const head = document.createElement("div");
  head.className = "thread-head";
  const text = document.createElement("div");
  text.className = "thread-text";
  column.append(head, text);
  // columns in thread order, whatever order their first events come in
  const after = [...$("threads").children].find((c) => Number(c.dataset.thread) > id);
  $("threads").insertBefore(column, after || null);
  thread = {id, parent: null, text: "", steps: new Set(), done: false, color, column, head, body: text};
  run.threads.set(id, thread);
  return thread;
}

function showThread(thread) {
  const from = thread.parent === null ? "" : ` ← ${threadName(thread.parent, run.method)}`;
  const state = thread.done ? "done" : "writing…";
  thread.head.textContent = `${threadName(thread.id, run.method)}${from} · ${thread.steps.size} steps · ${state}`;
  thread.body.textContent = thread.text;
  thread.column.classList.toggle("writing", !thread.done);
}

function applyThreadEvents(events) {
  for (const event of events) {
    const thread = threadColumn(event.thread);
    thread.parent = event.parent;
    thread.text = event.reset ? event.text : thread.text + event.text;
    for (const step of event.steps) {
      thread.steps.add(step);
      run.maxStep = Math.max(run.maxStep, step);
    }
    thread.done = event.done;
    showThread(thread);
  }
  drawChart();
}

function drawChart() {
  const canvas = $("chart");
  const threads = [...run.threads.values()].sort((a, b) => a.id - b.id);
  const label = 92, row = 18, axis = 18;
  const width = canvas.parentElement.clientWidth;
  const height = Math.max(1, threads.length) * row + axis;
  const scale = window.devicePixelRatio || 1;
  canvas.width = width * scale;
  canvas.height = height * scale;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const g = canvas.getContext("2d");
  g.scale(scale, scale);
  g.clearRect(0, 0, width, height);
  const steps = run.maxStep + 1;
  const cell = (width - label - 8) / Math.max(steps, 1);
  g.font = "12px system-ui, sans-serif";
  g.textBaseline = "middle";
  threads.forEach((thread, i) => {
    const y = i * row;
    g.fillStyle = i % 2 ? "#f4f6f8" : "#ffffff";
    g.fillRect(label, y, width - label, row);
    g.fillStyle = "#333";
    g.fillText(threadName(thread.id, run.method), 4, y + row / 2);
    g.fillStyle = thread.color;
    for (const step of thread.steps) g.fillRect(label + step * cell, y + 3, Math.max(cell - 1, 1), row - 6);
  });
  g.fillStyle = "#666";
  const tick = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000].find((t) => t * cell >= 40) || 2000;  // labels 40 px apart
  for (let step = 0; step < steps; step += tick) g.fillText(String(step), label + step * cell, height - axis / 2);
}

function finish(extras, reason) {
  const parts = [`done: ${reason || "ended"}`];
  if (extras) {
    if (extras.steps !== undefined) parts.push(`${extras.steps} steps`);
    parts.push(`${run.threads.size} thread${run.threads.size === 1 ? "" : "s"}`);
    if (extras.theoretical_speedup) parts.push(`theoretical speedup ${extras.theoretical_speedup.toFixed(2)}×`);
    if (extras.note) parts.push(extras.note);
  }
  setStatus(parts.join(" · "), "done");
}

function handleEvent(data) {
  if (data === "[DONE]") return true;
  const chunk = JSON.parse(data);
  if (chunk.error) {
    setStatus(`error: ${chunk.error.message}`, "error");
    return true;
  }
  if (chunk.pasta_threads) applyThreadEvents(chunk.pasta_threads);
  for (const choice of chunk.choices || []) {
    if (choice.index !== 0) continue;  // superposed decoding's other drafts: the answer is the first
    const text = choice.delta && choice.delta.content;
    if (text) {
      run.answer += text;
      $("answer").textContent = run.answer;
    }
    if (choice.finish_reason) finish(chunk.pasta, choice.finish_reason);
  }
  if (!$("status").classList.contains("done")) {
    setStatus(`streaming… ${run.threads.size} thread${run.threads.size === 1 ? "" : "s"}, step ${run.maxStep}`);
  }
  return false;
}

async function send(submitted) {
  submitted.preventDefault();
  if (running) return;
  let body;
  try {
    body = requestBody();
  } catch (err) {
    setStatus(err.message, "error");
    return;
  }
  run = {method: body.method, threads: new Map(), answer: "", maxStep: 0};
  $("threads").replaceChildren();
  $("answer").textContent = "";
  drawChart();
  setStatus("waiting for the server…");
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  document.body.classList.add("busy");
  try {
    const reply = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
                                                       signal: running.signal});
    if (!reply.ok) {
      setStatus(await errorText(reply), "error");
      return;
    }
    const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "", ended = false;
    while (!ended) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while (!ended && (cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6));
        if (data.length) ended = handleEvent(data.join("\n"));
      }
    }
    if (!ended) setStatus("the stream ended before the answer did (the server went away?)", "error");
  } catch (err) {
    setStatus(err.name === "AbortError" ? "stopped" : `error: ${err.message}`, "error");
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    document.body.classList.remove("busy");
  }
}

function start() {
  $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadMethods();
  });
  $("method").addEventListener("change", showMethod);
  $("ask").addEventListener("submit", send);
  $("stop").addEventListener("click", () => running && running.abort());
  $("prompt").addEventListener("keydown", (key) => {
    if (key.key === "Enter" && (key.ctrlKey || key.metaKey)) $("ask").requestSubmit();
  });
  window.addEventListener("resize", () => run && drawChart());
  loadMethods().catch((err) => setStatus(`cannot reach the server: ${err.message}`, "error"));
}

start();
