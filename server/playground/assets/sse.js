// Server-Sent Events read with fetch, because EventSource cannot send an Authorization header.
// A stream that breaks (or ends before its last event) is reopened with `Last-Event-ID: <the last
// event received>`; the server replays what came after it, so nothing is lost or seen twice.

import { errorOf, headers, setOnline, url } from "./api.js";

// Waits between attempts while the server cannot be reached; any event received starts again at
// the first one.
const RETRY_MS = [250, 500, 1000, 2000, 4000];

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

// The events of a response body, as the HTML spec's "event stream interpretation" reads them:
// `event:`, `data:` (joined with newlines), `id:`; a blank line dispatches; `:` lines are comments.
// An event cut off by the end of the stream is dropped: the next connection replays it whole.
export async function* parseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { type: "message", data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (let line of lines) {
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (event.data.length)
          yield { type: event.type, data: event.data.join("\n"), id: event.id };
        event = { type: "message", data: [], id: null };
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let text = colon < 0 ? "" : line.slice(colon + 1);
      if (text.startsWith(" ")) text = text.slice(1);
      if (field === "event") event.type = text;
      else if (field === "data") event.data.push(text);
      else if (field === "id" && !text.includes("\0")) event.id = text;
    }
  }
}

/**
 * Follow the event stream at `path` until `onEvent` returns true (a terminal event), the server
 * answers an error that retrying cannot fix (`onError`), or `close()` is called.
 *
 * When a connection ends cleanly without a terminal event, `settled()` is asked whether the
 * resource has reached its end meanwhile (a stream can end for a deleted or finished job); a
 * true answer stops, anything else reconnects.
 */
export function follow(path, { onEvent, onError = () => {}, settled = async () => false }) {
  const controller = new AbortController();
  const { signal } = controller;
  let lastEventId = null;
  let failures = 0;

  async function run() {
    while (!signal.aborted) {
      try {
        const request = headers({ Accept: "text/event-stream" });
        if (lastEventId !== null) request["Last-Event-ID"] = lastEventId;
        const response = await fetch(url(path), { headers: request, signal, cache: "no-store" });
        setOnline(true);
        if (!response.ok) {
          const err = await errorOf(response);
          // Only a busy or failing server is worth asking again; a 4xx will not change.
          if (response.status < 500 && response.status !== 429) return onError(err);
          throw err;
        }
        for await (const event of parseEvents(response.body)) {
          failures = 0;
          if (event.id !== null) lastEventId = event.id;
          if (onEvent(event)) {
            controller.abort(); // the terminal event: release the connection at once
            return;
          }
        }
        if (await settled()) return;
      } catch (e) {
        if (signal.aborted) return;
        if (e.name !== "APIError") setOnline(false);
      }
      await sleep(RETRY_MS[Math.min(failures++, RETRY_MS.length - 1)], signal);
    }
  }

  run();
  return { close: () => controller.abort() };
}
