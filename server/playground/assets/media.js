// A finished video's thumbnail and MP4 (GET /v1/videos/{id}/content), shown from signed links
// (see `linkURL`): the thumbnail first, then the clip playing in its place, streamed by the
// browser itself.

import { forget, linkURL } from "./api.js";
import { h } from "./dom.js";

function contentPath(videoId) {
  return `v1/videos/${encodeURIComponent(videoId)}/content`;
}

export function thumbnailURL(videoId) {
  return linkURL(contentPath(videoId), { variant: "thumbnail" });
}

export function videoURL(videoId) {
  return linkURL(contentPath(videoId), { variant: "video" });
}

// Drop a deleted video's links.
export function forgetVideo(videoId) {
  forget(contentPath(videoId));
}

export function thumbnail(src, videoId) {
  return h("img", { src, alt: `first frame of ${videoId}`, class: "thumb" });
}

// Show the thumbnail in `box`, then the playing clip; resolves to the <video> element.
export async function play(box, videoId) {
  const poster = await thumbnailURL(videoId);
  if (!box.querySelector("video")) box.replaceChildren(thumbnail(poster, videoId));
  const src = await videoURL(videoId);
  const video = h("video", { src, poster, controls: true, loop: true, playsinline: true });
  video.muted = true; // the property, not only the attribute: browsers autoplay muted clips only
  video.autoplay = true;
  video.dataset.id = videoId;
  box.replaceChildren(video);
  return video;
}

// Save the MP4 under its id's name.
export async function download(videoId) {
  const link = h("a", { href: await videoURL(videoId), download: `${videoId}.mp4` });
  document.body.append(link);
  link.click();
  link.remove();
}
