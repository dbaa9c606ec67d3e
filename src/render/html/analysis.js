// poslab analyze's report.html: draws the analysis from the JSON poslab embeds (#data) with
// the shared pieces of chart.js. When the page is drawn, <body> gets data-rendered="ok".
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const page = document.getElementById("page");
  const { el, svg, fmt, PALETTE } = poslab;
  const section = (title) => {
    const s = el("section", {}, el("h2", {}, title));
    page.append(s);
    return s;
  };
  // A chart of named lines (no seeds): colours by the line's place.
  function lines(parent, spec, names) {
    const colour = (v) => PALETTE[Math.max(0, names.indexOf(v)) % PALETTE.length];
    return poslab.chart(parent, Object.assign({ colour }, spec));
  }

  page.append(el("h1", {}, data.title));
  page.append(el("pre", { class: "summary" }, data.summary));

  // The table as a heatmap, one base at a time.
  if (data.heatmaps.length) {
    const sec = section("The table: position × dimension");
    const pick = el("select", { id: "heatmap-base" },
      ...data.heatmaps.map((h, i) => el("option", { value: String(i) }, h.label)));
    sec.append(el("p", {}, el("label", {}, "Table:", pick)));
    const box = el("div", { class: "chart" });
    const canvas = el("canvas", { id: "heatmap" });
    const tip = el("div", { class: "tip" });
    const legend = el("p", { class: "muted" });
    box.append(canvas, tip);
    sec.append(box, legend);
    const W = 720;
    function drawHeatmap() {
      const h = data.heatmaps[Number(pick.value) || 0];
      const max = Math.max(...h.values.map(Math.abs), 1e-12);
      // One pixel per value, scaled by the style sheet without smoothing.
      canvas.width = h.dim; canvas.height = h.rows;
      const ctx = canvas.getContext("2d");
      const image = ctx.createImageData(h.dim, h.rows);
      h.values.forEach((value, i) => {
        const v = value / max;
        // Blue (negative) through white to red (positive).
        const t = Math.min(1, Math.abs(v));
        const end = v < 0 ? [33, 102, 172] : [178, 24, 43];
        end.forEach((e, k) => { image.data[4 * i + k] = Math.round(255 + (e - 255) * t); });
        image.data[4 * i + 3] = 255;
      });
      ctx.putImageData(image, 0, 0);
      legend.textContent = `${h.rows} rows (positions ${h.start} to ${h.start + (h.rows - 1) * h.step}` +
        `${h.step > 1 ? ", every " + h.step + "th" : ""}) × ${h.dim} dimensions; colour: value ` +
        `over the largest |value| (${fmt(max, 3)}), blue negative, red positive. Hover for values.`;
      canvas.onmousemove = (ev) => {
        const r = canvas.getBoundingClientRect();
        const c = Math.floor(((ev.clientX - r.left) / r.width) * h.dim);
        const row = Math.floor(((ev.clientY - r.top) / r.height) * h.rows);
        if (c < 0 || c >= h.dim || row < 0 || row >= h.rows) return;
        tip.textContent = `position ${h.start + row * h.step}, dimension ${c}: ` +
          fmt(h.values[row * h.dim + c], 4);
        tip.style.display = "block";
        tip.style.left = Math.min(ev.clientX - r.left + 14, W - 220) + "px";
        tip.style.top = Math.max(ev.clientY - r.top - 30, 0) + "px";
      };
      canvas.onmouseleave = () => { tip.style.display = "none"; };
    }
    pick.addEventListener("change", () => { drawHeatmap(); drawClock(); });
    drawHeatmap();

    // The clock of one frequency pair.
    const clockSec = section("The clock of one frequency pair");
    const slider = el("input", { type: "range", min: "0", max: String(data.pairs.length - 1),
      value: "0", id: "clock-pair" });
    const label = el("span", {});
    clockSec.append(el("p", {}, el("label", {}, "Pair: ", slider, " "), label));
    const S = 360;
    const clock = svg("svg", { width: S, height: S, viewBox: `0 0 ${S} ${S}`, id: "clock" });
    const clockBox = el("div", { class: "chart" });
    clockBox.append(clock);
    clockSec.append(clockBox, el("p", { class: "muted" }, "Each point is a position's value " +
      "in the pair's two columns, from the first position (light) to the last (dark), joined " +
      "in order. A sinusoid's or RoPE's pair turns around a circle, one turn per wavelength."));
    function drawClock() {
      const h = data.heatmaps[Number(pick.value) || 0];
      const [a, b] = data.pairs[Number(slider.value)] || [0, 1];
      clock.replaceChildren();
      const xs = [], ys = [];
      for (let r = 0; r < h.rows; r++) {
        xs.push(h.values[r * h.dim + a]); ys.push(h.values[r * h.dim + b]);
      }
      const m = Math.max(...xs.map(Math.abs), ...ys.map(Math.abs), 1e-12) * 1.1;
      const X = (v) => S / 2 + (v / m) * (S / 2 - 10), Y = (v) => S / 2 - (v / m) * (S / 2 - 10);
      clock.append(svg("line", { class: "axis", x1: 0, x2: S, y1: S / 2, y2: S / 2 }));
      clock.append(svg("line", { class: "axis", x1: S / 2, x2: S / 2, y1: 0, y2: S }));
      clock.append(svg("polyline", { points: xs.map((x, i) => `${X(x)},${Y(ys[i])}`).join(" "),
        fill: "none", stroke: "#9aa4ae", "stroke-width": 1 }));
      xs.forEach((x, i) => {
        const t = h.rows > 1 ? i / (h.rows - 1) : 0;
        const dot = svg("circle", { cx: X(x), cy: Y(ys[i]), r: 3,
          fill: `rgb(${Math.round(160 - 130 * t)},${Math.round(190 - 110 * t)},${Math.round(230 - 90 * t)})` });
        const title = svg("title", {});
        title.textContent = `position ${h.start + i * h.step}: (${fmt(x, 3)}, ${fmt(ys[i], 3)})`;
        dot.append(title);
        clock.append(dot);
      });
      const w = data.wavelengths && data.wavelengths.series[Number(pick.value)];
      const wl = w && w[1][Number(slider.value)] ? `, wavelength ${fmt(w[1][Number(slider.value)][1], 1)} positions` : "";
      label.textContent = `pair ${slider.value}: columns ${a} and ${b}${wl}`;
    }
    slider.addEventListener("input", drawClock);
    drawClock();
  }

  // Metrics against the offset.
  if (data.offsets.length) {
    const sec = section("Against the offset: dot product, cosine and L2 distance");
    const pick = el("select", { id: "offset-metric" },
      ...data.offsets.map((o, i) => el("option", { value: String(i) }, o.metric)));
    const dot = data.offsets.findIndex((o) => o.metric === "dot product");
    if (dot >= 0) pick.value = String(dot);
    sec.append(el("p", {}, el("label", {}, "Metric:", pick)));
    const current = () => data.offsets[Number(pick.value)];
    const names = ["from the reference position", "over every pair (mean, range)"];
    const redraw = lines(sec, {
      title: "metric(p, p + offset)",
      series: () => [
        { variant: names[0], points: current().from_reference.map(([k, v]) => [k, v, v, v, 1, 0]) },
        { variant: names[1], points: current().over_pairs.map(([k, m, lo, hi]) => [k, m, lo, hi, 1, 0]) },
      ],
      xLabel: "offset (positions)", yLabel: "value", xName: "offset", xDecimals: 0, decimals: 4,
      describe: (p) => p[2] === p[3] ? fmt(p[1], 4) : `${fmt(p[1], 4)} (${fmt(p[2], 4)} to ${fmt(p[3], 4)})`,
    }, names);
    pick.addEventListener("change", redraw);
    sec.append(el("p", { class: "muted" }, "The line from the reference starts at position " +
      data.offsets[0].reference + "; the band is the range over every pair of positions that far apart."));
  }

  // Wavelengths: by base, and RoPE's under each scaling; attention biases by offset.
  for (const w of [data.wavelengths, data.scaled, ...data.biases]) {
    if (!w) continue;
    const sec = section(w.title);
    const names = w.series.map((s) => s[0]);
    lines(sec, {
      title: w.title,
      series: () => w.series.map(([name, pts]) => ({
        variant: name, points: pts.map(([x, y]) => [x, y, y, y, 1, 0]) })),
      xLabel: w.x, yLabel: w.y, log: w.log, xName: w.x, xDecimals: 0, decimals: 3,
      guides: w.guide ? [{ y: w.guide[0], label: w.guide[1] }] : [],
      describe: (p) => fmt(p[1], w.log ? 1 : 3) + (w.log ? " positions" : ""),
    }, names);
  }

  // The four terms of attention, per head.
  if (data.terms) {
    const t = data.terms;
    const sec = section("Attention logits: content and position terms");
    sec.append(el("p", { class: "muted" }, t.title + ": each term's share of the sum of the " +
      "four terms' mean absolute values, per layer and head."));
    const rowH = 22, L = 90, W = 620;
    const root = svg("svg", { width: W + L + 10, height: t.heads.length * rowH + 40, id: "terms" });
    t.heads.forEach(([layer, head, shares], i) => {
      const y = 10 + i * rowH;
      const name = svg("text", { x: L - 6, y: y + 14, "text-anchor": "end" });
      name.textContent = `layer ${layer}, head ${head}`;
      root.append(name);
      let x = L;
      shares.forEach((s, k) => {
        const bar = svg("rect", { x, y, width: Math.max(0, s * W), height: rowH - 4, fill: PALETTE[k] });
        const title = svg("title", {});
        title.textContent = `layer ${layer}, head ${head}: ${t.names[k]} ${fmt(100 * s, 1)}%`;
        bar.append(title);
        root.append(bar);
        x += s * W;
      });
    });
    const box = el("div", { class: "chart" });
    box.append(root);
    sec.append(box, el("p", {}, ...t.names.map((n, k) => {
      const sw = el("span", { class: "swatch" });
      sw.style.background = PALETTE[k];
      return el("span", { class: "term" }, sw, n + "  ");
    })));
  }

  page.append(el("h2", {}, "Files"));
  page.append(el("p", { class: "muted" }, "This analysis also wrote: " + data.files.join(", ") +
    ". This page fetches nothing: its data, style and script are all in this file."));
  document.body.dataset.rendered = "ok";
})();
