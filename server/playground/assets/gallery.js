// The gallery: past videos a page at a time, as GET /v1/videos pages them (newest first; `after`
// is the last id of the page before). Each card plays, downloads, remixes or deletes its video.

import { APIError, get, request } from "./api.js";
import { describeVideo, formatTime, h } from "./dom.js";
import { download, forgetVideo, play, thumbnail, thumbnailURL } from "./media.js";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const CONFIRM_MS = 4000; // how long a Delete button waits for its second click

export class Gallery {
  constructor(section, { onRemix }) {
    this.section = section;
    this.list = section.querySelector("#gallery-list");
    this.empty = section.querySelector("#gallery-empty");
    this.error = section.querySelector("#gallery-error");
    this.size = section.querySelector("#gallery-size");
    this.newer = section.querySelector("#gallery-newer");
    this.older = section.querySelector("#gallery-older");
    this.label = section.querySelector("#gallery-page");
    this.onRemix = onRemix;
    this.cursors = [null]; // the `after` of each page seen so far; page 0 starts at the newest
    this.page = 0;
    this.hasMore = false;
    this.loading = null;
    // Videos whose Delete waits for its second click: kept here, not on the button, so that a
    // reload that redraws the cards meanwhile (a video finishing) keeps the button armed.
    this.armed = new Set();
    this.size.addEventListener("change", () => this.first());
    this.newer.addEventListener("click", () => this.go(this.page - 1));
    this.older.addEventListener("click", () => this.go(this.page + 1));
  }

  // A video finished or went away: a gallery on screen shows it at once (a hidden one reloads
  // when it is shown).
  changed() {
    if (!this.section.hidden) this.load();
  }

  first() {
    this.cursors = [null];
    return this.go(0);
  }

  async go(page) {
    if (page < 0 || page >= this.cursors.length) return;
    this.page = page;
    await this.load();
  }

  // (Re)load the current page; one load at a time, the latest request wins.
  async load() {
    const query = { limit: this.size.value, order: "desc", after: this.cursors[this.page] };
    const token = {};
    this.loading = token;
    this.error.textContent = "";
    let page;
    try {
      page = await get("v1/videos", query);
    } catch (err) {
      if (this.loading === token) this.error.textContent = err.message;
      return;
    }
    if (this.loading !== token) return;
    if (!page.data.length && this.page > 0) return this.go(this.page - 1); // emptied by deletes
    this.hasMore = page.has_more;
    this.cursors.length = this.page + 1;
    if (page.has_more) this.cursors.push(page.last_id);
    this.list.replaceChildren(...page.data.map((video) => this.card(video)));
    this.empty.hidden = page.data.length > 0;
    this.newer.disabled = this.page === 0;
    this.older.disabled = !page.has_more;
    this.label.textContent = `Page ${this.page + 1}`;
    this.section.dataset.loaded = "true";
  }

  card(video) {
    const done = video.status === "completed";
    const media = h("div", { class: "media" });
    if (done) {
      thumbnailURL(video.id).then(
        (src) => media.querySelector("video") || media.replaceChildren(thumbnail(src, video.id)),
        () => media.replaceChildren(h("div", { class: "placeholder" }, "no thumbnail")),
      );
    } else {
      media.append(h("div", { class: "placeholder" }, video.status.replace("_", " ")));
    }
    const error = h("p", { class: "error" }, video.error?.message || "");
    const action = (label, cls, run) =>
      h("button", { type: "button", class: cls, onclick: (e) => run(e.currentTarget) }, label);
    const report = (err) => {
      error.textContent = err.message;
    };
    return h(
      "li",
      { class: "video-card", dataset: { id: video.id, status: video.status } },
      media,
      h(
        "div",
        { class: "body" },
        h("p", { class: "prompt", title: video.prompt }, video.prompt),
        video.negative_prompt
          ? h("p", { class: "negative" }, `not: ${video.negative_prompt}`)
          : null,
        h("p", { class: "params" }, describeVideo(video)),
        h(
          "p",
          { class: "meta" },
          `${video.status.replace("_", " ")} · ${formatTime(video.created_at)}`,
        ),
        error,
        h(
          "div",
          { class: "actions" },
          done && action("Play", "play", () => play(media, video.id).catch(report)),
          done && action("Download", "download", () => download(video.id).catch(report)),
          action("Remix", "remix", () => this.onRemix(video)),
          this.armedLabel(
            video.id,
            action(TERMINAL.has(video.status) ? "Delete" : "Cancel", "delete danger", (button) =>
              this.remove(video, button).catch(report),
            ),
          ),
        ),
      ),
    );
  }

  // A card's Delete button as the video's armed state says: "Really?" while it is armed.
  armedLabel(id, button) {
    button.dataset.label = button.textContent;
    if (this.armed.has(id)) button.textContent = "Really?";
    return button;
  }

  // Delete asks twice: the first click arms the video's button for a few seconds.
  async remove(video, button) {
    if (!this.armed.has(video.id)) {
      this.armed.add(video.id);
      button.textContent = "Really?";
      setTimeout(() => {
        this.armed.delete(video.id);
        const shown = this.list.querySelector(
          `.video-card[data-id="${CSS.escape(video.id)}"] button.delete`,
        );
        if (shown) shown.textContent = shown.dataset.label;
      }, CONFIRM_MS);
      return;
    }
    this.armed.delete(video.id);
    button.disabled = true;
    try {
      await request("DELETE", `v1/videos/${encodeURIComponent(video.id)}`);
    } catch (err) {
      if (!(err instanceof APIError) || err.status !== 404) throw err;
    } finally {
      button.disabled = false;
    }
    forgetVideo(video.id);
    await this.load();
  }
}
