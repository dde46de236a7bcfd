// Fine-tuning: upload a dataset archive (POST /v1/files, with upload progress), start a job
// (POST /v1/fine_tuning/jobs) and follow it: its status and step (GET .../{id}), its loss from the
// `metrics` events (GET .../{id}/events, newest first), its checkpoints (GET .../{id}/checkpoints).
// A job with validation prompts shows their videos side by side: prompts as rows, checkpoints as
// columns; with a validation split, the held-out loss is drawn beside the training loss.
// A job that succeeds serves its `ft:` model at once; one click opens it in the Create tab.

import { APIError, blobURL, get, request, upload } from "./api.js";
import { lossChart } from "./chart.js";
import { fillModelSelect } from "./create.js";
import {
  clearErrors,
  formatBytes,
  formatTime,
  h,
  numberIn,
  progressBar,
  setProgress,
  showError,
} from "./dom.js";

const POLL_MS = 1000; // how often a running job is looked at
const CHECK_MS = 300; // how often an upload being validated is looked at
const EVENTS_PAGE = 200;
const LOG_LINES = 8;
const JOBS_PAGE = 20;
const ACTIVE = new Set(["queued", "running"]);

function eventSeq(event) {
  return Number(event.id.replace("ftevent-", ""));
}

export class FineTune {
  constructor(section, { onUseModel, onModelsChanged }) {
    this.section = section;
    this.onUseModel = onUseModel;
    this.onModelsChanged = onModelsChanged;
    this.uploadForm = section.querySelector("#upload-form");
    this.form = section.querySelector("#finetune-form");
    this.jobsList = section.querySelector("#ft-jobs");
    this.more = section.querySelector("#ft-more");
    this.detailBox = section.querySelector("#ft-detail");
    this.lastJob = null; // cursor of the next page of jobs
    this.detail = null; // the job shown, with what has been read of it
    this.uploadForm.addEventListener("submit", (e) => {
      e.preventDefault();
      this.upload();
    });
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.start();
    });
    this.more.addEventListener("click", () => this.loadJobs({ append: true }));
  }

  setModels(models) {
    fillModelSelect(this.form.elements.model, models);
  }

  async load() {
    await Promise.all([this.loadFiles(), this.loadJobs({ append: false })]);
  }

  // --- datasets ----------------------------------------------------------------------------

  async loadFiles(selected = this.form.elements.training_file.value) {
    const page = await get("v1/files", { purpose: "fine-tune", limit: 100 });
    const select = this.form.elements.training_file;
    // Only a processed dataset can be trained on; the others say why not.
    const state = (f) => {
      if (f.status === "processed") return `${f.clips} clips`;
      return f.status === "error" ? "invalid" : "checking…";
    };
    const option = (f) => {
      const text = `${f.filename} · ${state(f)} · ${f.id}`;
      const item = new Option(text, f.id, false, f.id === selected);
      item.disabled = f.status !== "processed";
      return item;
    };
    select.replaceChildren(...page.data.map(option));
  }

  async upload() {
    const form = this.uploadForm;
    const file = form.elements.file.files[0];
    const bar = form.querySelector("#upload-progress");
    const status = form.querySelector("#upload-status");
    const button = form.querySelector("#upload");
    clearErrors(form);
    if (!file) {
      showError(form, new APIError("choose an archive first", { param: "file" }));
      return;
    }
    const body = new FormData();
    body.append("purpose", "fine-tune");
    body.append("file", file);
    bar.hidden = false;
    setProgress(bar, 0);
    button.disabled = true;
    status.textContent = `uploading ${file.name}…`;
    try {
      const uploaded = await upload("v1/files", body, (sent, total) => {
        const size = total ?? file.size;
        setProgress(bar, (100 * sent) / size);
        status.textContent =
          sent >= size
            ? `${file.name}: sent, the server is checking it…`
            : `uploading ${file.name}: ${formatBytes(sent)} of ${formatBytes(size)}`;
      });
      setProgress(bar, 100);
      status.textContent = `${file.name}: sent, the server is checking it…`;
      const checked = await this.checked(uploaded);
      if (checked.status === "error") {
        throw new APIError(checked.status_details, { param: "file", code: "invalid_file" });
      }
      const size = formatBytes(checked.bytes);
      const { filename, clips, id } = checked;
      status.textContent = `${filename}: ${clips} clips, ${size} (${id})`;
      form.elements.file.value = "";
      await this.loadFiles(checked.id);
    } catch (err) {
      if (!(err instanceof APIError)) throw err;
      bar.hidden = true;
      status.textContent = "";
      showError(form, err);
    } finally {
      button.disabled = false;
    }
  }

  // An upload is validated after it returns: wait until it is processed (or failed).
  async checked(file) {
    while (file.status === "uploaded") {
      await new Promise((resolve) => setTimeout(resolve, CHECK_MS));
      file = await get(`v1/files/${encodeURIComponent(file.id)}`);
    }
    return file;
  }

  // --- jobs --------------------------------------------------------------------------------

  body() {
    const f = this.form.elements;
    const number = (input, param) => {
      const value = numberIn(input);
      if (Number.isNaN(value)) throw new APIError(`${param}: not a number`, { param });
      return value;
    };
    const hyper = {
      n_epochs: number(f.n_epochs, "hyperparameters.n_epochs"),
      batch_size: number(f.batch_size, "hyperparameters.batch_size"),
      learning_rate_multiplier: number(
        f.learning_rate_multiplier,
        "hyperparameters.learning_rate_multiplier",
      ),
      num_frames: number(f.num_frames, "hyperparameters.num_frames"),
    };
    const width = number(f.width, "hyperparameters.size");
    const height = number(f.height, "hyperparameters.size");
    if (width !== undefined || height !== undefined) hyper.size = `${width ?? ""}x${height ?? ""}`;
    for (const name of Object.keys(hyper)) if (hyper[name] === undefined) delete hyper[name];
    const split = number(f.validation_split, "hyperparameters.validation_split");
    if (split) hyper.validation_split = split;
    const body = { model: f.model.value, training_file: f.training_file.value };
    if (Object.keys(hyper).length) body.hyperparameters = hyper;
    const prompts = f.validation.value
      .split("\n")
      .map((line) => line.trim())
      .filter(Boolean);
    if (prompts.length) {
      // Sampled at the training clips' shape when one is given, else at the model's defaults.
      const steps = number(f.validation_steps, "validation.steps");
      const shared = { size: hyper.size, num_frames: hyper.num_frames, num_inference_steps: steps };
      for (const name of Object.keys(shared)) if (shared[name] === undefined) delete shared[name];
      body.validation = prompts.map((prompt) => ({ prompt, ...shared }));
    }
    if (f.suffix.value.trim()) body.suffix = f.suffix.value.trim();
    const seed = number(f.seed, "seed");
    if (seed !== undefined) body.seed = seed;
    return body;
  }

  async start() {
    const button = this.form.querySelector("#start-finetune");
    clearErrors(this.form);
    button.disabled = true;
    try {
      const job = await request("POST", "v1/fine_tuning/jobs", { json: this.body() });
      this.jobsList.prepend(this.jobRow(job));
      this.section.querySelector("#ft-empty").hidden = true;
      this.select(job);
    } catch (err) {
      if (!(err instanceof APIError)) throw err;
      showError(this.form, err);
    } finally {
      button.disabled = false;
    }
  }

  async loadJobs({ append }) {
    const page = await get("v1/fine_tuning/jobs", {
      limit: JOBS_PAGE,
      after: append ? this.lastJob : undefined,
    });
    const rows = page.data.map((job) => this.jobRow(job));
    if (append) this.jobsList.append(...rows);
    else this.jobsList.replaceChildren(...rows);
    this.lastJob = page.last_id ?? this.lastJob;
    this.more.hidden = !page.has_more;
    this.section.querySelector("#ft-empty").hidden = this.jobsList.children.length > 0;
    if (!append && !this.detail && page.data.length) this.select(page.data[0]);
  }

  jobRow(job) {
    const row = h(
      "li",
      { dataset: { id: job.id } },
      h(
        "button",
        { type: "button", class: "ft-job", onclick: () => this.select(job) },
        h("span", { class: "badge" }),
        h("span", { class: "name" }),
      ),
    );
    this.updateRow(row, job);
    return row;
  }

  updateRow(row, job) {
    row.querySelector(".badge").textContent = job.status;
    row.querySelector(".badge").dataset.status = job.status;
    row.querySelector(".name").textContent = job.fine_tuned_model || `${job.id} (${job.model})`;
    row.classList.toggle("selected", this.detail?.id === job.id);
  }

  // Show one job and follow it while it is active.
  select(job) {
    if (this.detail) clearTimeout(this.detail.timer);
    const els = {
      title: h("h3", {}, job.id),
      badge: h("span", { class: "badge" }),
      summary: h("p", { class: "params" }),
      bar: progressBar(`training progress of ${job.id}`),
      step: h("p", { class: "state" }),
      chart: h("div", { class: "chart" }),
      validation: h("div", { class: "validation-grid" }),
      checkpoints: h("tbody"),
      log: h("ol", { class: "log" }),
      error: h("p", { class: "error" }),
      cancel: h(
        "button",
        { type: "button", class: "danger", onclick: () => this.cancel() },
        "Cancel job",
      ),
      use: h("button", {
        type: "button",
        class: "primary use-model",
        hidden: true,
        onclick: () => this.use(),
      }),
    };
    this.detail = {
      id: job.id,
      job,
      els,
      lastSeq: 0,
      log: [],
      losses: new Map(),
      heldOut: new Map(),
      shownVideos: null, // the checkpoints whose validation videos are on the page
      timer: null,
    };
    this.detailBox.replaceChildren(
      h("header", { class: "detail-head" }, els.title, els.badge),
      els.summary,
      els.bar,
      els.step,
      els.chart,
      els.validation,
      h("h4", {}, "Checkpoints"),
      h(
        "table",
        { class: "checkpoints" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            h("th", {}, "step"),
            h("th", {}, "loss"),
            h("th", {}, "held-out loss"),
            h("th", {}, "checkpoint"),
          ),
        ),
        els.checkpoints,
      ),
      h("h4", {}, "Events"),
      els.log,
      els.error,
      h("div", { class: "actions" }, els.cancel, els.use),
    );
    this.detailBox.hidden = false;
    for (const row of this.jobsList.children)
      row.classList.toggle("selected", row.dataset.id === job.id);
    this.render();
    this.refresh();
  }

  async refresh() {
    const d = this.detail;
    const path = `v1/fine_tuning/jobs/${encodeURIComponent(d.id)}`;
    try {
      const [job, checkpoints] = await Promise.all([
        get(path),
        get(`${path}/checkpoints`, { limit: 100 }),
      ]);
      await this.readEvents(d, `${path}/events`);
      if (this.detail !== d) return; // another job was chosen meanwhile
      const succeededNow = job.status === "succeeded" && d.job.status !== "succeeded";
      d.job = job;
      d.checkpoints = checkpoints.data;
      d.els.error.textContent = job.error?.message || "";
      if (succeededNow) this.onModelsChanged();
    } catch (err) {
      if (this.detail !== d) return;
      d.els.error.textContent = err.message;
    }
    this.render();
    if (ACTIVE.has(d.job.status)) d.timer = setTimeout(() => this.refresh(), POLL_MS);
  }

  // The events newer than the last one read: pages come newest first, so read until a known one.
  async readEvents(d, path) {
    const fresh = [];
    let after;
    for (;;) {
      const page = await get(path, { limit: EVENTS_PAGE, after });
      const unseen = page.data.filter((e) => eventSeq(e) > d.lastSeq);
      fresh.push(...unseen);
      if (unseen.length < page.data.length || !page.has_more) break;
      after = page.last_id;
    }
    for (const event of fresh.reverse()) {
      d.lastSeq = Math.max(d.lastSeq, eventSeq(event));
      d.log.push(event);
      // A resumed run takes a step again after its last checkpoint: the later value stands.
      if (event.type === "metrics" && event.data) {
        d.losses.set(event.data.step, event.data.loss);
        const held = event.data.validation_loss;
        if (held != null) d.heldOut.set(event.data.step, held);
      }
    }
  }

  render() {
    const { job, els, losses, log, checkpoints = [] } = this.detail;
    els.badge.textContent = job.status;
    els.badge.dataset.status = job.status;
    this.detailBox.dataset.status = job.status;
    const target = job.fine_tuned_model ? ` → ${job.fine_tuned_model}` : "";
    const hp = job.hyperparameters;
    els.summary.textContent =
      `${job.model}${target} · ${job.training_file} · ` +
      `${hp.n_epochs} epochs, batch ${hp.batch_size}, ` +
      `lr × ${hp.learning_rate_multiplier} · seed ${job.seed} · ${formatTime(job.created_at)}`;
    const total = job.total_steps || 0;
    setProgress(els.bar, total ? (100 * job.step) / total : job.status === "succeeded" ? 100 : 0);
    els.step.textContent = total ? `step ${job.step} of ${total}` : job.status;
    const series = (values) =>
      [...values].map(([step, loss]) => ({ step, loss })).sort((a, b) => a.step - b.step);
    els.chart.replaceChildren(lossChart(series(losses), series(this.detail.heldOut)));
    this.renderValidation();
    els.checkpoints.replaceChildren(
      ...checkpoints.map((c) =>
        h(
          "tr",
          {},
          h("td", {}, c.step_number),
          h("td", {}, c.metrics?.loss != null ? Number(c.metrics.loss).toPrecision(4) : "–"),
          h(
            "td",
            {},
            c.metrics?.validation_loss != null
              ? Number(c.metrics.validation_loss).toPrecision(4)
              : "–",
          ),
          h("td", { class: "mono" }, c.fine_tuned_model_checkpoint),
        ),
      ),
    );
    els.log.replaceChildren(
      ...log
        .slice(-LOG_LINES)
        .reverse()
        .map((e) =>
          h(
            "li",
            { dataset: { level: e.level } },
            h("time", {}, new Date(e.created_at * 1000).toLocaleTimeString()),
            " ",
            e.message,
          ),
        ),
    );
    els.cancel.hidden = !ACTIVE.has(job.status);
    els.use.hidden = !job.fine_tuned_model;
    els.use.textContent = `Create with ${job.fine_tuned_model}`;
    const row = [...this.jobsList.children].find((r) => r.dataset.id === job.id);
    if (row) this.updateRow(row, job);
  }

  // The validation videos, prompts as rows and checkpoints as columns (oldest first); drawn again
  // only when a checkpoint is added, so that the clips keep playing across polls.
  renderValidation() {
    const d = this.detail;
    const prompts = d.job.validation || [];
    const checkpoints = [...(d.checkpoints || [])].reverse();
    const shown = checkpoints.map((c) => c.id).join(" ");
    if (!prompts.length || shown === d.shownVideos) return;
    d.shownVideos = shown;
    const cell = (checkpoint, index) => {
      const video = checkpoint.validation?.[index];
      if (!video) return h("td", {}, "–");
      if (video.status !== "succeeded") {
        return h("td", { class: "failed", title: video.error || "" }, "failed");
      }
      const player = h("video", { controls: true, loop: true, playsinline: true });
      player.muted = true; // browsers autoplay muted clips only
      player.autoplay = true;
      player.dataset.step = checkpoint.step_number;
      player.dataset.index = index;
      blobURL(video.content_url.replace(/^\//, "")).then(
        (src) => (player.src = src),
        (err) => player.replaceWith(h("span", { class: "failed" }, err.message)),
      );
      return h("td", {}, player);
    };
    d.els.validation.replaceChildren(
      h("h4", {}, "Validation videos"),
      h(
        "table",
        { class: "validation" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            h("th", {}, "prompt"),
            ...checkpoints.map((c) => h("th", {}, `step ${c.step_number}`)),
          ),
        ),
        h(
          "tbody",
          {},
          ...prompts.map((p, index) =>
            h("tr", {}, h("th", {}, p.prompt), ...checkpoints.map((c) => cell(c, index))),
          ),
        ),
      ),
    );
  }

  async cancel() {
    const d = this.detail;
    d.els.cancel.disabled = true;
    try {
      d.job = await request("POST", `v1/fine_tuning/jobs/${encodeURIComponent(d.id)}/cancel`);
      this.render();
    } catch (err) {
      d.els.error.textContent = err.message;
    } finally {
      d.els.cancel.disabled = false;
    }
  }

  use() {
    this.onUseModel(this.detail.job.fine_tuned_model);
  }
}
