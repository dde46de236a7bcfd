// The playground's entry: tabs (#create, #gallery, #finetune), the API key gate, the connection
// indicator, and the wiring between the panels.

import { APIError, apiKey, bus, get } from "./api.js";
import { CreateForm } from "./create.js";
import { FineTune } from "./finetune.js";
import { Gallery } from "./gallery.js";
import { Queue } from "./queue.js";

const TABS = ["create", "gallery", "finetune"];
const OFFLINE_RETRY_MS = 2000;

const $ = (id) => document.getElementById(id);
// What fails outside any form (the connection indicator already shows a lost server).
const report = (err) => console.error(err);

const queue = new Queue($("panel-create"), { onFinished: () => gallery.changed() });
const create = new CreateForm($("create-form"), { onCreated: (video) => queue.add(video) });
const gallery = new Gallery($("panel-gallery"), {
  onRemix: (video) => {
    create.fill(video);
    location.hash = "#create";
  },
});
const fineTune = new FineTune($("panel-finetune"), {
  onModelsChanged: () => refreshModels().catch(report),
  onUseModel: (modelId) =>
    refreshModels()
      .then(() => create.select(modelId))
      .catch(report)
      .finally(() => {
        location.hash = "#create";
      }),
});

let started = false;

function currentTab() {
  const name = location.hash.slice(1);
  return TABS.includes(name) ? name : "create";
}

function showTab() {
  const name = currentTab();
  for (const tab of TABS) {
    $(`panel-${tab}`).hidden = tab !== name;
    $(`tab-${tab}`).setAttribute("aria-selected", String(tab === name));
  }
  if (started) loadTab(name);
}

function loadTab(name) {
  if (name === "gallery") gallery.load().catch(report);
  if (name === "finetune") fineTune.load().catch(report);
}

async function refreshModels() {
  const models = (await get("v1/models")).data;
  create.setModels(models);
  fineTune.setModels(models);
  return models;
}

// --- the API key gate ------------------------------------------------------------------------

let asking = null;

// Open the key dialog; resolves once a key is entered (checked by the caller's next request).
function askForKey(message) {
  if (asking) return asking;
  const dialog = $("auth-dialog");
  const form = $("auth-form");
  const field = form.querySelector(".field");
  field.classList.toggle("invalid", Boolean(message));
  field.querySelector(".error").textContent = message;
  asking = new Promise((resolve) => {
    form.onsubmit = (e) => {
      e.preventDefault();
      const key = form.elements.api_key.value.trim();
      if (!key) {
        field.classList.add("invalid");
        field.querySelector(".error").textContent = "enter a key";
        return;
      }
      apiKey.set(key);
      dialog.close();
      asking = null;
      resolve();
    };
  });
  dialog.showModal();
  form.elements.api_key.select();
  return asking;
}

// Escape would close the dialog: without a key the page has nothing to show.
$("auth-dialog").addEventListener("cancel", (e) => e.preventDefault());

// The first call decides: without a (valid) key nothing else is asked of the server.
async function authorize() {
  for (;;) {
    try {
      return await refreshModels();
    } catch (err) {
      if (!(err instanceof APIError)) throw err;
      if (err.status === 401) await askForKey(apiKey.get() ? err.message : "");
      else if (err.status === 0) await new Promise((r) => setTimeout(r, OFFLINE_RETRY_MS));
      else throw err;
    }
  }
}

async function start() {
  started = false;
  await authorize();
  $("forget-key").hidden = !apiKey.get();
  started = true;
  await queue.load();
  loadTab(currentTab());
}

// A key that stops working later (the server restarted with others): ask again, then start over.
bus.addEventListener("unauthorized", (e) => {
  if (!started || asking) return;
  started = false;
  askForKey(e.detail.message).then(() => start().catch(report));
});

$("forget-key").addEventListener("click", () => {
  apiKey.clear();
  location.reload();
});

bus.addEventListener("connection", (e) => {
  const indicator = $("connection");
  indicator.dataset.state = e.detail ? "online" : "offline";
  indicator.textContent = e.detail ? "connected" : "server unreachable, retrying…";
});

window.addEventListener("hashchange", showTab);
showTab();
start().catch((err) => {
  $("connection").dataset.state = "offline";
  $("connection").textContent = err.message;
});
