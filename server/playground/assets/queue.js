// The queue: each submitted (or still unfinished) video as a card whose progress bar follows the
// video's Server-Sent Events (GET /v1/videos/{id}/events): its place in the queue, step k of n,
// then encoding. A finished clip plays in its card, thumbnail first.

import { APIError, get, request } from "./api.js";
import { describeVideo, h, progressBar, setProgress } from "./dom.js";
import { play } from "./media.js";
import { follow } from "./sse.js";

// Browsers open at most six HTTP/1.1 connections to one server, and an event stream holds one for
// as long as its video runs: the other videos wait for a free stream (oldest first, as they run),
// so that clicks and pages always have a connection.
const MAX_STREAMS = 4;
const TERMINAL = new Set(["completed", "failed", "cancelled"]);

function stateText(video, position) {
  switch (video.status) {
    case "queued":
      return position ? `queued · #${position} in line` : "queued";
    case "in_progress":
      if (video.step >= video.num_inference_steps) return "encoding";
      return video.step ? `step ${video.step} of ${video.num_inference_steps}` : "starting";
    case "completed":
      return "done";
    case "failed":
      return `failed: ${video.error?.message || "no reason given"}`;
    default:
      return video.status;
  }
}

export class Queue {
  constructor(section, { onFinished }) {
    this.list = section.querySelector("#queue-list");
    this.empty = section.querySelector("#queue-empty");
    this.onFinished = onFinished;
    this.jobs = new Map(); // video id -> job, in the order they were added
  }

  // Start over with every unfinished video, GET /v1/videos page by page (newest first): a video
  // still waiting (a low priority, a long queue) can be older than the newest hundred.
  async load() {
    for (const job of this.jobs.values()) job.stream?.close();
    this.jobs.clear();
    this.list.replaceChildren();
    const unfinished = [];
    let after;
    do {
      const page = await get("v1/videos", { limit: 100, order: "desc", after });
      unfinished.push(...page.data.filter((video) => !TERMINAL.has(video.status)));
      after = page.has_more ? page.last_id : undefined;
    } while (after);
    for (const video of unfinished.reverse()) this.add(video);
    this.update();
  }

  add(video) {
    if (this.jobs.has(video.id)) return;
    const job = { video: { ...video }, position: null, stream: null, finished: false };
    job.els = {
      media: h("div", { class: "media" }, h("div", { class: "placeholder" })),
      bar: progressBar(`progress of ${video.id}`),
      state: h("p", { class: "state" }),
      error: h("p", { class: "error" }),
      cancel: h(
        "button",
        { type: "button", class: "cancel", onclick: () => this.cancel(job) },
        "Cancel",
      ),
      dismiss: h(
        "button",
        { type: "button", class: "quiet dismiss", onclick: () => this.dismiss(job) },
        "Dismiss",
      ),
    };
    const { media, bar, state, error, cancel, dismiss } = job.els;
    job.card = h(
      "li",
      { class: "job", dataset: { id: video.id } },
      media,
      h(
        "div",
        { class: "body" },
        h("p", { class: "prompt", title: video.prompt }, video.prompt),
        h("p", { class: "params" }, describeVideo(video)),
        bar,
        state,
        error,
        h("div", { class: "actions" }, cancel, dismiss),
      ),
    );
    this.jobs.set(video.id, job);
    this.list.prepend(job.card);
    this.render(job);
    this.update();
  }

  render(job) {
    const { video, els } = job;
    job.card.dataset.status = video.status;
    setProgress(els.bar, video.progress ?? 0);
    els.state.textContent = stateText(video, job.position);
    els.cancel.hidden = TERMINAL.has(video.status);
    els.dismiss.hidden = !TERMINAL.has(video.status);
    if (video.preview && video.status === "in_progress") {
      // The clip as the last previewed step predicts it (video.preview events), until it plays.
      let image = els.media.querySelector("img.preview");
      if (!image) {
        image = h("img", { class: "preview", alt: `preview of ${video.id} while it renders` });
        els.media.replaceChildren(image);
      }
      if (image.getAttribute("src") !== video.preview) image.setAttribute("src", video.preview);
      return;
    }
    const placeholder = els.media.querySelector(".placeholder");
    if (placeholder) {
      placeholder.textContent =
        video.status === "in_progress" ? `${video.progress ?? 0}%` : video.status.replace("_", " ");
    }
  }

  // Open event streams for the oldest waiting videos while there is room, and show the empty note.
  update() {
    this.empty.hidden = this.jobs.size > 0;
    const jobs = [...this.jobs.values()];
    let free = MAX_STREAMS - jobs.filter((j) => j.stream).length;
    for (const job of jobs) {
      if (free <= 0) break;
      if (job.stream || job.finished) continue;
      this.watch(job);
      free -= 1;
    }
  }

  watch(job) {
    const id = job.video.id;
    job.stream = follow(`v1/videos/${encodeURIComponent(id)}/events`, {
      onEvent: (event) => {
        let data;
        try {
          data = JSON.parse(event.data);
        } catch {
          return false;
        }
        return this.apply(job, data);
      },
      onError: (err) => this.lost(job, err),
      settled: () => this.refresh(job),
    });
  }

  // Take one event's data (or a fetched video); true once the video has reached its end.
  apply(job, data) {
    if (job.finished) return true;
    const { queue_position: position, ...video } = data;
    Object.assign(job.video, video);
    job.position = job.video.status === "queued" ? (position ?? job.position) : null;
    this.render(job);
    if (!TERMINAL.has(job.video.status)) return false;
    this.finish(job);
    return true;
  }

  finish(job) {
    job.finished = true;
    job.stream?.close();
    job.stream = null;
    this.update();
    if (job.video.status === "completed") {
      play(job.els.media, job.video.id).catch((err) => {
        job.els.error.textContent = err.message;
      });
    }
    this.onFinished(job.video);
  }

  // Ask for the video itself: a stream may end cleanly for a video that finished or went away.
  async refresh(job) {
    try {
      return this.apply(job, await get(`v1/videos/${encodeURIComponent(job.video.id)}`));
    } catch (err) {
      if (!(err instanceof APIError) || err.status !== 404) return false;
      this.lost(job, err);
      return true;
    }
  }

  lost(job, err) {
    job.stream = null;
    job.finished = true;
    job.els.error.textContent = err.status === 404 ? "this video was deleted" : err.message;
    job.els.cancel.hidden = true;
    job.els.dismiss.hidden = false;
    this.update();
  }

  async cancel(job) {
    job.els.cancel.disabled = true;
    job.els.error.textContent = "";
    try {
      // A queued video is cancelled at once; for a running one the answer waits until it stops.
      await request("POST", `v1/videos/${encodeURIComponent(job.video.id)}/cancel`);
      await this.refresh(job); // a video without a stream yet hears of it here
    } catch (err) {
      job.els.error.textContent = err.message;
    } finally {
      job.els.cancel.disabled = false;
    }
  }

  dismiss(job) {
    job.stream?.close();
    this.jobs.delete(job.video.id);
    job.card.remove();
    this.update();
  }
}
