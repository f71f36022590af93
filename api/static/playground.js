// The chat playground of `triollm serve` (api/playground.py): plain JavaScript, no build step.
//
// It calls the server it came from, by relative URLs (the page's <base href> is --root-path):
// GET v1/models for the model list, POST v1/chat/completions with `stream: true`, read as SSE
// from the fetch's ReadableStream. Stop aborts the fetch (AbortController): the server sees the
// client go and aborts the request. A 4xx's OpenAI error body is shown where the answer would
// be. Model output goes into the page as text (textContent), never as HTML. The API key lives
// in the input field only: never stored, sent as `Authorization: Bearer` to this server alone.
//
// Images (a vision-language model: the server sets <html data-accepts-images="true">): picked,
// pasted or dropped, each read as a data URL and, past MAX_IMAGE_SIDE on its long side, redrawn
// smaller on a canvas in its own type; shown as removable thumbnails until sent, then as
// `image_url` parts before the text part of the user's message, kept in the history so later
// turns send them again. (The page's CSP allows data: images, not blob: ones.)
"use strict";

const $ = (id) => document.getElementById(id);
const history = []; // the conversation sent with each request: {role, content}
let running = null; // the AbortController of the request in flight
let epoch = 0; // counts Clear presses: a request from before one leaves the history alone
const pending = []; // the data URLs of the images attached to the next message
const MAX_IMAGE_SIDE = 1536; // pixels on the long side; a larger image is downscaled first
const CANVAS_TYPES = ["image/png", "image/jpeg", "image/webp"]; // what a canvas writes back
const SENT_AS_IS = [...CANVAS_TYPES, "image/gif", "image/bmp"]; // others (SVG, ...) go as PNG

// A user message's content: the text alone, or its images' `image_url` parts and then the text.
function userContent(text, images) {
  if (!images.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (text.trim()) parts.push({ type: "text", text });
  return parts;
}

function acceptsImages() {
  return document.documentElement.dataset.acceptsImages === "true";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function setStatus(text) {
  $("status").textContent = text;
}

// The message of an error response: the OpenAI body's error.message, else the status line.
async function errorMessage(res) {
  let message = `${res.status} ${res.statusText}`.trim();
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) message = `${res.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return message;
}

async function loadModels() {
  const select = $("model");
  const previous = select.value;
  let res;
  try {
    res = await fetch("v1/models", { headers: headers() });
  } catch (err) {
    setStatus(`cannot reach the server: ${err.message}`);
    return;
  }
  select.replaceChildren();
  if (!res.ok) {
    const option = new Option(res.status === 401 ? "(enter the API key)" : "(no models)", "");
    select.append(option);
    setStatus(res.status === 401 ? "this server needs an API key" : await errorMessage(res));
    return;
  }
  const { data } = await res.json();
  for (const card of data) {
    const label = card.parent ? `${card.id} (adapter on ${card.parent})` : card.id;
    select.append(new Option(label, card.id));
  }
  if (data.some((card) => card.id === previous)) select.value = previous;
  setStatus(data.length ? "ready" : "no models served");
}

// The request's response_format, or null; throws with a message for a schema that is no JSON.
function responseFormat() {
  const kind = $("format").value;
  if (kind === "json_object") return { type: "json_object" };
  if (kind !== "json_schema") return null;
  let schema;
  try {
    schema = JSON.parse($("schema").value);
  } catch (err) {
    throw new Error(`JSON schema: not valid JSON (${err.message})`);
  }
  return { type: "json_schema", json_schema: { name: "playground", schema } };
}

function numberField(id, body, key) {
  const text = $(id).value.trim();
  if (text !== "") body[key] = Number(text);
}

let emptyHint = null; // "Send a message to start", shown while the conversation is empty

function addMessage(role, text, images = []) {
  emptyHint.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  if (images.length) {
    const row = document.createElement("div");
    row.className = "images";
    for (const url of images) {
      const img = document.createElement("img");
      img.src = url;
      img.alt = "attached image";
      row.append(img);
    }
    el.append(row);
  }
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  const note = document.createElement("span");
  note.className = "note";
  el.append(reasoning, body, note);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function showError(el, message) {
  el.classList.add("error");
  el.dataset.state = "error";
  el.querySelector(".reasoning").textContent = "";
  el.querySelector(".text").textContent = message;
}

function formatStats(s, now) {
  const parts = [`${s.tokens} token${s.tokens === 1 ? "" : "s"}`];
  if (s.first !== null && s.tokens > 1 && now > s.first) {
    parts.push(`${((s.tokens - 1) / ((now - s.first) / 1000)).toFixed(1)} tok/s`);
  }
  if (s.first !== null) parts.push(`TTFT ${Math.round(s.first - s.start)} ms`);
  if (s.finish) parts.push(`finish: ${s.finish}`);
  return parts.join(" · ");
}

// Reads `data:` events off the stream until [DONE]: onEvent with each parsed chunk, onRead
// after each read's events (one repaint for what arrived together).
async function readEvents(res, onEvent, onRead) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) onEvent(JSON.parse(data));
    }
    onRead();
  }
}

// The image of `file` as a data URL, downscaled to MAX_IMAGE_SIDE on its long side (and drawn
// as a PNG where its type is one the server may not read).
function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onerror = () => reject(new Error(`${file.name}: could not be read`));
    reader.onload = () => {
      const img = new Image();
      img.onerror = () => reject(new Error(`${file.name || "the image"}: not an image this browser can show`));
      img.onload = () => {
        const side = Math.max(img.naturalWidth, img.naturalHeight);
        if (!side) return reject(new Error(`${file.name || "the image"}: it has no size`));
        const scale = Math.min(1, MAX_IMAGE_SIDE / side);
        if (scale === 1 && SENT_AS_IS.includes(file.type)) return resolve(reader.result);
        const canvas = document.createElement("canvas");
        canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
        canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
        canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
        resolve(canvas.toDataURL(CANVAS_TYPES.includes(file.type) ? file.type : "image/png"));
      };
      img.src = reader.result;
    };
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!images.length) return false;
  if (!acceptsImages()) {
    setStatus("the served model takes no images");
    return true;
  }
  for (const file of images) {
    try {
      pending.push(await readImage(file));
    } catch (err) {
      setStatus(err.message);
    }
  }
  showAttachments();
  return true;
}

function showAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  pending.forEach((url, i) => {
    const thumb = document.createElement("div");
    thumb.className = "thumb";
    const img = document.createElement("img");
    img.src = url;
    img.alt = `image ${i + 1} to send`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.title = "Remove this image";
    remove.textContent = "×";
    remove.addEventListener("click", () => {
      pending.splice(i, 1);
      showAttachments();
    });
    thumb.append(img, remove);
    box.append(thumb);
  });
  box.hidden = pending.length === 0;
}

function setUpImages() {
  // A file dropped beside the conversation would replace the page (and the conversation) by it.
  for (const type of ["dragover", "drop"]) {
    document.addEventListener(type, (event) => {
      if (event.dataTransfer && [...event.dataTransfer.types].includes("Files")) event.preventDefault();
    });
  }
  const attach = $("attach");
  if (!acceptsImages()) {
    attach.disabled = true;
    attach.title = "The served model takes no images: it is a text-only model";
    return;
  }
  attach.disabled = false;
  attach.addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", async (event) => {
    await attachFiles(event.target.files);
    event.target.value = "";
  });
  $("prompt").addEventListener("paste", (event) => {
    const files = event.clipboardData ? event.clipboardData.files : [];
    if ([...files].some((f) => f.type.startsWith("image/"))) {
      event.preventDefault();
      attachFiles(files);
    }
  });
  const chat = $("chat");
  chat.addEventListener("dragover", (event) => {
    if (![...event.dataTransfer.types].includes("Files")) return;
    event.preventDefault();
    chat.classList.add("dropping");
  });
  chat.addEventListener("dragleave", (event) => {
    if (!chat.contains(event.relatedTarget)) chat.classList.remove("dropping");
  });
  chat.addEventListener("drop", (event) => {
    chat.classList.remove("dropping");
    if (!event.dataTransfer.files.length) return;
    event.preventDefault();
    attachFiles(event.dataTransfer.files);
  });
}

async function send() {
  const text = $("prompt").value;
  if ((!text.trim() && !pending.length) || running) return;
  let format;
  try {
    format = responseFormat();
  } catch (err) {
    showError(addMessage("assistant", ""), err.message);
    return;
  }
  const model = $("model").value;
  const conversation = epoch;
  const images = pending.splice(0);
  showAttachments();
  addMessage("user", text, images);
  const reply = addMessage("assistant", "");
  $("prompt").value = "";
  history.push({ role: "user", content: userContent(text, images) });
  const system = $("system").value.trim();
  const body = {
    model,
    messages: system ? [{ role: "system", content: system }, ...history] : [...history],
    stream: true,
    stream_options: { include_usage: true },
  };
  numberField("temperature", body, "temperature");
  numberField("top-p", body, "top_p");
  numberField("max-tokens", body, "max_tokens");
  if (format) body.response_format = format;

  const stats = { start: performance.now(), first: null, tokens: 0, finish: null };
  const textEl = reply.querySelector(".text");
  const reasoningEl = reply.querySelector(".reasoning");
  let answer = "";
  let reasoning = "";
  const render = () => {
    reasoningEl.textContent = reasoning;
    textEl.textContent = answer;
    $("stats").textContent = formatStats(stats, performance.now());
    reply.scrollIntoView({ block: "end" });
  };
  running = new AbortController();
  reply.dataset.state = "streaming";
  $("send").disabled = true;
  $("stop").disabled = false;
  $("stats").textContent = "";
  setStatus("generating…");
  try {
    const res = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal,
    });
    if (!res.ok) throw new Error(await errorMessage(res));
    let usageTokens = null;
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.usage) usageTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content) {
          if (stats.first === null) stats.first = performance.now();
          stats.tokens += 1;
        }
        if (delta.reasoning_content) reasoning += delta.reasoning_content;
        if (delta.content) answer += delta.content;
        if (choice.finish_reason) stats.finish = choice.finish_reason;
      }
    }, render);
    if (usageTokens !== null) stats.tokens = usageTokens;
    render();
    reply.dataset.state = "done";
    if (conversation === epoch) history.push({ role: "assistant", content: answer });
    setStatus("ready");
  } catch (err) {
    if (err.name === "AbortError") {
      render();
      reply.dataset.state = "stopped";
      reply.querySelector(".note").textContent = "(stopped)";
      stats.finish = "stopped";
      if (conversation === epoch) history.push({ role: "assistant", content: answer });
      setStatus("stopped");
    } else {
      showError(reply, err.message);
      // The turn did not happen: its message goes back into the box, to edit and send again.
      if (conversation === epoch) history.pop();
      if (!$("prompt").value) $("prompt").value = text;
      if (!pending.length) {
        pending.push(...images);
        showAttachments();
      }
      setStatus("error");
    }
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    if (!reply.classList.contains("error") && conversation === epoch) {
      $("stats").textContent = formatStats(stats, performance.now());
    }
  }
}

function stop() {
  if (running) running.abort();
}

function clearChat() {
  stop();
  epoch += 1;
  history.length = 0;
  pending.length = 0;
  showAttachments();
  $("messages").replaceChildren(emptyHint);
  $("stats").textContent = "";
  $("prompt").focus();
}

async function hideDocsLinkIfOff() {
  const link = document.querySelector('header a[href="docs"]');
  try {
    const res = await fetch("docs", { method: "HEAD" });
    if (!res.ok) link.hidden = true;
  } catch (_) {
    link.hidden = true;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  emptyHint = $("empty");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    } else if (event.key === "Escape") {
      stop();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  $("api-key").addEventListener("change", loadModels);
  $("format").addEventListener("change", () => {
    $("schema-box").hidden = $("format").value !== "json_schema";
  });
  setUpImages();
  loadModels();
  hideDocsLinkIfOff();
  $("prompt").focus();
});
