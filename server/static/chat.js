// The chat: multi-turn history, streamed replies from /v1/chat/completions, stop button.

import { apiFetch, errorMessage, readEvents } from "./api.js";

export function createChat(els) {
  const history = []; // [{role, content}] without the system prompt
  let controller = null;

  function addBubble(role, text) {
    const bubble = document.createElement("div");
    bubble.className = `msg ${role}`;
    const body = document.createElement("div");
    body.className = "msg-body";
    body.textContent = text;
    const meta = document.createElement("div");
    meta.className = "msg-meta";
    bubble.append(body, meta);
    els.messages.append(bubble);
    els.messages.scrollTop = els.messages.scrollHeight;
    return { bubble, body, meta };
  }

  function requestBody() {
    const system = els.systemPrompt.value.trim();
    const messages = system ? [{ role: "system", content: system }, ...history] : [...history];
    return {
      model: els.model.value || undefined,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number(els.temperature.value),
      max_tokens: Number(els.maxTokens.value),
      ...(els.ignoreEos.checked ? { ignore_eos: true } : {}),
    };
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.disabled = !busy;
    els.newChat.disabled = busy;
  }

  function describe(stats) {
    const seconds = (performance.now() - stats.start) / 1000;
    const parts = [];
    if (stats.tokens) parts.push(`${stats.tokens} tokens`);
    if (stats.tokens && seconds > 0) parts.push(`${(stats.tokens / seconds).toFixed(1)} tok/s`);
    if (stats.cached) parts.push(`${stats.cached} prompt tokens from the prefix cache`);
    if (stats.finish) parts.push(`finish: ${stats.finish}`);
    return parts.join(" · ");
  }

  function applyChunk(chunk, view, stats) {
    const choice = chunk.choices?.[0];
    if (choice?.delta?.content) {
      view.body.textContent += choice.delta.content;
      stats.chunks += 1;
      els.messages.scrollTop = els.messages.scrollHeight;
    }
    if (choice?.finish_reason) stats.finish = choice.finish_reason;
    if (chunk.usage) {
      stats.tokens = chunk.usage.completion_tokens;
      stats.cached = chunk.usage.prompt_tokens_details?.cached_tokens || 0;
    }
  }

  async function streamReply(view, signal) {
    const stats = { start: performance.now(), chunks: 0, tokens: 0, cached: 0, finish: "" };
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    view.bubble.classList.add("streaming");
    await readEvents(response, ({ data }) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      applyChunk(chunk, view, stats);
      view.meta.textContent = describe(stats);
    });
    return stats;
  }

  async function send(text) {
    if (!text.trim() || controller) return;
    history.push({ role: "user", content: text });
    addBubble("user", text);
    const view = addBubble("assistant", "");
    controller = new AbortController();
    setBusy(true);
    try {
      await streamReply(view, controller.signal);
      history.push({ role: "assistant", content: view.body.textContent });
    } catch (err) {
      const stopped = err.name === "AbortError";
      view.bubble.classList.add(stopped ? "stopped" : "failed");
      view.meta.textContent = stopped ? "stopped" : `error: ${err.message}`;
      if (view.body.textContent) history.push({ role: "assistant", content: view.body.textContent });
      else history.pop(); // the question had no answer: do not send it again
    } finally {
      view.bubble.classList.remove("streaming");
      view.bubble.classList.add("done");
      controller = null;
      setBusy(false);
    }
  }

  function stop() {
    if (controller) controller.abort();
  }

  function reset() {
    stop();
    history.length = 0;
    els.messages.replaceChildren();
  }

  return { send, stop, reset, history };
}
