// Small helpers for building elements and for showing the API's errors beside their fields.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(element, props, children) {
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") element.setAttribute("class", value);
    else if (name === "text") element.textContent = value;
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

// h("button", {class: "primary", onclick: go}, "Go") -> <button class="primary">Go</button>
export function h(tag, props, ...children) {
  return build(document.createElement(tag), props, children);
}

export function svg(tag, props, ...children) {
  return build(document.createElementNS(SVG_NS, tag), props, children);
}

export function setProgress(bar, percent) {
  const value = Math.max(0, Math.min(100, Math.round(percent)));
  bar.setAttribute("aria-valuenow", String(value));
  bar.querySelector(".bar").style.width = `${value}%`;
}

export function progressBar(label) {
  return h(
    "div",
    {
      class: "progress",
      role: "progressbar",
      "aria-label": label,
      "aria-valuemin": "0",
      "aria-valuemax": "100",
      "aria-valuenow": "0",
    },
    h("div", { class: "bar" }),
  );
}

export function clearErrors(form) {
  for (const field of form.querySelectorAll(".invalid")) field.classList.remove("invalid");
  for (const slot of form.querySelectorAll(".error")) slot.textContent = "";
}

// Show an API error beside the field its `param` names (`data-param`, or `data-also` for a
// field that answers to a second name), else at the form's foot. Returns the field, if any.
export function showError(form, err) {
  clearErrors(form);
  const param = err.param || "";
  const field = [...form.querySelectorAll(".field")].find(
    (f) => f.dataset.param === param || f.dataset.also === param,
  );
  if (field && !field.hidden) {
    field.classList.add("invalid");
    field.querySelector(".error").textContent = err.message;
    field.querySelector("input:not([hidden]):not([type=radio]), select, textarea")?.focus();
    return field;
  }
  form.querySelector(".form-error").textContent = err.message;
  return null;
}

// A number field: undefined when empty, NaN when the browser could not read what was typed.
export function numberIn(input) {
  if (input.validity.badInput) return NaN;
  return input.value.trim() === "" ? undefined : Number(input.value);
}

export function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["kB", "MB", "GB", "TB"];
  let value = n;
  let unit = -1;
  do {
    value /= 1024;
    unit += 1;
  } while (value >= 1024 && unit < units.length - 1);
  return `${value.toFixed(value < 10 ? 1 : 0)} ${units[unit]}`;
}

export function formatTime(unixSeconds) {
  return new Date(unixSeconds * 1000).toLocaleString();
}

// The parameters a video was made with, in one line.
export function describeVideo(v) {
  const parts = [
    v.model,
    v.size?.replace("x", "×"),
    `${v.num_frames} frames @ ${v.fps} fps`,
    `${v.num_inference_steps} steps`,
    // With a step cache, the passes of the model those steps took.
    v.cache
      ? `${v.passes} passes (cache ${v.cache.policy} ${v.cache.threshold}` +
        `${v.cache.forecast ? ` ${v.cache.forecast}` : ""})`
      : null,
    `guidance ${v.guidance_scale}`,
    `seed ${v.seed}`,
    // A repeated request, answered with an earlier video's MP4 (no pass ran).
    v.cached_from ? `reused from ${v.cached_from}` : null,
  ];
  return parts.filter(Boolean).join(" · ");
}
