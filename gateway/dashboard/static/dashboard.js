// Draws the dashboard charts with plotly.js from GET /v1/usage (the session cookie authorises it).
// Each <figure data-chart> says what to fetch (data-group-by, data-start, data-end,
// data-account-id) and what to draw (data-series: the field that makes one trace each;
// data-metric: the value, or several joined by commas for one trace per metric).
"use strict";

(function () {
  const DAY_MS = 86400000;
  const COLORS = ["#2563eb", "#16a34a", "#ea580c", "#9333ea", "#0891b2", "#dc2626", "#ca8a04", "#4b5563"];

  // Plotly reads a trace's name as its own subset of HTML (links, styles): a key's or a model's name
  // is text, so its markup characters go as entities, which plotly shows as the characters.
  function text(value) {
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function label(row, series) {
    if (series === "key") {
      return text((row.key_prefix || ("key " + row.key_id)) + "…" + (row.key_name ? " " + row.key_name : ""));
    }
    return text(row[series]);
  }

  // Plotly's dates carry no time zone: usage days and period ends are UTC, drawn as such.
  function noon(day) { return day + " 12:00"; }
  function naive(iso) { return iso.slice(0, 19).replace("T", " "); }

  function traces(rows, series, metrics) {
    if (!series) {
      return metrics.map(function (metric, i) {
        return {
          // Overlaid and nested: errors and cancellations are parts of requests.
          type: "bar", name: metric, width: DAY_MS * (0.8 - 0.25 * i), marker: { color: COLORS[i % COLORS.length] },
          x: rows.map(function (r) { return noon(r.day); }),
          y: rows.map(function (r) { return Number(r[metric]); }),
        };
      });
    }
    const groups = new Map();
    rows.forEach(function (r) {
      const name = label(r, series);
      if (!groups.has(name)) groups.set(name, { x: [], y: [] });
      groups.get(name).x.push(noon(r.day));
      groups.get(name).y.push(Number(r[metrics[0]]));
    });
    return Array.from(groups.entries()).map(function (entry, i) {
      return { type: "bar", name: entry[0], x: entry[1].x, y: entry[1].y, width: 0.8 * DAY_MS, marker: { color: COLORS[i % COLORS.length] } };
    });
  }

  // Money axes: one number of decimals for every tick, enough to tell the ticks apart
  // (never "$0.0001, $0, $0"): cents from a dollar up, more places below a cent.
  function highest(data) {
    const sums = new Map();
    data.forEach(function (t) { t.x.forEach(function (x, i) { sums.set(x, (sums.get(x) || 0) + t.y[i]); }); });
    return Math.max(0, ...sums.values());
  }

  function moneyFormat(data) {
    const top = highest(data);
    const places = top >= 0.05 || top === 0 ? 2 : Math.min(9, Math.max(2, Math.ceil(-Math.log10(top / 5))));
    return "$,." + places + "f";
  }

  function empty(el) {
    el.textContent = "";
    const title = document.createElement("figcaption");
    title.textContent = el.dataset.title;
    title.className = "chart-title";
    const text = document.createElement("p");
    text.className = "chart-empty";
    text.textContent = "No usage in this range";
    el.append(title, text);
    el.dataset.traces = "";
    el.dataset.total = "0";
    el.dataset.state = "empty";
  }

  async function draw(el) {
    const query = new URLSearchParams({ group_by: el.dataset.groupBy, start: el.dataset.start, end: el.dataset.end });
    if (el.dataset.accountId) query.set("account_id", el.dataset.accountId);
    let body;
    try {
      const response = await fetch("/v1/usage?" + query.toString(), { credentials: "same-origin", headers: { Accept: "application/json" } });
      body = await response.json();
      if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
    } catch (err) {
      el.textContent = "Usage could not be loaded: " + err.message;
      el.dataset.state = "error";
      return;
    }
    const metrics = el.dataset.metric.split(",");
    const data = traces(body.data, el.dataset.series, metrics);
    if (body.data.length === 0) {
      empty(el);
      return;
    }
    const layout = {
      title: { text: el.dataset.title, font: { size: 14 } },
      barmode: el.dataset.series ? "stack" : "overlay",
      height: 300, margin: { l: 60, r: 20, t: 40, b: 40 },
      xaxis: { type: "date", range: [naive(body.start), naive(body.end)] },
      yaxis: metrics[0] === "cost_usd" ? { rangemode: "tozero", nticks: 6, tickformat: moneyFormat(data) }
        // counts are whole: a handful gets one tick per unit (not "200m, 400m")
        : Object.assign({ rangemode: "tozero", tickformat: ",~s" }, highest(data) <= 5 ? { dtick: 1 } : { nticks: 6 }),
      legend: { orientation: "h", y: -0.2 },
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    };
    await Plotly.newPlot(el, data, layout, { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["toImage"] });
    el.dataset.traces = data.map(function (t) { return t.name; }).join("|");
    el.dataset.total = String(data.reduce(function (sum, t) { return sum + t.y.reduce(function (a, b) { return a + b; }, 0); }, 0));
    el.dataset.state = "ready";
  }

  document.querySelectorAll("[data-chart]").forEach(function (el) { draw(el); });
})();
