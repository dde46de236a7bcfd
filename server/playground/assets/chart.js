// The loss chart of a fine-tuning job, in SVG: the training loss, one point per `metrics` event
// (step, loss), joined by a line; and the held-out loss, one marked point per checkpoint, joined by
// a dashed line; on linear axes fitted to both.

import { svg } from "./dom.js";

const WIDTH = 520;
const HEIGHT = 220;
const PAD = { left: 56, right: 18, top: 26, bottom: 32 };
const Y_TICKS = 4;

function extent(values) {
  let low = Infinity;
  let high = -Infinity;
  for (const v of values) {
    low = Math.min(low, v);
    high = Math.max(high, v);
  }
  return [low, high];
}

function label(value) {
  return Math.abs(value) >= 1000 || (value !== 0 && Math.abs(value) < 0.01)
    ? value.toExponential(1)
    : Number(value.toPrecision(3)).toString();
}

// `points`, `heldOut`: [{step, loss}] in step order (the training and the held-out loss).
export function lossChart(points, heldOut = []) {
  const held = heldOut.length ? ` and held-out loss at ${heldOut.length} checkpoints` : "";
  const chart = svg("svg", {
    class: "loss-chart",
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    role: "img",
    "aria-label": `training loss over ${points.length} steps${held}`,
    "data-points": points.length,
    "data-held-out": heldOut.length,
  });
  if (!points.length) {
    chart.append(
      svg(
        "text",
        { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "empty" },
        "no steps yet",
      ),
    );
    return chart;
  }
  const all = [...points, ...heldOut];
  let [x0, x1] = extent(all.map((p) => p.step));
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  let [y0, y1] = extent(all.map((p) => p.loss));
  const margin = (y1 - y0) * 0.08 || Math.abs(y1) * 0.1 || 1;
  [y0, y1] = [y0 - margin, y1 + margin];
  const x = (step) => PAD.left + ((step - x0) / (x1 - x0)) * (WIDTH - PAD.left - PAD.right);
  const y = (loss) =>
    HEIGHT - PAD.bottom - ((loss - y0) / (y1 - y0)) * (HEIGHT - PAD.top - PAD.bottom);

  for (let i = 0; i <= Y_TICKS; i += 1) {
    const value = y0 + ((y1 - y0) * i) / Y_TICKS;
    chart.append(
      svg("line", {
        class: "grid",
        x1: PAD.left,
        x2: WIDTH - PAD.right,
        y1: y(value),
        y2: y(value),
      }),
      svg(
        "text",
        { class: "tick", x: PAD.left - 6, y: y(value) + 4, "text-anchor": "end" },
        label(value),
      ),
    );
  }
  const first = points[0].step;
  const last = points.at(-1).step;
  for (const step of first === last ? [first] : [first, last]) {
    chart.append(
      svg(
        "text",
        { class: "tick", x: x(step), y: HEIGHT - PAD.bottom + 16, "text-anchor": "middle" },
        step,
      ),
    );
  }
  chart.append(
    svg(
      "text",
      {
        class: "axis",
        x: (PAD.left + WIDTH - PAD.right) / 2,
        y: HEIGHT - 2,
        "text-anchor": "middle",
      },
      "step",
    ),
    svg("text", { class: "axis", x: 8, y: 14 }, "loss"),
    svg("polyline", {
      class: "loss-line",
      points: points.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" "),
    }),
  );
  const end = points.at(-1);
  chart.append(
    svg(
      "circle",
      { class: "loss-last", cx: x(end.step), cy: y(end.loss), r: 3.5 },
      svg("title", {}, `step ${end.step}: loss ${end.loss}`),
    ),
  );
  if (heldOut.length) {
    chart.append(
      svg("polyline", {
        class: "held-out-line",
        points: heldOut.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" "),
      }),
      ...heldOut.map((p) =>
        svg(
          "circle",
          { class: "held-out-point", cx: x(p.step), cy: y(p.loss), r: 3 },
          svg("title", {}, `step ${p.step}: held-out loss ${p.loss}`),
        ),
      ),
      // The legend, top right: which line is which.
      svg("line", { class: "loss-line", x1: WIDTH - 190, x2: WIDTH - 172, y1: 10, y2: 10 }),
      svg("text", { class: "tick", x: WIDTH - 168, y: 14 }, "training"),
      svg("line", { class: "held-out-line", x1: WIDTH - 104, x2: WIDTH - 86, y1: 10, y2: 10 }),
      svg("text", { class: "tick", x: WIDTH - 82, y: 14 }, "held-out"),
    );
  }
  return chart;
}
