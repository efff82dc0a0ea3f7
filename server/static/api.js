// HTTP helpers: the API key (asked once, kept in sessionStorage) and an SSE reader over fetch.
// EventSource cannot send an Authorization header, so every stream is read with fetch.

const KEY_STORAGE = "cellserve.apiKey";
let pendingKeyPrompt = null;

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

function askForKey() {
  // One dialog at a time: concurrent 401s (chat + cell map) share the same answer.
  if (pendingKeyPrompt) return pendingKeyPrompt;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  pendingKeyPrompt = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = input.value.trim();
      input.value = "";
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      pendingKeyPrompt = null;
      resolve(key);
    }, { once: true });
    dialog.showModal();
    input.focus();
  });
  return pendingKeyPrompt;
}

function withKey(options) {
  const headers = new Headers(options.headers || {});
  const key = storedKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return { ...options, headers };
}

// fetch() that adds the Bearer key and, on 401, asks for a key and retries.
export async function apiFetch(url, options = {}) {
  for (;;) {
    const response = await fetch(url, withKey(options));
    if (response.status !== 401) return response;
    sessionStorage.removeItem(KEY_STORAGE);
    const key = await askForKey();
    if (!key) return response;
  }
}

export async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function takeLine(state) {
  const end = state.buffer.indexOf("\n");
  if (end < 0) return null;
  let line = state.buffer.slice(0, end);
  state.buffer = state.buffer.slice(end + 1);
  if (line.endsWith("\r")) line = line.slice(0, -1);
  return line;
}

function feedLine(line, event, onEvent) {
  if (line === "") {
    if (event.data.length) onEvent({ event: event.name || "message", data: event.data.join("\n") });
    event.name = "";
    event.data = [];
    return;
  }
  if (line.startsWith(":")) return; // comment / ping
  const colon = line.indexOf(":");
  const field = colon < 0 ? line : line.slice(0, colon);
  let value = colon < 0 ? "" : line.slice(colon + 1);
  if (value.startsWith(" ")) value = value.slice(1);
  if (field === "data") event.data.push(value);
  else if (field === "event") event.name = value;
}

// Calls onEvent({event, data}) for every server-sent event until the body ends.
export async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const state = { buffer: "" };
  const event = { name: "", data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    state.buffer += decoder.decode(value, { stream: true });
    for (let line = takeLine(state); line !== null; line = takeLine(state)) {
      feedLine(line, event, onEvent);
    }
  }
  feedLine("", event, onEvent);
}
