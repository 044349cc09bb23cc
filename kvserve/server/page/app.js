// kvserve's built-in page: a chat playground that streams from /v1/chat/completions (fetch and
// server-sent events read by hand, so that the request can carry a body and an API key, which
// EventSource cannot), and a live view of the engine polled from /metrics. Plain JavaScript:
// no build step, nothing loaded from anywhere but this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, chatTemplate: true, history: [], controller: null };
const METRICS_EVERY_MS = 1000;

// ------------------------------------------------------------------ requests
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `HTTP ${resp.status}`;
}

function showNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

async function loadModel() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) {
      showNotice(await errorText(resp) + (resp.status === 401 ? " (enter the API key)" : ""));
      return;
    }
    const card = (await resp.json()).data[0];
    state.model = card.id;
    state.chatTemplate = card.chat_template !== false;
    $("model").textContent = card.id + (card.max_model_len ? ` · context ${card.max_model_len} tokens` : "");
    // A model without a chat template cannot chat: the conversation goes out as plain text.
    showNotice(state.chatTemplate ? "" : `${card.id} has no chat template: the conversation is sent as ` +
      "a plain prompt to /v1/completions (serve it with --chat-template FILE|STRING to chat).");
  } catch (e) {
    showNotice("cannot reach the server: " + e);
  }
}

// Server-sent events from a fetch response: yields each event's data (the JSON text, or
// "[DONE]"). Events end with a blank line; a read may end anywhere, so text is buffered.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

function numberInput(id) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

// ------------------------------------------------------------------ chat
function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "message " + role;
  el.textContent = text;
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function plainPrompt(messages) {
  return messages.map((m) => `${m.role}: ${m.content}`).join("\n") + "\nassistant:";
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
  const body = { model: state.model, stream: true, stream_options: { include_usage: true },
                 temperature: numberInput("temperature"), top_p: numberInput("top_p"),
                 max_tokens: numberInput("max_tokens") };
  if ($("json_mode").checked) body.response_format = { type: "json_object" };
  // Tools: the model may answer with calls (tool_choice "auto"); they are shown, not run.
  if ($("tools_on").checked) body.tools = JSON.parse($("tools").value);
  if (state.chatTemplate) return ["/v1/chat/completions", { ...body, messages }];
  return ["/v1/completions", { ...body, prompt: plainPrompt(messages) }];
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant streaming", "");
  let url, body;
  try {
    [url, body] = requestBody();
  } catch (e) {  // the tools are not JSON
    bubble.className = "message error";
    bubble.textContent = "tools: " + e.message;
    state.history.pop();
    return;
  }
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstAt = null, reply = "", usage = null, finish = null;
  const calls = [];
  try {
    const resp = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                    signal: controller.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = state.chatTemplate ? (choice.delta && choice.delta.content) || "" : choice.text || "";
      if (delta) {
        if (firstAt === null) firstAt = performance.now();
        reply += delta;
        bubble.textContent = reply;
        bubble.scrollIntoView({ block: "end" });
      }
      for (const call of (choice.delta && choice.delta.tool_calls) || []) {
        calls.push(call);  // (kvserve sends each call whole, in one delta)
        const line = document.createElement("span");
        line.className = "call";
        line.textContent = `→ ${call.function.name}(${call.function.arguments})`;
        bubble.appendChild(line);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (body.response_format) {
      bubble.classList.add("json");
      try { bubble.textContent = JSON.stringify(JSON.parse(reply), null, 2); } catch (e) { /* cut short */ }
    }
    const seconds = (performance.now() - (firstAt || started)) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    $("last-stats").textContent = [
      tokens !== null ? `${tokens} tokens` : null,
      tokens && seconds > 0 ? `${(tokens / seconds).toFixed(1)} tok/s` : null,
      firstAt !== null ? `first token ${Math.round(firstAt - started)} ms` : null,
      finish ? `finish: ${finish}` : null].filter(Boolean).join(" · ");
  } catch (e) {
    if (e.name === "AbortError") {
      $("last-stats").textContent = "stopped";
    } else {
      bubble.classList.add("error");
      bubble.textContent = (reply ? reply + "\n" : "") + "error: " + e.message;
    }
  } finally {
    bubble.classList.remove("streaming");
    // What the model said stays in the conversation, also when it was stopped.
    const turn = { role: "assistant", content: reply };
    if (calls.length) turn.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: c.function }));
    state.history.push(turn);
    state.controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").textContent = "";
  $("last-stats").textContent = "";
});
$("tools_on").addEventListener("change", () => { $("tools").hidden = !$("tools_on").checked; });
$("api_key").addEventListener("change", () => {
  sessionStorage.setItem("kvserve-api-key", $("api_key").value);
  loadModel();
});

// ------------------------------------------------------------------ engine view
// Prometheus text: unlabelled samples by name (the histograms' labelled buckets are skipped).
function parseMetrics(text) {
  const samples = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([^\s{]+)\s+(\S+)/);
    if (match) samples[match[1]] = parseFloat(match[2]);
  }
  return samples;
}

const P = "kvserve:";
let lastScrape = null;

function rate(now, samples, name) {
  if (!lastScrape) return null;
  const seconds = (now - lastScrape.time) / 1000;
  return seconds > 0 ? (samples[name] - lastScrape.samples[name]) / seconds : null;
}

async function pollMetrics() {
  try {
    const resp = await fetch("/metrics");
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const m = parseMetrics(await resp.text());
    const now = performance.now();
    $("m-running").textContent = m[P + "num_requests_running"];
    $("m-waiting").textContent = m[P + "num_requests_waiting"];
    const usage = m[P + "kv_cache_usage_perc"] || 0;
    $("m-kv-meter").value = usage;
    $("m-kv").textContent = `${(usage * 100).toFixed(1)} % of ${m[P + "kv_cache_blocks_total"]} blocks`;
    const queries = m[P + "prefix_cache_queries_total"], hits = m[P + "prefix_cache_hits_total"];
    $("m-prefix").textContent = queries ? `${(100 * hits / queries).toFixed(1)} % of ${queries} tokens` : "–";
    const gen = rate(now, m, P + "generation_tokens_total");
    const prompt = rate(now, m, P + "prompt_tokens_total");
    $("m-gen").textContent = `${m[P + "generation_tokens_total"]} tokens` +
      (gen !== null ? ` · ${gen.toFixed(1)} tok/s` : "");
    $("m-prompt").textContent = `${m[P + "prompt_tokens_total"]} tokens` +
      (prompt !== null ? ` · ${prompt.toFixed(1)} tok/s` : "");
    $("m-preempt").textContent = m[P + "num_preemptions_total"];
    $("m-status").textContent = "live";
    lastScrape = { time: now, samples: m };
  } catch (e) {
    $("m-status").textContent = "unavailable: " + e.message;
  } finally {
    setTimeout(pollMetrics, METRICS_EVERY_MS);
  }
}

$("api_key").value = sessionStorage.getItem("kvserve-api-key") || "";
loadModel();
pollMetrics();
