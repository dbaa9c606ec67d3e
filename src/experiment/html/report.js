// poslab report.html: draws the page from the JSON poslab embeds (#data). Plain JavaScript, no
// dependency and no network. Every number it prints is text poslab formatted, except the
// values a hovered chart shows. When the page is drawn, <body> gets data-rendered="ok"; an
// error on the page is recorded in data-errors (what poslab's browser test reads).
"use strict";
window.addEventListener("error", function (e) {
  const b = document.body;
  b.dataset.errors = (b.dataset.errors ? b.dataset.errors + " | " : "") + e.message;
});

(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const page = document.getElementById("page");
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const SVG = "http://www.w3.org/2000/svg";
  const colour = (v) => PALETTE[Math.max(0, data.variants.indexOf(v)) % PALETTE.length];
  const hidden = new Set();
  const redraws = [];

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
  function refresh() {
    document.querySelectorAll("tr[data-variant]").forEach((tr) => {
      tr.style.display = hidden.has(tr.dataset.variant) ? "none" : "";
    });
    filterVerdicts();
    redraws.forEach((f) => f());
  }

  // Title, what was merged, and the variant toggles.
  page.append(el("h1", {}, data.title));
  if (data.partial) page.append(el("p", { class: "partial" }, data.partial));
  if (data.sources.length) {
    page.append(el("p", { class: "muted" }, "Merged from: " + data.sources.join(", ")));
  }
  const toggles = el("div", { class: "controls", id: "variants" }, "Variants shown: ");
  for (const v of data.variants) {
    const box = el("input", { type: "checkbox", checked: true, "data-variant": v });
    box.addEventListener("change", () => {
      if (box.checked) hidden.delete(v); else hidden.add(v);
      refresh();
    });
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = colour(v);
    toggles.append(el("label", {}, box, swatch, v));
  }
  page.append(toggles);

  // The verdicts, first.
  const evaluations = [...new Set(data.verdicts.map((d) => d.evaluation))];
  const choice = el("select", { id: "verdict-evaluation" },
    el("option", { value: "" }, "every evaluation"),
    ...evaluations.map((e) => el("option", { value: e }, e)));
  choice.addEventListener("change", filterVerdicts);
  page.append(el("h2", { id: "verdicts" }, "Verdicts"));
  if (data.verdicts.length || data.skipped.length) {
    page.append(el("p", { class: "muted" }, data.legend.replace(/`/g, "")));
    page.append(el("p", {}, el("label", {}, "Evaluation:", choice)));
    const head = el("tr", {}, ...["task", "b − a", "test", "diff", "95% interval", "p (Holm)",
      "detectable", "seeds × examples", "verdict"].map((h, i) =>
      el("th", { class: i >= 3 && i <= 7 ? "num" : "" }, h)));
    const body = data.verdicts.map((d) => el("tr", {
      class: "verdict" + (d.detected ? " detected" : ""), "data-task": d.task,
      "data-evaluation": d.evaluation, "data-a": d.a, "data-b": d.b,
    },
    el("td", {}, d.task), el("td", {}, d.b + " − " + d.a), el("td", {}, d.evaluation),
    el("td", { class: "num diff" }, d.diff), el("td", { class: "num ci" }, d.ci),
    el("td", { class: "num p-holm" }, d.p_holm), el("td", { class: "num" }, d.detectable),
    el("td", { class: "num" }, d.seeds + " × " + d.examples),
    el("td", { class: "verdict" }, d.verdict)));
    page.append(el("table", { id: "verdict-table" }, el("thead", {}, head),
      el("tbody", {}, ...body)));
    if (data.skipped.length) {
      page.append(el("p", { class: "muted" }, "Not compared: " + data.skipped.map((k) =>
        k.task + " " + k.evaluation + " (" + k.b + " − " + k.a + "): " +
        k.reason.replace(/`/g, "")).join("; ")));
    }
  } else {
    page.append(el("p", { class: "muted" }, "This run names no comparison."));
  }
  function filterVerdicts() {
    document.querySelectorAll("tr.verdict").forEach((tr) => {
      const shown = (!choice.value || tr.dataset.evaluation === choice.value) &&
        !hidden.has(tr.dataset.a) && !hidden.has(tr.dataset.b);
      tr.style.display = shown ? "" : "none";
    });
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

  // A chart of curves with seed bands: `spec` = {title, series, xLabel, yLabel, log, yRange,
  // guides: [{x} | {y, label}], unit, examples}. Redrawn when the variants shown change.
  function chart(parent, spec) {
    const W = 540, H = 330, L = 56, R = 14, T = 12, B = 44;
    const box = el("div", { class: "chart" });
    const title = el("div", { class: "title" }, spec.title);
    const tip = el("div", { class: "tip" });
    const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
    box.append(title, root, tip);
    parent.append(box);
    function draw() {
      root.replaceChildren();
      const series = spec.series().filter((s) => !hidden.has(s.variant) && s.points.length);
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
        label.textContent = spec.log ? String(v) : fmt(t, 1);
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
    redraws.push(draw);
    return draw;
  }

  // Each task: its heading, test sets, tables, notes and curves.
  for (const t of data.tasks) {
    const sec = el("section", { id: "task-" + t.name });
    sec.append(el("h2", {}, t.name));
    for (const line of t.heading) sec.append(el("p", { class: "muted" }, line));
    sec.append(el("p", { class: "muted" }, "Test sets: " + t.tests.map((s) =>
      `${s.name}: lengths ${s.lengths[0]}-${s.lengths[1]}` +
      (s.examples ? `, ${s.examples} examples` : "")).join("; ") + "."));
    for (const table of t.tables) {
      sec.append(el("h3", {}, table.title));
      const head = el("tr", {}, ...table.header.map((h, i) =>
        el("th", { class: table.right[i] ? "num" : "" }, h)));
      const rows = table.rows.map((r) => el("tr", { "data-variant": r[0] },
        ...r.map((c, i) => el("td", { class: table.right[i] ? "num" : "" }, c))));
      sec.append(el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
    }
    for (const n of t.notes) sec.append(el("p", { class: "muted" }, n));
    const charts = el("div", {});
    if (t.lengths.length) {
      const pick = el("select", { class: "curve-choice" }, ...t.lengths.map((c) =>
        el("option", { value: c.name }, c.name === "lengths" ? "every test set, by length" : c.name)));
      const current = () => t.lengths.find((c) => c.name === pick.value) || t.lengths[0];
      const guides = [{ x: t.trained + 0.5 }];
      if (t.ceiling !== null) guides.push({ y: t.ceiling, label: "order-blind ceiling" });
      const redraw = chart(charts, {
        title: t.name + ": " + t.metric + " by input length", series: () => current().series,
        xLabel: "input length (dashed: the longest trained)", yLabel: t.metric + " (%)",
        yRange: [0, 102], guides, xName: "length", xDecimals: 1, decimals: 1, examples: true,
      });
      pick.addEventListener("change", redraw);
      charts.firstChild.querySelector(".title").append(el("label", {}, " — curve:", pick));
    }
    chart(charts, {
      title: t.name + ": training loss", series: () => t.loss.series, log: true,
      xLabel: "step", yLabel: "cross-entropy (log scale)", xName: "step", xDecimals: 0,
      decimals: 4, examples: false,
    });
    sec.append(charts);
    page.append(sec);
  }

  page.append(el("h2", {}, "How these numbers are computed"));
  page.append(el("p", {}, data.method.replace(/`/g, "")));
  page.append(el("p", {}, data.curve_method));
  page.append(el("p", { class: "muted" }, "Written by poslab. This page fetches nothing: its " +
    "data, style and script are all in this file."));
  refresh();
  document.body.dataset.rendered = "ok";
})();
