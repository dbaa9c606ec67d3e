// poslab's pages: the pieces every report.html shares (elements, ticks, and a chart of curves
// with bands and a hover read-out). Plain JavaScript, no dependency and no network. A page's
// own script uses them as `poslab.el`, `poslab.chart`, ... Errors on the page are recorded in
// <body data-errors> (what poslab's browser tests read).
"use strict";
window.addEventListener("error", function (e) {
  const b = document.body;
  b.dataset.errors = (b.dataset.errors ? b.dataset.errors + " | " : "") + e.message;
});

const poslab = (function () {
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k.startsWith("data-")) e.setAttribute(k, v);
      else if (k === "class") e.className = v;
      else e[k] = v;
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }
  // Ticks: about `n` round values over [lo, hi].
  function ticks(lo, hi, n) {
    const span = hi - lo || 1;
    const raw = span / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || 10 * mag;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9 * span; t += step) out.push(t);
    return out;
  }
  const fmt = (v, d) =>
    (Number.isInteger(v) || Math.abs(v) >= 100 || d === 0 ? v.toFixed(0) : v.toFixed(d));

  // A chart of curves with bands: `spec` = {title, series() -> [{variant, points: [[x, mean,
  // low, high, seeds, examples]]}], colour(variant), hidden(variant), xLabel, yLabel, log,
  // yRange, guides: [{x} | {y, label}], xName, xDecimals, decimals, examples, describe(point)}. Returns the
  // function that draws it again (after a change of what is shown).
  function chart(parent, spec) {
    const colour = spec.colour;
    const hidden = { has: (v) => (spec.hidden ? spec.hidden(v) : false) };
    const W = 540, H = 330, L = 56, R = 14, T = 12, B = 44;
    const box = el("div", { class: "chart" });
    const title = el("div", { class: "title" }, spec.title);
    const tip = el("div", { class: "tip" });
    const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
    const legend = el("div", { class: "legend" });
    box.append(title, root, legend, tip);
    parent.append(box);
    function draw() {
      root.replaceChildren();
      const series = spec.series().filter((s) => !hidden.has(s.variant) && s.points.length);
      legend.replaceChildren(...series.map((s) => {
        const sw = el("span", { class: "swatch" });
        sw.style.background = colour(s.variant);
        return el("span", { class: "key" }, sw, s.variant);
      }));
      const pts = series.flatMap((s) => s.points);
      let x0 = Math.min(...pts.map((p) => p[0]), Infinity), x1 = Math.max(...pts.map((p) => p[0]), -Infinity);
      if (!isFinite(x0)) { x0 = 0; x1 = 1; }
      if (x1 === x0) { x0 -= 1; x1 += 1; }
      const ty = spec.log ? (v) => Math.log10(Math.max(v, 1e-6)) : (v) => v;
      let y0, y1;
      if (spec.yRange) { [y0, y1] = spec.yRange; } else {
        const ys = pts.flatMap((p) => [p[2], p[3]]).filter((v) => v > 0).map(ty);
        y0 = ys.length ? Math.min(...ys) : -3; y1 = ys.length ? Math.max(...ys) : 1;
        const pad = (y1 - y0 || 1) * 0.06; y0 -= pad; y1 += pad;
      }
      const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
      const Y = (y) => T + (1 - (ty(y) - y0) / (y1 - y0)) * (H - T - B);
      // Grid and axes.
      const yt = spec.log ? ticks(Math.ceil(y0), Math.floor(y1), 6).filter(Number.isInteger)
        : ticks(y0, y1, 6);
      for (const t of yt) {
        const v = spec.log ? Math.pow(10, t) : t;
        root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: Y(v), y2: Y(v) }));
        const label = svg("text", { x: L - 6, y: Y(v) + 4, "text-anchor": "end" });
        label.textContent = spec.log ? (Math.abs(t) >= 4 ? "1e" + t : String(v)) : fmt(t, 1);
        root.append(label);
      }
      for (const t of ticks(x0, x1, 8)) {
        root.append(svg("line", { class: "grid", x1: X(t), x2: X(t), y1: T, y2: H - B }));
        const label = svg("text", { x: X(t), y: H - B + 15, "text-anchor": "middle" });
        label.textContent = fmt(t, 0);
        root.append(label);
      }
      root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
      root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
      const xl = svg("text", { x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle" });
      xl.textContent = spec.xLabel;
      const yl = svg("text", { x: 14, y: (T + H - B) / 2, "text-anchor": "middle",
        transform: `rotate(-90 14 ${(T + H - B) / 2})` });
      yl.textContent = spec.yLabel;
      root.append(xl, yl);
      for (const g of spec.guides || []) {
        if (g.x !== undefined && g.x > x0 && g.x < x1) {
          root.append(svg("line", { class: "guide", x1: X(g.x), x2: X(g.x), y1: T, y2: H - B }));
        }
        if (g.y !== undefined) {
          root.append(svg("line", { class: "guide", x1: L, x2: W - R, y1: Y(g.y), y2: Y(g.y) }));
          const t = svg("text", { x: W - R - 4, y: Y(g.y) - 4, "text-anchor": "end" });
          t.textContent = g.label;
          root.append(t);
        }
      }
      // Bands, then lines.
      for (const s of series) {
        const c = colour(s.variant);
        const up = s.points.map((p) => `${X(p[0])},${Y(p[3])}`);
        const down = s.points.slice().reverse().map((p) => `${X(p[0])},${Y(p[2])}`);
        root.append(svg("polygon", { points: up.concat(down).join(" "), fill: c,
          "fill-opacity": 0.14, stroke: "none" }));
      }
      for (const s of series) {
        const c = colour(s.variant);
        const line = svg("polyline", { points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "),
          fill: "none", stroke: c, "stroke-width": 2, "data-variant": s.variant });
        const name = svg("title", {});
        name.textContent = s.variant;
        line.append(name);
        root.append(line);
        if (s.points.length === 1) {
          const p = s.points[0];
          root.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3.5, fill: c }));
        }
      }
      // Hover: the nearest point of every shown variant.
      const cursor = svg("line", { class: "guide", x1: 0, x2: 0, y1: T, y2: H - B,
        visibility: "hidden" });
      const overlay = svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B,
        fill: "transparent" });
      root.append(cursor, overlay);
      overlay.addEventListener("mousemove", (ev) => {
        const r = root.getBoundingClientRect();
        const x = x0 + ((ev.clientX - r.left - L) / (W - L - R)) * (x1 - x0);
        const rows = series.map((s) => {
          const p = s.points.reduce((a, b) => (Math.abs(b[0] - x) < Math.abs(a[0] - x) ? b : a));
          return [s.variant, p];
        });
        if (!rows.length) return;
        const at = rows[0][1][0];
        cursor.setAttribute("x1", X(at)); cursor.setAttribute("x2", X(at));
        cursor.setAttribute("visibility", "visible");
        tip.replaceChildren(el("div", {}, el("b", {}, spec.xName + " " + fmt(at, spec.xDecimals))),
          ...rows.map(([v, p]) => {
            const sw = el("span", { class: "swatch" });
            sw.style.background = colour(v);
            if (spec.describe) return el("div", {}, sw, v + ": " + spec.describe(p));
            const n = spec.examples && p[5] ? ", " + p[5] + " examples/seed" : "";
            return el("div", {}, sw, `${v}: ${fmt(p[1], spec.decimals)} (${fmt(p[2], spec.decimals)}` +
              ` to ${fmt(p[3], spec.decimals)}, ${p[4]} seeds${n})`);
          }));
        tip.style.display = "block";
        tip.style.left = Math.min(X(at) + 14, W - 180) + "px";
        tip.style.top = "28px";
      });
      overlay.addEventListener("mouseleave", () => {
        tip.style.display = "none";
        cursor.setAttribute("visibility", "hidden");
      });
    }
    draw();
    return draw;
  }

  return { el, svg, ticks, fmt, chart, PALETTE };
})();
