// The Create form: a model from GET /v1/models (its defaults fill the form, its limits show under
// it), a prompt and the sampling parameters. POST /v1/videos queues the video; the server checks
// every value (one rule, in one place) and its error shows beside the field it names.

import { APIError, request } from "./api.js";
import { clearErrors, numberIn, showError } from "./dom.js";

// The files a model may take: the input it lists in `inputs`, its field, the form field it goes in.
const FILE_INPUTS = [
  ["image", "#image-field", "input_reference"],
  ["last_image", "#last-image-field", "last_frame"],
  ["video", "#video-field", "input_video"],
  ["control_video", "#vace-field", "control_video"],
  ["mask", "#vace-field", "mask"],
  ["reference_images", "#vace-field", "reference_images"],
  ["pose_video", "#animate-field", "pose_video"],
  ["face_video", "#animate-field", "face_video"],
  ["background_video", "#animate-field", "background_video"],
  ["background_mask", "#animate-field", "background_mask"],
];

// A rolled seed is below 2**31, like the seeds the server draws for requests without one.
function rollSeed() {
  return crypto.getRandomValues(new Uint32Array(1))[0] >>> 1;
}

export function modelLabel(model) {
  return model.kind === "fine-tune" && model.parent
    ? `${model.id} (fine-tune of ${model.parent})`
    : model.id;
}

export function describeLimits(model) {
  const { defaults: d, limits: l } = model;
  const [multipleH, multipleW] = l.size_multiple;
  let frames = `1 to ${l.max_frames} frames`;
  if (l.frames_multiple > 1) {
    const offset = l.frames_offset ? ` + ${l.frames_offset}` : "";
    frames += ` (${l.frames_multiple}k${offset})`;
  }
  return (
    `Takes ${frames}, sides up to ${l.max_size} px in multiples of ${multipleW}×${multipleH}, ` +
    `prompts up to ${l.max_prompt_tokens} ${l.prompt_unit}. ` +
    `Defaults: ${d.size.replace("x", "×")}, ${d.num_frames} frames at ${d.fps} fps, ` +
    `${d.num_inference_steps} steps, guidance ${d.guidance_scale}.`
  );
}

// Fill a <select> with models, keeping the chosen one when it is still served.
export function fillModelSelect(select, models, wanted = select.value) {
  select.replaceChildren(
    ...models.map((m) => new Option(modelLabel(m), m.id, false, m.id === wanted)),
  );
  if (!models.some((m) => m.id === wanted) && models.length) select.value = models[0].id;
}

export class CreateForm {
  constructor(form, { onCreated }) {
    this.form = form;
    this.onCreated = onCreated;
    this.models = [];
    this.fields = form.elements;
    this.note = form.querySelector("#remix-note");
    this.fields.model.addEventListener("change", () => this.applyModel({ defaults: true }));
    for (const radio of form.querySelectorAll("input[name=length]")) {
      radio.addEventListener("change", () => this.setLength(radio.value));
    }
    form.querySelector("#dice").addEventListener("click", () => {
      this.fields.seed.value = rollSeed();
    });
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.submit();
    });
  }

  get model() {
    return this.models.find((m) => m.id === this.fields.model.value) || null;
  }

  setModels(models) {
    const before = this.fields.model.value;
    this.models = models;
    fillModelSelect(this.fields.model, models);
    this.applyModel({ defaults: this.fields.model.value !== before });
  }

  select(modelId) {
    if (!this.models.some((m) => m.id === modelId)) return false;
    this.fields.model.value = modelId;
    this.applyModel({ defaults: true });
    return true;
  }

  // Show the model's limits and the fields it takes; with `defaults`, fill in its defaults.
  applyModel({ defaults }) {
    const model = this.model;
    const limits = this.form.querySelector("#model-limits");
    limits.textContent = model ? describeLimits(model) : "No model is served.";
    // A model announces each file it takes among its inputs: "image" (a first frame),
    // "last_image" (a last frame besides), "video" (an input video, with a strength), a VACE
    // model's "reference_images", "control_video" and "mask" (with a conditioning scale), and a
    // Wan Animate model's "pose_video", "face_video", "background_video" and "background_mask"
    // (its "image" is the character to move, not a first frame).
    for (const [input, selector, name] of FILE_INPUTS) {
      const field = this.form.querySelector(selector);
      field.hidden = !model?.inputs?.includes(input);
      if (field.hidden) this.fields[name].value = "";
    }
    this.form.querySelector("label[for=create-image]").textContent = model?.limits?.animate_input
      ? "Character image"
      : "First frame";
    this.showAdapters(model?.adapters || []);
    this.showCachePolicies(model?.limits?.cache_policies);
    if (!model) return;
    const [multipleH, multipleW] = model.limits.size_multiple;
    Object.assign(this.fields.width, { step: multipleW, max: model.limits.max_size });
    Object.assign(this.fields.height, { step: multipleH, max: model.limits.max_size });
    this.fields.num_frames.max = model.limits.max_frames;
    if (!defaults) return;
    const d = model.defaults;
    const [width, height] = d.size.split("x");
    this.setLength("frames");
    this.set({
      width,
      height,
      num_frames: d.num_frames,
      fps: d.fps,
      num_inference_steps: d.num_inference_steps,
      guidance_scale: d.guidance_scale,
    });
    this.note.hidden = true;
  }

  // One row per adapter the model has registered: a checkbox and its scale.
  showAdapters(adapters) {
    const field = this.form.querySelector("#lora-field");
    const box = this.form.querySelector("#create-loras");
    field.hidden = adapters.length === 0;
    box.replaceChildren(
      ...adapters.map((a) => {
        const row = document.createElement("label");
        row.className = "lora";
        const use = Object.assign(document.createElement("input"), { type: "checkbox" });
        use.dataset.lora = a.name;
        const scale = Object.assign(document.createElement("input"), {
          type: "number",
          step: "0.05",
          value: "1",
          title: `scale of ${a.name}`,
        });
        scale.dataset.loraScale = a.name;
        row.append(use, ` ${a.name} (rank ${a.rank}) `, scale);
        return row;
      }),
    );
  }

  // Step-cache choices that name a policy ({"policy", "threshold"} as JSON) the model does not
  // run (its limits' cache_policies; all of them when it does not say) are disabled.
  showCachePolicies(policies) {
    const select = this.fields.cache;
    for (const option of select.options) {
      if (!option.value.startsWith("{")) continue;
      const { policy } = JSON.parse(option.value);
      option.disabled = Boolean(policies) && !policies.includes(policy);
    }
    if (select.selectedOptions[0]?.disabled) select.value = "off";
  }

  // The adapters ticked, in the order listed, as the request's `loras`.
  loras() {
    if (this.form.querySelector("#lora-field").hidden) return [];
    return [...this.form.querySelectorAll("input[data-lora]")]
      .filter((box) => box.checked)
      .map((box) => {
        const scale = this.form.querySelector(`input[data-lora-scale="${box.dataset.lora}"]`);
        const value = numberIn(scale);
        if (Number.isNaN(value)) {
          throw new APIError(`loras: the scale of ${box.dataset.lora} is not a number`, {
            param: "loras",
          });
        }
        return value === undefined ? { name: box.dataset.lora } : { name: box.dataset.lora, scale: value };
      });
  }

  set(values) {
    for (const [name, value] of Object.entries(values)) this.fields[name].value = value ?? "";
  }

  setLength(mode) {
    const frames = mode === "frames";
    this.form.querySelector(`input[name=length][value=${mode}]`).checked = true;
    const fps = numberIn(this.fields.fps) || this.model?.defaults.fps;
    if (frames && this.fields.num_frames.hidden && this.fields.seconds.value) {
      this.fields.num_frames.value = Math.round(Number(this.fields.seconds.value) * fps);
    } else if (!frames && this.fields.seconds.hidden && this.fields.num_frames.value) {
      this.fields.seconds.value = Number(this.fields.num_frames.value) / fps;
    }
    this.fields.num_frames.hidden = !frames;
    this.fields.seconds.hidden = frames;
  }

  // Put a video's parameters back into the form ("remix").
  fill(video) {
    clearErrors(this.form);
    const served = this.select(video.model);
    const [width, height] = video.size.split("x");
    this.setLength("frames");
    this.set({
      prompt: video.prompt,
      negative_prompt: video.negative_prompt,
      width,
      height,
      num_frames: video.num_frames,
      fps: video.fps,
      num_inference_steps: video.num_inference_steps,
      guidance_scale: video.guidance_scale,
      seed: video.seed,
      segment_frame_length: video.segment_frame_length,
      prev_segment_conditioning_frames: video.prev_segment_conditioning_frames,
    });
    this.fields.cache.value = cacheChoice(this.fields.cache, video.cache);
    this.fields.sampler.value = video.sampler === "scheduler" ? "" : video.sampler || "";
    const interval = JSON.stringify(video.guidance_interval || "");
    const known = [...this.fields.guidance_interval.options].some((o) => o.value === interval);
    this.fields.guidance_interval.value = video.guidance_interval && known ? interval : "";
    for (const choice of video.loras || []) {
      const box = this.form.querySelector(`input[data-lora="${choice.name}"]`);
      const scale = this.form.querySelector(`input[data-lora-scale="${choice.name}"]`);
      if (box) box.checked = true;
      if (scale) scale.value = choice.scale;
    }
    this.note.textContent = served
      ? `Parameters of ${video.id}.`
      : `Parameters of ${video.id}; its model ${video.model} is no longer served.`;
    this.note.hidden = false;
    this.fields.prompt.focus();
  }

  // The request body; a number the browser could not read is refused here, named as the API
  // would name it.
  body() {
    const f = this.fields;
    const number = (input, param) => {
      const value = numberIn(input);
      if (Number.isNaN(value)) throw new APIError(`${param}: not a number`, { param });
      return value;
    };
    const body = { prompt: f.prompt.value };
    if (f.model.value) body.model = f.model.value;
    if (f.negative_prompt.value.trim()) body.negative_prompt = f.negative_prompt.value;
    const width = number(f.width, "size");
    const height = number(f.height, "size");
    if (width !== undefined || height !== undefined) body.size = `${width ?? ""}x${height ?? ""}`;
    if (f.num_frames.hidden) body.seconds = number(f.seconds, "seconds");
    else body.num_frames = number(f.num_frames, "num_frames");
    body.fps = number(f.fps, "fps");
    body.num_inference_steps = number(f.num_inference_steps, "num_inference_steps");
    body.guidance_scale = number(f.guidance_scale, "guidance_scale");
    body.seed = number(f.seed, "seed");
    // A preset's name, or a remixed video's own cache ({"policy", "threshold"} as JSON, and
    // "forecast" when it has one).
    const cache = f.cache.value;
    if (cache !== "off") body.cache = cache.startsWith("{") ? JSON.parse(cache) : cache;
    if (f.sampler.value) body.sampler = f.sampler.value;
    if (f.guidance_interval.value) body.guidance_interval = JSON.parse(f.guidance_interval.value);
    const loras = this.loras();
    if (loras.length) body.loras = loras;
    // With an input video, how much of the schedule runs (the server's default when empty).
    if (!this.form.querySelector("#video-field").hidden) {
      body.strength = number(f.strength, "strength");
    }
    // A VACE model's weight of its hints (the server's default when empty).
    if (!this.form.querySelector("#vace-field").hidden) {
      body.conditioning_scale = number(f.conditioning_scale, "conditioning_scale");
    }
    // A Wan Animate model's segments (the server's defaults when empty: one segment, carrying 1).
    if (!this.form.querySelector("#animate-field").hidden) {
      body.segment_frame_length = number(f.segment_frame_length, "segment_frame_length");
      body.prev_segment_conditioning_frames = number(
        f.prev_segment_conditioning_frames,
        "prev_segment_conditioning_frames",
      );
    }
    for (const name of Object.keys(body)) if (body[name] === undefined) delete body[name];
    return body;
  }

  async submit() {
    const button = this.form.querySelector("#generate");
    clearErrors(this.form);
    button.disabled = true;
    try {
      const body = this.body();
      const shown = (selector) => !this.form.querySelector(selector).hidden;
      // Every file of each shown field: reference images may be several (the field repeated).
      const files = FILE_INPUTS.filter(([, selector]) => shown(selector)).flatMap(([, , name]) =>
        Array.from(this.fields[name].files, (file) => [name, file]),
      );
      let video;
      if (files.length) {
        // Files go as multipart, the other fields as form values beside them.
        const form = new FormData();
        for (const [name, value] of Object.entries(body)) {
          form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
        }
        for (const [name, file] of files) form.append(name, file);
        video = await request("POST", "v1/videos", { form });
      } else {
        video = await request("POST", "v1/videos", { json: body });
      }
      this.onCreated(video);
    } catch (err) {
      if (!(err instanceof APIError)) throw err;
      showError(this.form, err);
    } finally {
      button.disabled = false;
    }
  }
}

// The Create form's choice for a video's step cache as resolved (null: off): an option holding
// that policy, threshold and forecast (when it has one), made the first time one is needed.
function cacheChoice(select, cache) {
  if (!cache) return "off";
  const { policy, threshold, forecast } = cache;
  const value = JSON.stringify(forecast ? { policy, threshold, forecast } : { policy, threshold });
  if (![...select.options].some((option) => option.value === value)) {
    select.add(new Option(`${policy} ${threshold}${forecast ? ` ${forecast}` : ""}`, value));
  }
  return value;
}
