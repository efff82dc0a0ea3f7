// Wires the page: model picker, chat form, and the live cell map fed by an SSE stream.
// With several models (llama.cpp's router cards carry a `status`), a second picker chooses
// whose cache the map shows (`?model=`); it follows the chat's model when that changes.

import { apiFetch, errorMessage, readEvents } from "./api.js";
import { createCellMap } from "./cellmap.js";
import { createCellStats } from "./cellstats.js";
import { createChat } from "./chat.js";

const STREAM_URL = "/v1/cache/cells/stream?interval_ms=250";
const RECONNECT_MS = 1000;

const $ = (id) => document.getElementById(id);

function setStatus(text, ok) {
  const status = $("conn-status");
  status.textContent = text;
  status.classList.toggle("ok", ok);
  status.classList.toggle("bad", !ok);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Retries while the server answers an error (e.g. 503 while the model loads).
async function loadModels() {
  for (;;) {
    try {
      const response = await apiFetch("/v1/models");
      if (!response.ok) throw new Error(await errorMessage(response));
      const { data } = await response.json();
      $("model").replaceChildren(...data.map((m) => new Option(m.id, m.id)));
      if (data.some((m) => m.status !== undefined)) showMapPicker(data);
      return;
    } catch (err) {
      setStatus(`models: ${err.message}`, false);
    }
    await sleep(RECONNECT_MS);
  }
}

// Router mode: every model in the map's picker, a loaded one first chosen.
function showMapPicker(models) {
  const picker = $("map-model");
  picker.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  const loaded = models.find((m) => m.status?.value === "loaded");
  picker.value = (loaded || models[0]).id;
  $("map-model-picker").hidden = false;
}

function mapStreamUrl() {
  if ($("map-model-picker").hidden) return STREAM_URL;
  return `${STREAM_URL}&model=${encodeURIComponent($("map-model").value)}`;
}

// Reconnects after an error or the end of the stream (the model unloaded), and at once
// when the map's model changes.
async function followCells(views, modelsLoaded) {
  let leaving = false;
  let connection = null;
  window.addEventListener("pagehide", () => {
    leaving = true;
    connection?.abort();
  });
  $("map-model").addEventListener("change", () => connection?.abort());
  await modelsLoaded;
  while (!leaving) {
    connection = new AbortController();
    try {
      const response = await apiFetch(mapStreamUrl(), { signal: connection.signal });
      if (!response.ok) throw new Error(await errorMessage(response));
      setStatus("live", true);
      await readEvents(response, ({ event, data }) => {
        if (event !== "cells") return;
        const snapshot = JSON.parse(data);
        for (const view of views) view.render(snapshot);
      });
      setStatus("map stream ended; reconnecting…", false);
    } catch (err) {
      if (connection.signal.aborted) continue; // another model chosen, or the page left
      setStatus(`map: ${err.message}`, false);
    }
    await sleep(RECONNECT_MS);
  }
}

function followChatModel() {
  $("model").addEventListener("change", () => {
    if ($("map-model-picker").hidden) return;
    $("map-model").value = $("model").value;
    $("map-model").dispatchEvent(new Event("change"));
  });
}

function wireChat(chat) {
  const prompt = $("prompt");
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value;
    prompt.value = "";
    chat.send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chat.stop());
  window.addEventListener("pagehide", () => chat.stop());
  $("new-chat").addEventListener("click", () => chat.reset());
}

function main() {
  const chat = createChat({
    messages: $("messages"),
    model: $("model"),
    temperature: $("temperature"),
    maxTokens: $("max-tokens"),
    ignoreEos: $("ignore-eos"),
    systemPrompt: $("system-prompt"),
    send: $("send"),
    stop: $("stop"),
    newChat: $("new-chat"),
  });
  wireChat(chat);
  const map = createCellMap({ canvas: $("cell-canvas"), tip: $("cell-tip") });
  const stats = createCellStats({
    used: $("total-used"),
    shared: $("total-shared"),
    cached: $("total-cached"),
    free: $("total-free"),
    prefixHits: $("prefix-hits"),
    contextShifts: $("context-shifts"),
    preemptions: $("preemptions"),
    specBox: $("spec-box"),
    specAccepted: $("spec-accepted"),
    expertBox: $("expert-box"),
    expertLoad: $("expert-load"),
    expertBars: $("expert-bars"),
    mapSize: $("map-size"),
    legend: $("legend"),
    tbody: document.querySelector("#seq-table tbody"),
  });
  followChatModel();
  followCells([map, stats], loadModels());
}

main();
