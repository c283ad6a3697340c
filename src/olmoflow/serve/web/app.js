// The olmoflow chat page: a client of the server's own OpenAI-compatible API.
//
// Each turn sends the whole conversation (system prompt first, when one is set) to
// POST /v1/chat/completions with stream=true and renders the Server-Sent Events as they arrive
// (OpenAI's chat.completion.chunk format: data: {"choices":[{"delta":{"content":...}}]} ...
// data: [DONE]). Model text is only ever put into the page with textContent, never parsed as HTML.
"use strict";

(() => {
  const API_KEY_STORAGE = "olmoflow.apiKey";

  const $ = (id) => document.getElementById(id);
  const ui = {
    modelName: $("model-name"),
    newChat: $("new-chat"),
    system: $("system"),
    temperature: $("temperature"),
    topP: $("top-p"),
    maxTokens: $("max-tokens"),
    seed: $("seed"),
    apiKey: $("api-key"),
    conversation: $("conversation"),
    emptyHint: $("empty-hint"),
    error: $("error"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
  };

  // The conversation sent each turn: [{role: "user"|"assistant", content: string}, ...].
  let history = [];
  let modelId = null;
  // The AbortController of the reply being streamed; null when idle.
  let inFlight = null;
  // Bumped by New chat, so that a reply still finishing belongs to no conversation.
  let conversationId = 0;

  // ---- small helpers ---------------------------------------------------------------------

  function authHeaders() {
    const key = ui.apiKey.value.trim();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  // source: "models" for the model list (cleared once it loads), "chat" for a reply.
  function showError(message, source = "chat") {
    ui.error.textContent = message;
    ui.error.dataset.source = source;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.textContent = "";
    ui.error.dataset.source = "";
    ui.error.hidden = true;
  }

  // The message of an OpenAI-shaped error body {"error": {"message": ...}}, else a fallback.
  function errorMessage(body, fallback) {
    if (body && typeof body === "object" && body.error) {
      if (typeof body.error === "string") return body.error;
      if (typeof body.error.message === "string" && body.error.message) return body.error.message;
    }
    if (body && typeof body === "object" && typeof body.detail === "string") return body.detail;
    return fallback;
  }

  // The message of a failed response; a body that is not JSON (a proxy's HTML page) is cut.
  async function readError(response) {
    const fallback = `HTTP ${response.status} ${response.statusText}`.trim();
    let text = "";
    try {
      text = await response.text();
      return errorMessage(JSON.parse(text), fallback);
    } catch (_) {
      return text ? `${fallback}: ${text.slice(0, 300)}` : fallback;
    }
  }

  // A number from an <input type=number>; undefined when empty (the server's default applies).
  // An entry the browser cannot read as a number is sent as text so the server names the field.
  function numberField(input, parse) {
    const raw = input.value.trim();
    if (raw === "") {
      return input.validity && input.validity.badInput ? "invalid" : undefined;
    }
    const value = parse(raw);
    return Number.isFinite(value) ? value : raw;
  }

  function nearBottom() {
    const c = ui.conversation;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 48;
  }

  function scrollToEnd() {
    ui.conversation.scrollTop = ui.conversation.scrollHeight;
  }

  function setBusy(busy) {
    ui.send.disabled = busy;
    ui.stop.disabled = !busy;
    ui.conversation.setAttribute("aria-busy", busy ? "true" : "false");
  }

  // A message bubble; returns {root, text, note} so a reply can be filled in while it streams.
  function addBubble(role, content) {
    ui.emptyHint.hidden = true;
    const root = document.createElement("article");
    root.className = `msg msg-${role}`;
    const who = document.createElement("h2");
    who.className = "msg-role";
    who.textContent = role === "user" ? "You" : "Assistant";
    const text = document.createElement("div");
    text.className = "msg-text";
    text.textContent = content;
    const note = document.createElement("p");
    note.className = "msg-note";
    note.hidden = true;
    root.append(who, text, note);
    ui.conversation.append(root);
    scrollToEnd();
    return { root, text, note };
  }

  function setNote(bubble, message) {
    bubble.note.textContent = message;
    bubble.note.hidden = false;
  }

  // ---- model name --------------------------------------------------------------------------

  async function loadModel() {
    try {
      const response = await fetch("v1/models", { headers: authHeaders() });
      if (!response.ok) {
        modelId = null;
        ui.modelName.textContent = "unavailable";
        showError(await readError(response), "models");
        return;
      }
      const body = await response.json();
      const models = Array.isArray(body.data) ? body.data : [];
      modelId = models.length ? String(models[0].id) : null;
      ui.modelName.textContent = modelId || "none";
      ui.modelName.title = modelId || "";
      if (ui.error.dataset.source === "models") clearError();
    } catch (err) {
      modelId = null;
      ui.modelName.textContent = "unavailable";
      showError(`Could not reach the server: ${err.message}`, "models");
    }
  }

  // ---- streaming ---------------------------------------------------------------------------

  // Splits an SSE byte stream into events. Reads may end anywhere, even inside a UTF-8
  // character or a JSON object: text is decoded in streaming mode and only complete events
  // (terminated by a blank line) are handed on; the rest waits for the next read.
  class SSEParser {
    constructor(onData) {
      this.decoder = new TextDecoder("utf-8");
      this.buffer = "";
      this.onData = onData;
    }

    push(bytes) {
      this.buffer += this.decoder.decode(bytes, { stream: true });
      this.drain();
    }

    end() {
      this.buffer += this.decoder.decode();
      this.drain();
      if (this.buffer.trim()) this.dispatch(this.buffer);
      this.buffer = "";
    }

    drain() {
      for (;;) {
        const match = /\r\n\r\n|\n\n|\r\r/.exec(this.buffer);
        if (!match) return;
        const event = this.buffer.slice(0, match.index);
        this.buffer = this.buffer.slice(match.index + match[0].length);
        this.dispatch(event);
      }
    }

    dispatch(event) {
      const data = [];
      for (const line of event.split(/\r\n|\n|\r/)) {
        if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
        // Comments (":" lines), "event:", "id:" and "retry:" carry nothing we use.
      }
      if (data.length) this.onData(data.join("\n"));
    }
  }

  function buildRequest() {
    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: ui.system.value });
    messages.push(...history);
    const body = { messages, stream: true };
    if (modelId) body.model = modelId;
    const temperature = numberField(ui.temperature, parseFloat);
    const topP = numberField(ui.topP, parseFloat);
    const maxTokens = numberField(ui.maxTokens, (s) => Number(s));
    const seed = numberField(ui.seed, (s) => Number(s));
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    if (seed !== undefined) body.seed = seed;
    return body;
  }

  async function sendMessage() {
    const content = ui.prompt.value;
    if (inFlight || !content.trim()) return;
    clearError();
    if (!modelId) await loadModel();

    history.push({ role: "user", content });
    const userBubble = addBubble("user", content);
    const reply = addBubble("assistant", "");
    reply.root.classList.add("msg-streaming");
    ui.prompt.value = "";

    const controller = new AbortController();
    const conversation = conversationId;
    inFlight = controller;
    setBusy(true);

    let text = "";
    let finish = null;
    let failure = null;

    const onData = (data) => {
      if (data === "[DONE]") {
        finish = finish || "stop";
        return;
      }
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch (_) {
        failure = failure || "The server sent a malformed event.";
        return;
      }
      if (chunk.error) {
        failure = errorMessage(chunk, "The server reported an error.");
        return;
      }
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (typeof delta.content === "string" && delta.content) {
          const follow = nearBottom();
          text += delta.content;
          reply.text.textContent = text;
          if (follow) scrollToEnd();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    };

    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify(buildRequest()),
        signal: controller.signal,
      });
      if (!response.ok) {
        failure = await readError(response);
      } else if (!response.body) {
        failure = "This browser cannot read streamed responses.";
      } else {
        const parser = new SSEParser(onData);
        const reader = response.body.getReader();
        controller.signal.addEventListener("abort", () => reader.cancel().catch(() => {}));
        for (;;) {
          const { value, done } = await reader.read();
          if (controller.signal.aborted) break;
          if (done) {
            parser.end();
            break;
          }
          parser.push(value);
          if (failure) {
            reader.cancel().catch(() => {});
            break;
          }
        }
      }
    } catch (err) {
      if (!controller.signal.aborted) failure = `Request failed: ${err.message}`;
    }

    if (conversation !== conversationId) return;  // New chat was pressed meanwhile.
    const stopped = controller.signal.aborted;
    inFlight = null;
    reply.root.classList.remove("msg-streaming");

    if (text) {
      // Whatever arrived stays in the conversation, also after Stop or an error mid-reply.
      history.push({ role: "assistant", content: text });
      if (stopped) setNote(reply, "stopped");
      else if (failure) setNote(reply, "interrupted");
      else if (finish === "length") setNote(reply, "cut at the token limit");
      else if (finish !== "stop") setNote(reply, "the stream ended early");
    } else {
      // Nothing was answered: take the turn back so the user can change it or the settings.
      history.pop();
      userBubble.root.remove();
      reply.root.remove();
      if (!ui.prompt.value) ui.prompt.value = content;
      ui.emptyHint.hidden = history.length > 0;
      if (!failure && !stopped && finish) failure = "The model returned an empty reply.";
    }
    if (failure) showError(failure);
    setBusy(false);
    ui.prompt.focus();
  }

  function stopReply() {
    if (inFlight) inFlight.abort();
  }

  function newChat() {
    stopReply();
    inFlight = null;
    conversationId += 1;
    setBusy(false);
    history = [];
    for (const node of [...ui.conversation.querySelectorAll(".msg")]) node.remove();
    ui.emptyHint.hidden = false;
    clearError();
    ui.prompt.value = "";
    ui.prompt.focus();
  }

  // ---- wiring ------------------------------------------------------------------------------

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    sendMessage();
  });

  ui.prompt.addEventListener("keydown", (event) => {
    // Enter sends; Shift+Enter (and Enter while an input method is composing) inserts a newline.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!ui.send.disabled) sendMessage();
    }
  });

  // Enter in a settings field must not reload the page.
  $("settings-form").addEventListener("submit", (event) => event.preventDefault());

  ui.stop.addEventListener("click", stopReply);
  ui.newChat.addEventListener("click", newChat);

  try {
    ui.apiKey.value = window.localStorage.getItem(API_KEY_STORAGE) || "";
  } catch (_) {
    // Storage can be disabled (private mode, file policy); the field still works for this page.
  }
  ui.apiKey.addEventListener("change", () => {
    try {
      const key = ui.apiKey.value.trim();
      if (key) window.localStorage.setItem(API_KEY_STORAGE, key);
      else window.localStorage.removeItem(API_KEY_STORAGE);
    } catch (_) {
      // See above: not being able to remember the key is not an error.
    }
    loadModel();
  });

  setBusy(false);
  loadModel();
  ui.prompt.focus();
})();
