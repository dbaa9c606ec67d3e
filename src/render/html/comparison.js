// poslab report.html (compare and report): draws the page from the JSON poslab embeds (#data)
// with the shared pieces of chart.js. Every number it prints is text poslab formatted, except
// the values a hovered chart shows. When the page is drawn, <body> gets data-rendered="ok".
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const page = document.getElementById("page");
  const PALETTE = poslab.PALETTE;
  const colour = (v) => PALETTE[Math.max(0, data.variants.indexOf(v)) % PALETTE.length];
  const hidden = new Set();
  const redraws = [];

  const { el } = poslab;
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

  // The verdicts, first: what was found in words, then every comparison, filtered by
  // evaluation and by pair.
  const evaluations = [...new Set(data.verdicts.map((d) => d.evaluation))];
  const choice = el("select", { id: "verdict-evaluation" },
    el("option", { value: "" }, "every evaluation"),
    ...evaluations.map((e) => el("option", { value: e }, e)));
  choice.addEventListener("change", filterVerdicts);
  const pairName = (d) => d.b + " − " + d.a;
  const pairs = [...new Set(data.verdicts.map(pairName))];
  const pairChoice = el("select", { id: "verdict-pair" },
    el("option", { value: "" }, "every pair"),
    ...pairs.map((p) => el("option", { value: p }, p)));
  pairChoice.addEventListener("change", filterVerdicts);
  page.append(el("h2", { id: "verdicts" }, "Verdicts"));
  if (data.findings) page.append(el("p", { id: "findings" }, data.findings));
  if (data.verdicts.length || data.skipped.length || data.absent.length) {
    page.append(el("p", { class: "muted" }, data.legend.replace(/`/g, "")));
    page.append(el("p", {}, el("label", {}, "Evaluation:", choice), " ",
      el("label", {}, "Pair:", pairChoice)));
    const head = el("tr", {}, ...["task", "b − a", "test", "diff", "95% interval", "p (Holm)",
      "detectable", "seeds × examples", "verdict"].map((h, i) =>
      el("th", { class: i >= 3 && i <= 7 ? "num" : "" }, h)));
    const body = data.verdicts.map((d) => el("tr", {
      class: "verdict" + (d.detected ? " detected" : "") + (d.exploratory ? " exploratory" : ""),
      "data-task": d.task, "data-evaluation": d.evaluation, "data-a": d.a, "data-b": d.b,
      "data-pair": pairName(d),
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
    for (const line of data.absent) {
      page.append(el("p", { class: "muted" }, line));
    }
  } else {
    page.append(el("p", { class: "muted" }, "This run names no comparison."));
  }
  function filterVerdicts() {
    document.querySelectorAll("tr.verdict").forEach((tr) => {
      const shown = (!choice.value || tr.dataset.evaluation === choice.value) &&
        (!pairChoice.value || tr.dataset.pair === pairChoice.value) &&
        !hidden.has(tr.dataset.a) && !hidden.has(tr.dataset.b);
      tr.style.display = shown ? "" : "none";
    });
  }

  // A chart of this page: colours by variant, hiding the variants toggled off.
  function chart(parent, spec) {
    const draw = poslab.chart(parent, Object.assign({ colour, hidden: (v) => hidden.has(v) }, spec));
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
