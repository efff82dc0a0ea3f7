// The chat: multi-turn history, streamed replies from /v1/chat/completions, stop button.
// A reply is rendered as Markdown (markdown.js: DOM nodes only, nothing from the model runs);
// its reasoning (`reasoning_content` / `reasoning` deltas) and tool calls are shown apart.

import { apiFetch, errorMessage, readEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

export function createChat(els) {
  const history = []; // [{role, content}] without the system prompt
  let controller = null;

  function div(className) {
    const node = document.createElement("div");
    node.className = className;
    return node;
  }

  function addBubble(role, text) {
    const bubble = div(`msg ${role}`);
    const body = div(role === "assistant" ? "msg-body md" : "msg-body");
    body.textContent = text;
    const meta = div("msg-meta");
    const tools = div("tool-calls");
    bubble.append(body, tools, meta);
    els.messages.append(bubble);
    els.messages.scrollTop = els.messages.scrollHeight;
    return { bubble, body, meta, tools, text, reasoning: null, calls: [], pending: false };
  }

  function reasoningBox(view) {
    if (view.reasoning) return view.reasoning;
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const body = div("reasoning-body");
    details.append(summary, body);
    view.bubble.insertBefore(details, view.body);
    view.reasoning = { details, body };
    return view.reasoning;
  }

  function addToolCallDelta(view, delta) {
    const i = delta.index ?? view.calls.length;
    if (!view.calls[i]) {
      const box = div("tool-call");
      const name = div("tool-call-name");
      const args = document.createElement("pre");
      args.className = "tool-call-args";
      box.append(name, args);
      view.tools.append(box);
      view.calls[i] = { name: "", args: "", nameEl: name, argsEl: args };
    }
    const call = view.calls[i];
    call.name += delta.function?.name || "";
    call.args += delta.function?.arguments || "";
    call.nameEl.textContent = `tool call: ${call.name}`;
    call.argsEl.textContent = call.args;
  }

  function render(view) {
    // NOTE: one Markdown render per animation frame, however many deltas arrive
    if (view.pending) return;
    view.pending = true;
    requestAnimationFrame(() => {
      view.pending = false;
      renderMarkdown(view.body, view.text);
      els.messages.scrollTop = els.messages.scrollHeight;
    });
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
    const delta = choice?.delta || {};
    const thought = delta.reasoning_content ?? delta.reasoning;
    if (thought) reasoningBox(view).body.textContent += thought;
    if (delta.content) {
      if (view.reasoning && !view.text) view.reasoning.details.open = false;
      view.text += delta.content;
      view.bubble.dataset.raw = view.text; // the reply as the model wrote it (Markdown source)
      stats.chunks += 1;
      render(view);
    }
    for (const call of delta.tool_calls || []) addToolCallDelta(view, call);
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
      history.push({ role: "assistant", content: view.text });
    } catch (err) {
      const stopped = err.name === "AbortError";
      view.bubble.classList.add(stopped ? "stopped" : "failed");
      view.meta.textContent = stopped ? "stopped" : `error: ${err.message}`;
      if (view.text) history.push({ role: "assistant", content: view.text });
      else history.pop(); // the question had no answer: do not send it again
    } finally {
      renderMarkdown(view.body, view.text);
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
