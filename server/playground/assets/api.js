// The page's one way to the API: every call carries the API key (when one is set), and every
// failure becomes an APIError read from the server's error envelope
// ({"error": {"message", "type", "param", "code"}}), so that a form can show it beside the field
// it names.

const KEY_STORAGE = "megaslide.apiKey";

export class APIError extends Error {
  constructor(message, { status = 0, type = "connection_error", param = null, code = null } = {}) {
    super(message);
    this.name = "APIError";
    Object.assign(this, { status, type, param, code });
  }
}

// The key lives in this browser only (localStorage) and is sent only to this page's own server.
export const apiKey = {
  get: () => localStorage.getItem(KEY_STORAGE) || "",
  set: (key) => localStorage.setItem(KEY_STORAGE, key),
  clear: () => localStorage.removeItem(KEY_STORAGE),
};

// "unauthorized" (a 401: ask for a key) and "connection" (detail: true once the server answers,
// false while it cannot be reached).
export const bus = new EventTarget();

let online = null;

export function setOnline(value) {
  if (value === online) return;
  online = value;
  bus.dispatchEvent(new CustomEvent("connection", { detail: value }));
}

export function headers(extra = {}) {
  const key = apiKey.get();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// Paths are relative ("v1/videos"), so the page also works behind a proxy that adds a prefix.
export function url(path, query = {}) {
  const u = new URL(path, document.baseURI);
  for (const [name, value] of Object.entries(query)) {
    if (value !== undefined && value !== null && value !== "") u.searchParams.set(name, value);
  }
  return u;
}

export function errorFrom(status, body, statusText = "") {
  const e = body && typeof body === "object" ? body.error : null;
  const err = new APIError(e?.message || `HTTP ${status} ${statusText}`.trim(), {
    status,
    type: e?.type || "http_error",
    param: e?.param ?? null,
    code: e?.code ?? null,
  });
  if (status === 401) bus.dispatchEvent(new CustomEvent("unauthorized", { detail: err }));
  return err;
}

export async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's error page): the status line says enough
  }
  return errorFrom(response.status, body, response.statusText);
}

async function send(method, path, { json, form, query, signal } = {}) {
  const init = { method, headers: headers(), signal, cache: "no-store" };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form; // the browser writes the multipart boundary itself
  }
  let response;
  try {
    response = await fetch(url(path, query), init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    setOnline(false);
    throw new APIError("cannot reach the server");
  }
  setOnline(true);
  if (!response.ok) throw await errorOf(response);
  return response;
}

// A JSON call: resolves to the parsed body, rejects with an APIError.
export async function request(method, path, options) {
  return (await send(method, path, options)).json();
}

export const get = (path, query) => request("GET", path, { query });

// Media need the key too, which <img src> and <video src> cannot send: the API signs a link to
// each file (POST {path}/link), which the element then follows itself: streamed and seekable
// with ranges, never held whole in memory. Links are kept per file until a minute before they
// expire, or until `forget` (a deleted video) drops them.
const links = new Map();
const LINK_MARGIN_S = 60;

export function linkURL(path, query = {}) {
  const key = url(path, query).href;
  const held = links.get(key);
  if (held && held.expiresAt - LINK_MARGIN_S > Date.now() / 1000) return held.made;
  const entry = { expiresAt: Infinity };
  entry.made = request("POST", `${path}/link`, { query }).then((link) => {
    entry.expiresAt = link.expires_at;
    return link.url;
  });
  entry.made.catch(() => links.delete(key)); // a failed request may be tried again
  links.set(key, entry);
  return entry.made;
}

export function forget(pathPrefix) {
  const prefix = url(pathPrefix).href;
  for (const key of [...links.keys()]) {
    if (key.startsWith(prefix)) links.delete(key);
  }
}

// A file held whole in this page, as a blob: URL, for a media element: a fine-tune's validation
// videos, short clips that have no signed links (those are a video object's). Kept per path: a
// checkpoint's videos never change.
const blobs = new Map();

export function blobURL(path) {
  if (!blobs.has(path)) {
    const made = send("GET", path).then(async (response) =>
      URL.createObjectURL(await response.blob()),
    );
    made.catch(() => blobs.delete(path)); // a failed request may be tried again
    blobs.set(path, made);
  }
  return blobs.get(path);
}

// An upload with progress: fetch cannot report how much of a request body was sent, XHR can.
export function upload(path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url(path));
    for (const [name, value] of Object.entries(headers())) xhr.setRequestHeader(name, value);
    xhr.responseType = "json";
    xhr.upload.onprogress = (e) => onProgress(e.loaded, e.lengthComputable ? e.total : null);
    xhr.onload = () => {
      setOnline(true);
      if (xhr.status >= 200 && xhr.status < 300) resolve(xhr.response);
      else reject(errorFrom(xhr.status, xhr.response, xhr.statusText));
    };
    xhr.onerror = () => {
      setOnline(false);
      reject(new APIError("cannot reach the server"));
    };
    xhr.send(form);
  });
}
