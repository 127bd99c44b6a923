// lmserve's chat page: plain JavaScript, no build step. It talks to the server it was loaded from:
// GET /v1/models (the picker; the model the server serves comes first), POST /api/show (vision capability),
// POST /v1/chat/completions (streamed SSE).
// Chats, the chosen model, the settings and the API key live in this browser's localStorage.

import { marked } from "./vendor/marked.esm.js";

const DOMPurify = window.DOMPurify; // vendor/purify.min.js, loaded by index.html before this module
const STORAGE_PREFIX = "lmserve.";
const NEW_TITLE = "New chat";
const RENDER_EVERY_MS = 40;

const $ = (id) => document.getElementById(id);
const els = {
  newChat: $("new-chat"),
  chatList: $("chat-list"),
  sidebar: $("sidebar"),
  toggleSidebar: $("toggle-sidebar"),
  model: $("model"),
  system: $("system-prompt"),
  temperature: $("temperature"),
  maxTokens: $("max-tokens"),
  changeKey: $("change-key"),
  error: $("error"),
  messages: $("messages"),
  empty: $("empty"),
  composer: $("composer"),
  attachments: $("attachments"),
  attach: $("attach"),
  attachLabel: $("attach-label"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  keyReason: $("key-reason"),
  apiKey: $("api-key"),
  keyCancel: $("key-cancel"),
};

// ---- storage ------------------------------------------------------------------------------------------------------

const store = {
  get(key, fallback) {
    try {
      const value = localStorage.getItem(STORAGE_PREFIX + key);
      return value === null ? fallback : JSON.parse(value);
    } catch {
      return fallback;
    }
  },
  set(key, value) {
    localStorage.setItem(STORAGE_PREFIX + key, JSON.stringify(value));
  },
};

let chats = store.get("chats", []); // [{id, title, messages: [{role, content, images?, reasoning?, ...}], updated}]
let currentId = store.get("current", null);
let pending = []; // data URLs of the images attached to the next message
let controller = null; // the AbortController of the answer being streamed
const vision = new Map(); // model → whether it takes images (from /api/show)
let served = null; // the model the server serves: the first that GET /v1/models lists

function saveChats() {
  try {
    store.set("chats", chats);
  } catch {
    // localStorage is full (images are big): keep the text, drop the images of all but the current chat.
    const slim = chats.map((chat) => (chat.id === currentId ? chat : {
      ...chat, messages: chat.messages.map(({ images, ...rest }) => rest),
    }));
    try {
      store.set("chats", slim);
    } catch {
      showError("This browser's storage is full: delete some chats to keep new ones.");
    }
  }
  store.set("current", currentId);
}

// ---- Markdown -----------------------------------------------------------------------------------------------------

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Markdown to sanitised HTML: marked (GitHub-flavoured) then DOMPurify, so no script or handler survives. */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text ?? "", { gfm: true, async: false }));
}

window.lmserveChat = { renderMarkdown }; // for the browser tests and the console

// ---- HTTP ---------------------------------------------------------------------------------------------------------

function authHeaders() {
  const key = store.get("apiKey", "");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** The message of an error response: the OpenAI shape's error.message, the native error string, or the text. */
async function errorText(response) {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body.detail;
    if (typeof error === "string") return error;
    if (error && typeof error.message === "string") return error.message;
  } catch {
    // not JSON: the text itself
  }
  return text.trim() || response.statusText;
}

/** fetch with the API key; a 401 asks for the key and tries again; any other error status throws its message. */
async function api(path, init = {}) {
  for (;;) {
    let response;
    try {
      response = await fetch(path, { ...init, headers: { ...(init.headers ?? {}), ...authHeaders() } });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new Error(`Cannot reach the server at ${location.origin}: is lmserve running?`);
    }
    if (response.ok) return response;
    const message = await errorText(response);
    if (response.status === 401 && (await askForKey(message))) continue;
    throw new Error(`Error ${response.status}: ${message}`);
  }
}

function postJson(path, body, signal) {
  return api(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal });
}

/** The parsed `data:` payloads of a server-sent event stream, until `[DONE]`. */
async function* sseEvents(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// ---- the API key --------------------------------------------------------------------------------------------------

let keyPrompt = null;

/** Ask for the API key in a dialog; true once one is saved, false when the dialog is cancelled. */
function askForKey(reason) {
  if (keyPrompt) return keyPrompt;
  keyPrompt = new Promise((resolve) => {
    const done = (saved) => {
      els.keyForm.onsubmit = null;
      els.keyCancel.onclick = null;
      els.keyDialog.oncancel = null;
      if (els.keyDialog.open) els.keyDialog.close();
      keyPrompt = null;
      resolve(saved);
    };
    els.keyReason.textContent = reason || "This server needs an API key.";
    els.apiKey.value = "";
    els.keyForm.onsubmit = (event) => {
      event.preventDefault();
      const key = els.apiKey.value.trim();
      if (!key) return;
      store.set("apiKey", key);
      done(true);
    };
    els.keyCancel.onclick = () => done(false);
    els.keyDialog.oncancel = (event) => {
      event.preventDefault();
      done(false);
    };
    els.keyDialog.showModal();
    els.apiKey.focus();
  });
  return keyPrompt;
}

// ---- errors -------------------------------------------------------------------------------------------------------

function showError(message) {
  els.error.textContent = message;
  els.error.hidden = false;
}

function hideError() {
  els.error.hidden = true;
  els.error.textContent = "";
}

// ---- models -------------------------------------------------------------------------------------------------------

async function loadModels() {
  let ids;
  try {
    const body = await (await api("/v1/models")).json();
    ids = body.data.map((model) => model.id);
  } catch (err) {
    showError(`Could not list the models. ${err.message}`);
    return;
  }
  els.model.replaceChildren(...ids.map((id) => new Option(id, id)));
  served = ids[0] ?? null;
  els.model.value = initialModel(ids, store.get("model", null));
  if (!ids.length) showError("The server lists no models: pull one with `lmserve pull NAME`.");
  hideErrorIfAbout("Could not list the models");
  await modelChosen();
}

/** The model the page starts on: the one chosen here before, while the server still serves what it served then
 * (a reload keeps the choice); else, as on a first visit or after a restart with another model, the served one. */
function initialModel(ids, saved) {
  const kept = saved !== null && typeof saved === "object" && saved.served === served && ids.includes(saved.model);
  return kept ? saved.model : (served ?? "");
}

function hideErrorIfAbout(prefix) {
  if (els.error.textContent.startsWith(prefix)) hideError();
}

/** Remember the chosen model and allow image attachments only when it takes images. */
async function modelChosen() {
  const model = els.model.value;
  if (!model) return;
  store.set("model", { model, served });
  if (!vision.has(model)) {
    try {
      const show = await (await postJson("/api/show", { model })).json();
      vision.set(model, (show.capabilities ?? []).includes("vision"));
    } catch {
      vision.set(model, false);
    }
  }
  if (els.model.value !== model) return; // another model was chosen meanwhile
  const takesImages = vision.get(model);
  els.attach.disabled = !takesImages;
  els.attachLabel.classList.toggle("disabled", !takesImages);
  els.attachLabel.title = takesImages ? "Attach an image" : `${model} does not take images`;
  if (!takesImages && pending.length) {
    pending = [];
    renderAttachments();
  }
}

// ---- settings -----------------------------------------------------------------------------------------------------

function loadSettings() {
  const settings = store.get("settings", {});
  els.system.value = settings.system ?? "";
  els.temperature.value = settings.temperature ?? "";
  els.maxTokens.value = settings.maxTokens ?? "";
}

function saveSettings() {
  store.set("settings", {
    system: els.system.value, temperature: els.temperature.value, maxTokens: els.maxTokens.value,
  });
}

// ---- chats --------------------------------------------------------------------------------------------------------

function currentChat() {
  return chats.find((chat) => chat.id === currentId) ?? null;
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function newChat() {
  const current = currentChat();
  if (current && !current.messages.length) return current; // already on an empty chat
  const chat = { id: newId(), title: NEW_TITLE, messages: [], updated: Date.now() };
  chats.unshift(chat);
  currentId = chat.id;
  saveChats();
  render();
  return chat;
}

function switchChat(id) {
  if (controller) return; // finish or stop the answer first
  currentId = id;
  saveChats();
  render();
  els.sidebar.classList.remove("open");
}

function deleteChat(id) {
  if (controller && id === currentId) controller.abort();
  chats = chats.filter((chat) => chat.id !== id);
  if (id === currentId) currentId = chats[0]?.id ?? null;
  saveChats();
  render();
}

function titleOf(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 40 ? `${line.slice(0, 40)}…` : line || "Image";
}

// ---- rendering ----------------------------------------------------------------------------------------------------

function render() {
  renderChatList();
  renderMessages();
}

function renderChatList() {
  const items = chats.map((chat) => {
    const item = document.createElement("li");
    item.className = "chat-item";
    item.dataset.id = chat.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "chat-title";
    open.textContent = chat.title;
    if (chat.id === currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => switchChat(chat.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "chat-delete";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete chat: ${chat.title}`);
    remove.addEventListener("click", () => deleteChat(chat.id));
    item.append(open, remove);
    return item;
  });
  els.chatList.replaceChildren(...items);
}

function renderMessages() {
  const chat = currentChat();
  const views = (chat?.messages ?? []).map((message) => messageView(message));
  els.messages.replaceChildren(els.empty, ...views);
  els.empty.hidden = views.length > 0;
  els.messages.scrollTop = els.messages.scrollHeight;
}

function messageView(message) {
  const view = document.createElement("article");
  view.className = `message ${message.role}`;
  if (message.role === "user") {
    if (message.images?.length) {
      const images = document.createElement("div");
      images.className = "message-images";
      for (const url of message.images) {
        const img = document.createElement("img");
        img.src = url;
        img.alt = "attached image";
        images.append(img);
      }
      view.append(images);
    }
    const text = document.createElement("div");
    text.className = "content plain";
    text.textContent = message.content;
    view.append(text);
    return view;
  }
  const head = document.createElement("div");
  head.className = "message-head";
  const content = document.createElement("div");
  content.className = "content markdown";
  const stats = document.createElement("div");
  stats.className = "stats";
  view.append(head, content, stats);
  fillAnswer(view, message, false);
  return view;
}

/** Show an answer's reasoning (folded), text, state, and per-answer numbers in its view. */
function fillAnswer(view, answer, streaming) {
  const state = streaming ? "streaming" : answer.error ? "error" : answer.stopped ? "stopped" : "done";
  view.dataset.state = state;
  view.querySelector(".message-head").textContent = answer.model ?? "";
  let details = view.querySelector("details.reasoning");
  if (answer.reasoning) {
    if (!details) {
      details = document.createElement("details");
      details.className = "reasoning";
      details.append(document.createElement("summary"), document.createElement("div"));
      details.lastChild.className = "reasoning-body markdown";
      view.querySelector(".message-head").after(details);
    }
    details.firstChild.textContent = streaming && !answer.content ? "Thinking…" : "Thought";
    details.lastChild.innerHTML = renderMarkdown(answer.reasoning);
  }
  view.querySelector(".content").innerHTML = renderMarkdown(answer.content);
  const stats = view.querySelector(".stats");
  stats.replaceChildren();
  const add = (className, text) => {
    const span = document.createElement("span");
    span.className = className;
    span.textContent = text;
    stats.append(span);
  };
  if (streaming) add("status", "…");
  if (answer.stats?.tps != null) add("tps", `${answer.stats.tps.toFixed(1)} tokens/s`);
  if (answer.stats?.ttft_ms != null) add("ttft", `TTFT ${answer.stats.ttft_ms} ms`);
  if (answer.stats?.tokens != null) add("tokens", `${answer.stats.tokens} tokens`);
  if (answer.stopped) add("status", "stopped");
  if (answer.error) add("status error-text", answer.error);
}

function renderAttachments() {
  const thumbs = pending.map((url, index) => {
    const thumb = document.createElement("figure");
    thumb.className = "thumb";
    const img = document.createElement("img");
    img.src = url;
    img.alt = `image ${index + 1}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove image ${index + 1}`);
    remove.addEventListener("click", () => {
      pending.splice(index, 1);
      renderAttachments();
    });
    thumb.append(img, remove);
    return thumb;
  });
  els.attachments.replaceChildren(...thumbs);
  els.attachments.hidden = !thumbs.length;
}

function nearBottom() {
  const box = els.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

// ---- sending and streaming ------------------------------------------------------------------------------------------

function requestMessages(history) {
  const out = [];
  if (els.system.value.trim()) out.push({ role: "system", content: els.system.value.trim() });
  for (const message of history) {
    if (message.role === "user") {
      const content = message.images?.length
        ? [...(message.content ? [{ type: "text", text: message.content }] : []),
          ...message.images.map((url) => ({ type: "image_url", image_url: { url } }))]
        : message.content;
      out.push({ role: "user", content });
    } else if (message.content) {
      out.push({ role: "assistant", content: message.content });
    }
  }
  return out;
}

function setBusy(busy) {
  els.send.hidden = busy;
  els.stop.hidden = !busy;
  els.model.disabled = busy;
  document.body.classList.toggle("busy", busy);
}

async function send() {
  if (controller) return;
  const text = els.prompt.value.trim();
  if (!text && !pending.length) return;
  const model = els.model.value;
  if (!model) {
    showError("There is no model to answer: the server lists none (or could not be reached).");
    return;
  }
  hideError();
  const chat = currentChat() ?? newChat();
  const user = { role: "user", content: text };
  if (pending.length) user.images = pending;
  const answer = { role: "assistant", content: "", reasoning: "", model };
  chat.messages.push(user, answer);
  if (chat.title === NEW_TITLE) chat.title = titleOf(text);
  chat.updated = Date.now();
  chats = [chat, ...chats.filter((other) => other.id !== chat.id)];
  els.prompt.value = "";
  pending = [];
  renderAttachments();
  saveChats();
  render();
  const view = els.messages.lastElementChild;
  await streamAnswer(chat, answer, view, model);
}

async function streamAnswer(chat, answer, view, model) {
  controller = new AbortController();
  setBusy(true);
  fillAnswer(view, answer, true);
  const body = {
    model, messages: requestMessages(chat.messages.slice(0, -1)), stream: true, stream_options: { include_usage: true },
  };
  if (els.temperature.value !== "") body.temperature = Number(els.temperature.value);
  if (els.maxTokens.value !== "") body.max_tokens = Number(els.maxTokens.value);
  const started = performance.now();
  let first = null;
  let usage = null;
  let timer = null;
  const repaint = () => {
    timer = null;
    const follow = nearBottom();
    fillAnswer(view, answer, true);
    if (follow) els.messages.scrollTop = els.messages.scrollHeight;
  };
  try {
    const response = await postJson("/v1/chat/completions", body, controller.signal);
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message ?? JSON.stringify(event.error));
      if (event.model) answer.model = event.model;
      if (event.usage) usage = event.usage;
      const delta = event.choices?.[0]?.delta ?? {};
      const reasoning = delta.reasoning_content ?? delta.reasoning ?? "";
      if (reasoning) answer.reasoning += reasoning;
      if (delta.content) answer.content += delta.content;
      if ((reasoning || delta.content) && first === null) first = performance.now();
      if (timer === null) timer = setTimeout(repaint, RENDER_EVERY_MS);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      answer.stopped = true;
    } else {
      answer.error = err.message;
      showError(err.message);
    }
  } finally {
    clearTimeout(timer);
    answer.stats = timings(started, first, performance.now(), usage);
    controller = null;
    setBusy(false);
    chat.updated = Date.now();
    saveChats();
    if (view.isConnected) fillAnswer(view, answer, false);
    els.prompt.focus();
  }
}

const MEASURABLE_MS = 50;
/** Below this, the tokens after the first came too close together to time (a tiny model, a reply sent at once). */

/** TTFT (from sending to the first token) and tokens/s: over the tokens after the first, as they streamed, or over
 * all of them from sending when the stream was too short to time. */
function timings(started, first, end, usage) {
  const stats = {};
  if (first !== null) stats.ttft_ms = Math.round(first - started);
  const tokens = usage?.completion_tokens;
  if (tokens != null) stats.tokens = tokens;
  if (first === null || !(tokens > 0)) return stats;
  stats.tps = tokens > 1 && end - first >= MEASURABLE_MS ? (tokens - 1) / ((end - first) / 1000)
    : tokens / ((end - started) / 1000);
  return stats;
}

// ---- images -------------------------------------------------------------------------------------------------------

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      showError(`${file.name} is not an image.`);
      continue;
    }
    pending.push(await readAsDataUrl(file));
  }
  els.attach.value = "";
  renderAttachments();
}

// ---- wiring -------------------------------------------------------------------------------------------------------

els.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
els.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
els.stop.addEventListener("click", () => controller?.abort());
els.newChat.addEventListener("click", () => {
  if (controller) return;
  newChat();
  els.sidebar.classList.remove("open");
  els.prompt.focus();
});
els.toggleSidebar.addEventListener("click", () => els.sidebar.classList.toggle("open"));
els.model.addEventListener("change", () => modelChosen());
els.attach.addEventListener("change", () => attachFiles([...els.attach.files]));
els.error.addEventListener("click", hideError);
els.changeKey.addEventListener("click", async () => {
  if (await askForKey("Enter the server's API key.")) await loadModels();
});
for (const input of [els.system, els.temperature, els.maxTokens]) input.addEventListener("input", saveSettings);

if (!currentChat()) currentId = chats[0]?.id ?? null;
loadSettings();
renderAttachments();
render();
loadModels().finally(() => document.body.classList.add("ready"));
