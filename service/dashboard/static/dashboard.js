// The multicomposite dashboard: five views over the service's JSON API, no framework, no build step.
// Everything from the server is inserted as text (never as HTML): error texts and details come from the store.
"use strict";

// Worst last, as in registry/reports/plots.py: a cell shows the worst status over its patterns and dtypes.
const SEVERITY = ["ok", "unsupported", "slow", "mismatch", "error"];
const TERMINAL_JOB_STATES = new Set(["done", "failed", "cancelled", "interrupted"]);
const FALLBACK_WORKLOADS = ["vmap", "grad", "vmap(grad)", "jacrev", "jacfwd", "hessian"];
const POLL_MS = 400;
const MAX_PAGES = 1000; // a paged list longer than this is a server bug, not data to wait for

const state = {
  ops: [],            // GET /ops
  matrix: [],         // GET /matrix, every page
  profiles: [],       // GET /profiles, every page
  jobs: new Map(),    // id -> last GET /jobs/{id}
  examples: [],       // GET /checks/examples
  checks: [],         // GET /checks (without their reports)
  selectedCheck: null, // the id whose report is shown
  shownCheck: null,   // its GET /checks/{id}
  selectedCell: null, // [rowKey, stackLabel] whose evidence is shown
};

// ---------------------------------------------------------------- DOM and API helpers

function $(id) {
  const element = document.getElementById(id);
  if (!element) throw new Error(`dashboard: no element #${id}`);
  return element;
}

function h(tag, attrs, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") element.textContent = value;
    else if (name === "class") element.className = value;
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs, ...children) {
  const element = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "text") element.textContent = value;
    else element.setAttribute(name, String(value));
  }
  for (const child of children.flat(Infinity)) if (child) element.append(child);
  return element;
}

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

// One call to the API; a non-2xx answer becomes an ApiError carrying the server's one-line `detail`.
async function api(method, path, body) {
  const headers = {Accept: "application/json"};
  const token = document.getElementById("job-token")?.value.trim();
  if (token && method !== "GET") headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const text = await response.text();
  let payload = null;
  try {
    payload = text ? JSON.parse(text) : null;
  } catch {
    payload = null;
  }
  if (!response.ok) {
    const detail = payload && typeof payload.detail === "string" ? payload.detail : text.slice(0, 200);
    throw new ApiError(response.status, `${method} ${path.split("?")[0]}: ${response.status} ${detail}`);
  }
  return payload;
}

// A list route, whole: accepts a plain JSON list or pages shaped {items, next_cursor} (followed with ?cursor=).
async function getAll(path, params) {
  const items = [];
  let cursor = null;
  for (let page = 0; page < MAX_PAGES; page++) {
    const query = new URLSearchParams(params || {});
    if (cursor !== null) query.set("cursor", cursor);
    const body = await api("GET", query.toString() ? `${path}?${query}` : path);
    if (Array.isArray(body)) return items.concat(body);
    if (!body || !Array.isArray(body.items)) {
      throw new Error(`GET ${path}: expected a list or a page {items, next_cursor}, got ${typeof body}`);
    }
    for (const item of body.items) items.push(item); // a spread of a huge page would overflow the call stack
    cursor = body.next_cursor ?? null;
    if (cursor === null || cursor === "") return items;
  }
  throw new Error(`GET ${path}: more than ${MAX_PAGES} pages; narrow the query`);
}

function showError(id, error) {
  const element = $(id);
  if (error) {
    element.textContent = error instanceof Error ? error.message : String(error);
    element.hidden = false;
  } else {
    element.textContent = "";
    element.hidden = true;
  }
}

// ---------------------------------------------------------------- stacks: two spellings in, one out

// ["vmap", "grad"], "vmap,grad" or "vmap(grad)" -> ["vmap", "grad"]; [] is eager.
function stackParts(stack) {
  if (Array.isArray(stack)) return stack.map(String);
  const text = String(stack ?? "").replace(/\s+/g, "");
  if (text === "" || text === "eager") return [];
  if (text.includes("(") || text.includes(")")) {
    const closing = text.match(/\)*$/)[0].length;
    const parts = text.slice(0, text.length - closing).split("(");
    if (closing !== parts.length - 1 || parts.some((p) => p === "" || /[(),]/.test(p))) {
      throw new Error(`stack ${JSON.stringify(stack)}: write nested calls like vmap(grad) or a list like vmap,grad`);
    }
    return parts;
  }
  const parts = text.split(",");
  if (parts.some((p) => p === "")) throw new Error(`stack ${JSON.stringify(stack)} has an empty transform name`);
  return parts;
}

function stackLabel(parts) {
  return parts.length ? parts.join("(") + ")".repeat(parts.length - 1) : "eager";
}

// The spelling every version of the API accepts on input.
function stackQuery(parts) {
  return parts.join(",");
}

function safeStackLabel(stack) {
  try {
    return stackLabel(stackParts(stack));
  } catch {
    return String(stack);
  }
}

// ---------------------------------------------------------------- formatting

function formatNumber(value) {
  if (value === null || value === undefined) return "none";
  if (value === 0) return "0";
  const magnitude = Math.abs(value);
  return magnitude >= 1e-3 && magnitude < 1e4 ? String(Number(value.toPrecision(3))) : value.toExponential(2);
}

function formatSpeedup(value) {
  return `${value.toFixed(2)}x`;
}

// When the API tells when an entry was measured, under whichever name it uses: epoch seconds or ISO 8601 text (UTC
// unless it names its zone; the browser's own zone would make the same entry read differently on each machine).
const MEASURED_FIELDS = ["measured_at", "updated_at", "created_at", "timestamp"];

function measuredAt(entry) {
  for (const name of MEASURED_FIELDS) {
    const value = entry[name];
    if (value === null || value === undefined || value === "") continue;
    let date;
    if (typeof value === "number") date = new Date(value * 1000);
    else {
      const text = String(value).trim().replace(" ", "T");
      date = new Date(/(Z|[+-]\d\d:?\d\d)$/i.test(text) || !text.includes("T") ? text : `${text}Z`);
    }
    return Number.isNaN(date.getTime()) ? String(value) : date.toISOString().replace("T", " ").slice(0, 19) + " UTC";
  }
  return "not recorded";
}

function statusRank(status) {
  const rank = SEVERITY.indexOf(status);
  return rank === -1 ? SEVERITY.length : rank; // an unknown status sorts as the worst: it needs a look
}

function optionList(select, values, keepFirst = true) {
  const current = select.value;
  const first = keepFirst ? select.options[0] : null;
  select.replaceChildren(...(first ? [first] : []), ...values.map((v) => h("option", {value: v, text: v})));
  if ([...select.options].some((o) => o.value === current)) select.value = current;
}

// ---------------------------------------------------------------- views and navigation

const VIEWS = ["matrix", "decide", "profiles", "checks", "jobs"];

function showView() {
  const wanted = location.hash.replace("#", "");
  const name = VIEWS.includes(wanted) ? wanted : "matrix";
  for (const view of VIEWS) {
    $(`view-${view}`).hidden = view !== name;
    const link = $(`nav-${view}`);
    if (view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = `${$(`nav-${name}`).textContent} · multicomposite dashboard`;
  if (name === "profiles") renderProfiles(); // widths depend on the now visible container
  if (name === "checks") renderCheck();
}

// ---------------------------------------------------------------- matrix heatmap

function matrixRows() {
  const rows = new Map(); // "op/composite" -> {op, composite, kind, cells: Map(stackLabel -> entries)}
  const stacks = new Map(); // label -> parts
  for (const entry of state.matrix) {
    const parts = stackParts(entry.stack);
    const label = stackLabel(parts);
    stacks.set(label, parts);
    const key = `${entry.op}/${entry.composite}`;
    if (!rows.has(key)) rows.set(key, {key, op: entry.op, composite: entry.composite, kind: entry.kind, cells: new Map()});
    const cells = rows.get(key).cells;
    if (!cells.has(label)) cells.set(label, []);
    cells.get(label).push(entry);
  }
  return {rows, stacks};
}

function worstStatus(entries) {
  return entries.reduce((worst, e) => (statusRank(e.status) > statusRank(worst) ? e.status : worst), entries[0].status);
}

function compositeOrder(op) {
  const found = state.ops.find((o) => o.name === op);
  return found ? found.composites.map((c) => c.name) : [];
}

function renderMatrix() {
  const {rows, stacks} = matrixRows();
  const opFilter = $("matrix-op").value;
  const statusFilter = $("matrix-status").value;
  const kindFilter = $("matrix-kind").value;
  optionList($("matrix-status"), [...new Set(state.matrix.map((e) => e.status))].sort((a, b) => statusRank(a) - statusRank(b)));
  optionList($("matrix-kind"), [...new Set(state.matrix.map((e) => e.kind))].sort());

  // Eager first, then shallower stacks before deeper ones, as in the PNG heatmap.
  const columns = [...stacks.entries()].sort((a, b) => a[1].length - b[1].length || (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
    .map(([label]) => label);
  const visible = [...rows.values()]
    .filter((row) => (!opFilter || row.op === opFilter) && (!kindFilter || row.kind === kindFilter))
    .filter((row) => !statusFilter || [...row.cells.values()].some((entries) => worstStatus(entries) === statusFilter))
    .sort((a, b) => (a.op < b.op ? -1 : a.op > b.op ? 1 : 0)
      || compositeOrder(a.op).indexOf(a.composite) - compositeOrder(b.op).indexOf(b.composite)
      || (a.composite < b.composite ? -1 : 1));

  const table = $("matrix-table");
  const caption = table.querySelector("caption");
  const head = h("thead", {}, h("tr", {}, h("th", {scope: "col", class: "corner", text: "op/composite"}),
    columns.map((label) => h("th", {scope: "col", class: "stack"}, h("span", {text: label})))));
  const body = h("tbody", {}, visible.map((row) => h("tr", {"data-row": row.key},
    h("th", {scope: "row", class: "row-head"}, h("span", {class: "op", text: `${row.op}/`}), row.composite,
      h("span", {class: "kind", text: row.kind === row.composite ? "" : ` (${row.kind})`})),
    columns.map((label) => matrixCell(row, label, statusFilter)))));
  table.replaceChildren(caption, head, body);
  // One tab stop for the whole grid (the selected cell, else the first); arrow keys move within it.
  const buttons = body.querySelectorAll(".cell-button");
  const current = [...buttons].find((b) => b.getAttribute("aria-pressed") === "true") || buttons[0];
  if (current) current.tabIndex = 0;

  const shown = visible.reduce((n, row) => n + row.cells.size, 0);
  $("matrix-summary").textContent = state.matrix.length
    ? `${visible.length} of ${rows.size} rows, ${columns.length} stacks, ${shown} measured cells (${state.matrix.length} entries).`
    : "The store holds no verified entries for this torch and these composites yet: start a verify job.";
  if (state.selectedCell) showEvidence(...state.selectedCell, false);
}

function matrixCell(row, label, statusFilter) {
  const entries = row.cells.get(label);
  if (!entries) return h("td", {class: "cell not-run", "data-stack": label}, h("span", {class: "visually-hidden", text: "not run"}));
  const worst = worstStatus(entries);
  const dimmed = statusFilter && worst !== statusFilter;
  const selected = state.selectedCell && state.selectedCell[0] === row.key && state.selectedCell[1] === label;
  return h("td", {class: `cell status-${worst}${dimmed ? " dimmed" : ""}`, "data-stack": label, "data-status": worst},
    h("button", {
      type: "button", class: "cell-button", text: worst, "aria-pressed": selected ? "true" : "false", tabindex: -1,
      "aria-label": `${row.key} under ${label}: ${worst}; show evidence`,
      onclick: () => showEvidence(row.key, label, true),
    }));
}

// Arrow keys move between measured cells (not-run cells are skipped), Home and End to a row's first and last.
function moveInGrid(event) {
  const from = event.target;
  if (!from.classList || !from.classList.contains("cell-button")) return;
  const rows = [...$("matrix-table").tBodies[0].rows];
  const rowIndex = rows.indexOf(from.closest("tr"));
  const column = from.parentElement.cellIndex;
  const buttonAt = (r, c) => rows[r]?.cells[c]?.querySelector(".cell-button") || null;
  const width = rows[rowIndex].cells.length;
  const walk = (dr, dc, r = rowIndex + dr, c = column + dc) => {
    for (; r >= 0 && r < rows.length && c >= 1 && c < width; r += dr, c += dc) {
      const button = buttonAt(r, c);
      if (button) return button;
    }
    return null;
  };
  const moves = {
    ArrowRight: () => walk(0, 1), ArrowLeft: () => walk(0, -1), ArrowDown: () => walk(1, 0), ArrowUp: () => walk(-1, 0),
    Home: () => walk(0, 1, rowIndex, 1), End: () => walk(0, -1, rowIndex, width - 1),
  };
  if (!(event.key in moves)) return;
  event.preventDefault();
  const to = moves[event.key]();
  if (!to) return;
  from.tabIndex = -1;
  to.tabIndex = 0;
  to.focus();
}

function showEvidence(rowKey, label, focus) {
  const panel = $("matrix-evidence");
  const row = matrixRows().rows.get(rowKey);
  const entries = row?.cells.get(label);
  if (!entries) {
    state.selectedCell = null;
    panel.hidden = true;
    return;
  }
  state.selectedCell = [rowKey, label];
  for (const button of document.querySelectorAll("#matrix-table .cell-button")) {
    const cell = button.parentElement;
    const pressed = cell.parentElement.dataset.row === rowKey && cell.dataset.stack === label;
    button.setAttribute("aria-pressed", pressed ? "true" : "false");
    button.tabIndex = pressed ? 0 : -1; // the grid's one tab stop follows the selection
  }
  const sorted = [...entries].sort((a, b) => statusRank(b.status) - statusRank(a.status)
    || String(a.pattern).localeCompare(String(b.pattern)) || String(a.dtype).localeCompare(String(b.dtype)));
  panel.replaceChildren(
    h("h3", {id: "evidence-title", text: `${rowKey} under ${label}: ${worstStatus(entries)}`}),
    h("p", {class: "hint", text: `kind ${row.kind}; ${entries.length} entr${entries.length === 1 ? "y" : "ies"} (one per batching pattern and dtype)`}),
    h("div", {class: "scroll"}, h("table", {class: "evidence-table", "aria-labelledby": "evidence-title"},
      h("thead", {}, h("tr", {}, ["pattern", "dtype", "device", "status", "evidence", "torch", "measured"]
        .map((name) => h("th", {scope: "col", text: name})))),
      h("tbody", {}, sorted.map((e) => h("tr", {class: `status-row-${e.status}`},
        h("td", {text: e.pattern}), h("td", {text: e.dtype}), h("td", {text: e.device}),
        h("td", {}, h("span", {class: `badge status-${e.status}`, text: e.status})),
        h("td", {class: "evidence-text", text: evidenceText(e)}),
        h("td", {text: e.torch_version}), h("td", {text: measuredAt(e)})))))),
  );
  panel.hidden = false;
  if (focus) panel.focus();
}

function evidenceText(entry) {
  const errors = entry.max_abs_error === null || entry.max_abs_error === undefined
    ? "" : `max abs error ${formatNumber(entry.max_abs_error)}, max rel error ${formatNumber(entry.max_rel_error)}`;
  // A mismatch's detail already states its errors; say them once.
  if (entry.detail && errors && !entry.detail.includes("max abs error")) return `${entry.detail} (${errors})`;
  return entry.detail || errors || "no detail recorded";
}

function renderLegend() {
  $("matrix-legend").replaceChildren(...[...SEVERITY, "not run"].map((status) =>
    h("li", {}, h("span", {class: `swatch ${status === "not run" ? "not-run" : `status-${status}`}`, "aria-hidden": "true"}), status)));
}

async function loadMatrix() {
  $("matrix-summary").textContent = "Loading the matrix…";
  try {
    state.matrix = await getAll("/matrix");
    showError("global-error", null);
  } catch (error) {
    showError("global-error", error);
  }
  renderMatrix();
}

// ---------------------------------------------------------------- decision explorer

function fillDecisionForm() {
  const op = state.ops.find((o) => o.name === $("decide-op").value);
  if (!op) return;
  $("decide-batched-list").replaceChildren(...op.tensor_args.map((name) =>
    h("label", {}, h("input", {type: "checkbox", name: "batched", value: name}), ` ${name}`)));
  const pins = [...new Set([...op.composites.map((c) => c.kind), ...op.composites.map((c) => c.name)])];
  optionList($("decide-pin"), pins);
}

async function decide(event) {
  event.preventDefault();
  showError("decide-error", null);
  const out = $("decision");
  let parts;
  try {
    parts = stackParts($("decide-stack").value);
  } catch (error) {
    showError("decide-error", error);
    out.hidden = true;
    return;
  }
  const query = new URLSearchParams({op: $("decide-op").value, stack: stackQuery(parts), policy: $("decide-policy").value});
  const batched = [...document.querySelectorAll("#decide-batched-list input:checked")].map((i) => i.value);
  if (batched.length) query.set("batched", batched.join(","));
  for (const name of ["dtype", "device", "numel", "pin"]) {
    const value = $(`decide-${name}`).value.trim();
    if (value) query.set(name, value);
  }
  out.setAttribute("aria-busy", "true");
  try {
    renderDecision(await api("GET", `/select?${query}`));
  } catch (error) {
    showError("decide-error", error);
    out.hidden = true;
  } finally {
    out.removeAttribute("aria-busy");
  }
}

function speedupFacts(decision) {
  // Show what the API returns: the speedup over native and any spread or runner-up figure beside it.
  const facts = [];
  const speedup = decision.speedup;
  facts.push(["speedup over native", typeof speedup === "number" ? formatSpeedup(speedup) : "not profiled"]);
  const low = decision.speedup_low ?? decision.speedup_min;
  const high = decision.speedup_high ?? decision.speedup_max;
  if (typeof low === "number" && typeof high === "number") facts.push(["spread", `${formatSpeedup(low)} to ${formatSpeedup(high)}`]);
  for (const [name, value] of Object.entries(decision)) {
    const shown = ["speedup", "speedup_low", "speedup_min", "speedup_high", "speedup_max"].includes(name);
    if (shown || !(name.startsWith("speedup") || name.startsWith("runner_up"))) continue;
    facts.push([name.replaceAll("_", " "), typeof value === "number" ? formatSpeedup(value) : value === null ? "not profiled" : JSON.stringify(value)]);
  }
  return facts;
}

function renderDecision(decision) {
  const out = $("decision");
  const context = [
    ["stack", safeStackLabel(decision.stack)],
    ["batched", (decision.batched || []).join(", ") || "none"],
    ["dtype", decision.dtype ?? "any"], ["device", decision.device ?? "any"], ["policy", decision.policy],
  ];
  out.replaceChildren(
    h("h3", {}, "Choice: ", h("strong", {id: "decision-composite", text: decision.composite}),
      h("span", {class: "kind", text: ` (${decision.kind})`}), ` for ${decision.op}`),
    h("p", {id: "decision-reason", class: "reason", text: decision.reason}),
    h("dl", {class: "facts", id: "decision-facts"}, [...context, ...speedupFacts(decision)].map(([name, value]) =>
      [h("dt", {text: name}), h("dd", {text: value})])),
    h("h4", {text: "Alternatives"}),
    decision.alternatives.length
      ? h("div", {class: "scroll"}, h("table", {id: "decision-alternatives", class: "alternatives"},
        h("thead", {}, h("tr", {}, ["composite", "kind", "verdict", "reason"].map((n) => h("th", {scope: "col", text: n})))),
        h("tbody", {}, decision.alternatives.map((a) => h("tr", {},
          h("td", {text: a.composite}), h("td", {text: a.kind}),
          h("td", {}, h("span", {class: `badge ${a.ok ? "status-ok" : "status-error"}`, text: a.ok ? "valid" : "invalid"})),
          h("td", {text: a.reason}))))))
      : h("p", {text: "No alternatives: the op has one composite that fits."}),
  );
  out.hidden = false;
}

// ---------------------------------------------------------------- profiles: speedup charts

function profileGroups() {
  const opFilter = $("profiles-op").value;
  const workloadFilter = $("profiles-workload").value;
  const groups = new Map(); // "op · workload" -> Map(setting -> profiles)
  for (const p of state.profiles) {
    if ((opFilter && p.op !== opFilter) || (workloadFilter && p.workload !== workloadFilter)) continue;
    const chart = `${p.op}|${p.workload}`;
    const setting = `batch ${p.batch_size} · ${p.numel_bucket} elements · ${p.dtype} · ${p.device_name || p.device}`;
    if (!groups.has(chart)) groups.set(chart, {op: p.op, workload: p.workload, stack: p.stack, settings: new Map()});
    const settings = groups.get(chart).settings;
    if (!settings.has(setting)) settings.set(setting, []);
    settings.get(setting).push(p);
  }
  return [...groups.values()].sort((a, b) => a.op.localeCompare(b.op) || a.workload.localeCompare(b.workload));
}

// Native's time over the composite's, and the range the two interquartile ranges allow. Native against itself is 1x
// by definition; its bar shows its own spread only.
function speedupOf(native, p) {
  const value = native.median_us / p.median_us;
  const nIqr = p === native ? 0 : native.iqr_us || 0;
  const pIqr = p.iqr_us || 0;
  const low = Math.max(native.median_us - nIqr / 2, 0) / (p.median_us + pIqr / 2);
  const highDenominator = p.median_us - pIqr / 2;
  const high = highDenominator > 0 ? (native.median_us + nIqr / 2) / highDenominator : value * 4;
  return {value, low: Math.min(low, value), high: Math.max(high, value)};
}

function renderProfiles() {
  const container = $("profile-charts");
  if ($("view-profiles").hidden) return;
  optionList($("profiles-op"), [...new Set(state.profiles.map((p) => p.op))].sort());
  optionList($("profiles-workload"), [...new Set(state.profiles.map((p) => p.workload))].sort());
  const groups = profileGroups();
  $("profiles-summary").textContent = state.profiles.length
    ? `${state.profiles.length} timings in ${groups.length} chart${groups.length === 1 ? "" : "s"}.`
    : "The store holds no profiles for this torch and these composites yet: start a profile job.";
  // Two charts side by side where each still gets about 500 px, else one; a chart fills its card's content box.
  const available = container.clientWidth || 800;
  const columns = available >= 1040 && groups.length > 1 ? 2 : 1;
  container.classList.toggle("two-up", columns === 2);
  const cardChrome = 34; // the card's padding and border, left and right
  const width = Math.max(260, Math.floor((available - (columns - 1) * 16) / columns) - cardChrome);
  container.replaceChildren(...groups.map((group) => profileChart(group, width)));
}

function profileChart(group, width) {
  const order = compositeOrder(group.op);
  const rows = []; // {setting} headings and {profile, speedup | invalid} bars
  for (const [setting, profiles] of [...group.settings.entries()].sort()) {
    rows.push({setting});
    const native = profiles.find((p) => p.kind === "native" && p.valid && p.median_us > 0);
    for (const p of [...profiles].sort((a, b) => order.indexOf(a.composite) - order.indexOf(b.composite))) {
      if (!p.valid || !(p.median_us > 0)) rows.push({profile: p, note: `invalid: ${p.detail || "not timed"}`});
      else if (!native) rows.push({profile: p, note: `${formatNumber(p.median_us)} µs; native not timed, no speedup`});
      else rows.push({profile: p, speedup: speedupOf(native, p)});
    }
  }
  const narrow = width < 560;
  const labelWidth = narrow ? 92 : 150;
  const valueWidth = narrow ? 46 : 60;
  const rowHeight = 22;
  const top = 26;
  const plotLeft = labelWidth + 8;
  const plotRight = width - valueWidth - 8;
  const height = top + rows.length * rowHeight + 8;
  // A symmetric log2 axis around 1x, wide enough for every error bar (at least 0.5x to 2x).
  const extremes = rows.filter((r) => r.speedup).flatMap((r) => [r.speedup.low, r.speedup.high]);
  const span = Math.min(Math.max(1, ...extremes.map((v) => Math.ceil(Math.abs(Math.log2(v)) + 0.01))), 10);
  const x = (v) => plotLeft + ((Math.log2(Math.min(Math.max(v, 2 ** -span), 2 ** span)) + span) / (2 * span)) * (plotRight - plotLeft);
  const one = x(1);
  // A workload such as jacrev shows the op another stack (grad); say so where they differ.
  const stack = safeStackLabel(group.stack);
  const title = `${group.op} under ${group.workload}${stack === group.workload ? "" : ` (the op sees ${stack})`}`;
  const chart = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `Speedup over native: ${title}`, class: "chart"});
  const ticks = [];
  // Powers of two at least 44 px apart, 1x always among them.
  const step = Math.max(1, Math.ceil((2 * span * 44) / (plotRight - plotLeft)));
  for (let e = -span; e <= span; e++) if (e % step === 0) ticks.push(2 ** e);
  for (const t of ticks) {
    chart.append(svg("line", {x1: x(t), x2: x(t), y1: top - 6, y2: height - 6, class: t === 1 ? "axis-one" : "grid"}),
      svg("text", {x: x(t), y: top - 10, class: "tick", "text-anchor": "middle", text: t >= 1 ? `${t}x` : `1/${1 / t}x`}));
  }
  rows.forEach((row, i) => {
    const y = top + i * rowHeight;
    if (row.setting) {
      chart.append(svg("text", {x: 4, y: y + 15, class: "setting", text: row.setting}));
      return;
    }
    const p = row.profile;
    chart.append(svg("text", {x: labelWidth, y: y + 15, class: "label", "text-anchor": "end", text: p.composite}));
    if (!row.speedup) {
      chart.append(svg("text", {x: plotLeft, y: y + 15, class: "note", text: row.note}));
      return;
    }
    const {value, low, high} = row.speedup;
    const end = x(value);
    const faster = value >= 1;
    const bar = svg("rect", {x: Math.min(one, end), y: y + 4, width: Math.max(Math.abs(end - one), 1), height: rowHeight - 8,
      class: p.kind === "native" ? "bar native" : faster ? "bar faster" : "bar slower"});
    bar.append(svg("title", {text: `${p.composite}: ${formatSpeedup(value)} native's speed (${formatNumber(p.median_us)} µs median, IQR ${formatNumber(p.iqr_us)} µs, ${p.runs} runs); range ${formatSpeedup(low)} to ${formatSpeedup(high)}`}));
    chart.append(bar,
      svg("line", {x1: x(low), x2: x(high), y1: y + rowHeight / 2, y2: y + rowHeight / 2, class: "whisker"}),
      svg("line", {x1: x(low), x2: x(low), y1: y + 6, y2: y + rowHeight - 6, class: "whisker"}),
      svg("line", {x1: x(high), x2: x(high), y1: y + 6, y2: y + rowHeight - 6, class: "whisker"}),
      svg("text", {x: plotRight + 6, y: y + 15, class: "value", "data-composite": p.composite, text: formatSpeedup(value)}));
  });
  return h("figure", {class: "card chart-card", "data-op": group.op, "data-workload": group.workload},
    h("figcaption", {text: title}), chart);
}

async function loadProfiles() {
  $("profiles-summary").textContent = "Loading profiles…";
  try {
    state.profiles = await getAll("/profiles");
    showError("global-error", null);
  } catch (error) {
    showError("global-error", error);
  }
  renderProfiles();
}

// ---------------------------------------------------------------- jobs

function checkedValues(name) {
  return [...document.querySelectorAll(`input[type=checkbox][name="${name}"]:checked`)].map((i) => i.value);
}

function integers(id, what) {
  const text = $(id).value.trim();
  const values = text.split(/[\s,;]+/).filter(Boolean).map(Number);
  if (!values.length || values.some((v) => !Number.isInteger(v) || v < 1)) {
    throw new Error(`${what}: write whole numbers of 1 or more separated by spaces, e.g. 32 256 (got ${JSON.stringify(text)})`);
  }
  return values;
}

async function startJob(event, kind) {
  event.preventDefault();
  showError("jobs-error", null);
  let path;
  let body;
  try {
    if (kind === "verify") {
      const ops = checkedValues("verify-op");
      if (!ops.length) throw new Error("verify: tick at least one op");
      const stacks = $("verify-stacks").value.split(/[\s;]+/).filter(Boolean).map((s) => stackQuery(stackParts(s)));
      const dtypes = checkedValues("verify-dtype");
      if (!dtypes.length) throw new Error("verify: tick at least one dtype");
      path = "/verify";
      body = {ops, dtypes, ...(stacks.length ? {stacks} : {})};
    } else {
      const ops = checkedValues("profile-op");
      if (!ops.length) throw new Error("profile: tick at least one op");
      const workloads = checkedValues("profile-workload");
      if (!workloads.length) throw new Error("profile: tick at least one workload");
      const dtypes = checkedValues("profile-dtype");
      if (!dtypes.length) throw new Error("profile: tick at least one dtype");
      const minTime = Number($("profile-min-time").value);
      if (!(minTime > 0)) throw new Error("profile: the minimum run time must be a number of seconds above 0");
      path = "/profiles";
      body = {ops, workloads, batch_sizes: integers("profile-batches", "batch sizes"),
        numels: integers("profile-numels", "elements per tensor"), dtypes, device: $("profile-device").value, min_run_time: minTime};
    }
  } catch (error) {
    showError("jobs-error", error);
    return;
  }
  try {
    const job = await api("POST", path, body);
    state.jobs.set(job.id, job);
    rememberJobs();
    renderJobs();
    pollJob(job.id);
  } catch (error) {
    showError("jobs-error", error);
  }
}

// The ids of this tab's jobs survive a reload (sessionStorage: this tab only, never the token).
const JOBS_KEY = "multicomposite.jobs";
const JOBS_KEPT = 20;

function rememberJobs() {
  try {
    sessionStorage.setItem(JOBS_KEY, JSON.stringify([...state.jobs.keys()].slice(-JOBS_KEPT)));
  } catch {
    // Storage may be disabled; the jobs then last as long as the page.
  }
}

function rememberedJobs() {
  try {
    const ids = JSON.parse(sessionStorage.getItem(JOBS_KEY) || "[]");
    return Array.isArray(ids) ? ids.filter((id) => typeof id === "string" && /^[\w-]{1,64}$/.test(id)) : [];
  } catch {
    return [];
  }
}

async function pollJob(id, {forgetIfGone = false} = {}) {
  while (true) {
    let job;
    try {
      job = await api("GET", `/jobs/${encodeURIComponent(id)}`);
    } catch (error) {
      if (forgetIfGone && error instanceof ApiError && error.status === 404) {
        // The server no longer knows it (restarted, or pruned it): nothing to show.
        state.jobs.delete(id);
        rememberJobs();
        return;
      }
      showError("jobs-error", error);
      return;
    }
    const before = state.jobs.get(id);
    state.jobs.set(id, job);
    renderJobs();
    if (TERMINAL_JOB_STATES.has(job.state)) {
      if (job.state === "done" && before?.state !== "done") {
        // What the job wrote is what the other views show next.
        if (job.kind === "verify") loadMatrix();
        else if (job.kind === "check") loadChecks(job.id);
        else loadProfiles();
      }
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

async function cancelJob(id) {
  showError("jobs-error", null);
  try {
    state.jobs.set(id, await api("DELETE", `/jobs/${encodeURIComponent(id)}`));
    renderJobs();
  } catch (error) {
    showError("jobs-error", error);
  }
}

function jobSummary(job) {
  const params = job.params || {};
  const ops = (params.ops || []).join(", ");
  if (job.kind === "check") return `${params.example} with policy ${params.policy}; ${params.rounds} timing rounds`;
  if (job.kind === "verify") {
    const stacks = params.stacks ? params.stacks.map(safeStackLabel).join(", ") : "every generated stack";
    return `${ops} under ${stacks}; ${(params.dtypes || []).join(", ")}`;
  }
  return `${ops} under ${(params.workloads || []).join(", ")}; batch ${(params.batch_sizes || []).join(", ")}; ` +
    `${(params.numels || []).join(", ")} elements; ${(params.dtypes || []).join(", ")}; ${params.device || "cpu"}`;
}

// One card per job, built once and then updated in place, so that polling never takes the focus off its Cancel button.
const jobCards = new Map(); // id -> {card, badge, progress, count, error, result, cancel}

function jobCard(job) {
  const short = job.id.slice(0, 8);
  const parts = {
    badge: h("span", {class: "badge job-state"}),
    progress: h("progress", {"aria-label": `${job.kind} job ${short} progress`}),
    count: h("span", {class: "count"}),
    error: h("p", {class: "error", hidden: true}),
    result: h("dl", {class: "facts result", hidden: true}),
    cancel: h("button", {type: "button", class: "cancel", text: "Cancel", onclick: () => cancelJob(job.id),
      "aria-label": `Cancel ${job.kind} job ${short}`}),
  };
  parts.card = h("li", {class: "card job", id: `job-${job.id}`, tabindex: -1},
    h("div", {class: "job-head"}, h("strong", {text: job.kind}), " ", h("code", {text: short}), " ", parts.badge),
    h("p", {class: "job-params", text: jobSummary(job)}),
    h("div", {class: "job-progress"}, parts.progress, parts.count),
    parts.error, parts.result, parts.cancel);
  return parts;
}

function resultText(value) {
  if (value === null || typeof value !== "object") return String(value);
  return Object.entries(value).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
}

function renderJobs() {
  const list = $("job-list");
  $("jobs-empty").hidden = state.jobs.size > 0;
  for (const job of state.jobs.values()) {
    if (!jobCards.has(job.id)) {
      jobCards.set(job.id, jobCard(job));
      list.prepend(jobCards.get(job.id).card); // newest first
    }
    const parts = jobCards.get(job.id);
    const finished = TERMINAL_JOB_STATES.has(job.state);
    parts.card.dataset.state = job.state;
    parts.badge.className = `badge job-state state-${job.state}`;
    parts.badge.textContent = job.state;
    if (job.total) {
      parts.progress.max = job.total;
      parts.progress.value = job.state === "done" ? job.total : job.done;
    } else if (finished) {
      parts.progress.max = 1;
      parts.progress.value = job.state === "done" ? 1 : 0;
    }
    parts.count.textContent = `${job.done}/${job.total || "?"}`;
    parts.error.textContent = job.error || "";
    parts.error.hidden = !job.error;
    if (job.result && parts.result.hidden) {
      parts.result.replaceChildren(...Object.entries(job.result).flatMap(([name, value]) =>
        [h("dt", {text: name.replaceAll("_", " ")}), h("dd", {text: resultText(value)})]));
      parts.result.hidden = false;
    }
    if (finished && parts.cancel.isConnected) {
      const hadFocus = document.activeElement === parts.cancel;
      parts.cancel.remove();
      if (hadFocus) parts.card.focus(); // keep the keyboard user on this job, not back at the page top
    }
  }
}

// ---------------------------------------------------------------- checks: a report as a table and its timings

function verdictBadge(verdict) {
  const status = verdict === "unchecked" ? "unsupported" : verdict;
  return h("span", {class: `badge status-${SEVERITY.includes(status) ? status : "error"}`, text: verdict});
}

function formatSeconds(seconds) {
  return seconds === null || seconds === undefined ? "not timed" : `${formatNumber(seconds * 1e3)} ms`;
}

function fillExamples() {
  const select = $("check-example");
  select.replaceChildren(...state.examples.map((e) => h("option", {value: e.name, disabled: !e.available,
    text: e.available ? `${e.name} (${e.transform})` : `${e.name} (needs ${e.needs})`})));
  const first = state.examples.find((e) => e.available);
  if (first && !select.value) select.value = first.name;
  describeExample();
}

function describeExample() {
  const example = state.examples.find((e) => e.name === $("check-example").value);
  $("check-example-help").textContent = example ? `${example.description}; under ${example.transform}.` : "";
}

async function loadChecks(show) {
  try {
    state.checks = await api("GET", "/checks");
    showError("checks-error", null);
  } catch (error) {
    showError("checks-error", error);
  }
  renderChecks();
  const wanted = show || state.selectedCheck || (state.checks[0] && state.checks[0].id);
  if (wanted && state.checks.some((c) => c.id === wanted)) await showCheck(wanted);
}

function renderChecks() {
  $("checks-summary").textContent = state.checks.length
    ? `${state.checks.length} stored check${state.checks.length === 1 ? "" : "s"}, newest first.`
    : "The store holds no checks yet: start one above.";
  const columns = ["checked", "program", "transform", "native", "use()", "summary"];
  $("checks-table").replaceChildren(
    h("caption", {class: "visually-hidden", text: "stored checks, newest first"}),
    h("thead", {}, h("tr", {}, columns.map((n) => h("th", {scope: "col", text: n})))),
    h("tbody", {}, state.checks.map((c) => h("tr", {"data-check": c.id, class: c.id === state.selectedCheck ? "selected" : null},
      h("td", {}, h("button", {type: "button", class: "link", "aria-label": `show the check of ${c.example} at ${measuredAt(c)}`,
        onclick: () => showCheck(c.id), text: measuredAt(c)})),
      h("td", {text: c.example}), h("td", {text: c.transform}),
      h("td", {}, verdictBadge(c.native_verdict)), h("td", {}, verdictBadge(c.use_verdict)),
      h("td", {text: c.summary})))));
}

function runRow(run) {
  const worst = (run.differences || []).reduce((found, d) => {
    if (!found) return d;
    if (found.ok !== d.ok) return d.ok ? found : d;
    return (d.max_rel ?? Infinity) > (found.max_rel ?? Infinity) ? d : found;
  }, null);
  const detail = run.error ? `${run.error}${run.where ? ` at ${run.where}` : ""}`
    : run.fallbacks && run.fallbacks.length ? `vmap looped over the batch for ${run.fallbacks.join(", ")}`
      : worst && worst.detail ? worst.detail : "";
  return h("tr", {"data-run": run.name}, h("th", {scope: "row", text: run.name}), h("td", {}, verdictBadge(run.verdict)),
    h("td", {text: formatSeconds(run.time_s)}), h("td", {text: worst ? worst.name : "none"}),
    h("td", {text: worst ? formatNumber(worst.max_abs) : "none"}), h("td", {text: worst ? formatNumber(worst.max_rel) : "none"}),
    h("td", {text: detail}));
}

// The three timings as horizontal bars on one linear axis (milliseconds); a side that raised has no bar.
function timingChart(report, width) {
  const sides = [["native", report.native.time_s], ["use()", report.use.time_s], ["reference", report.reference.time_s]];
  const labelWidth = 90;
  const valueWidth = 90;
  const rowHeight = 26;
  const top = 8;
  const height = top + sides.length * rowHeight + 8;
  const longest = Math.max(...sides.map(([, t]) => t || 0), 1e-9);
  const plot = width - labelWidth - valueWidth - 16;
  const chart = svg("svg", {id: "check-timings", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", class: "chart",
    "aria-label": `Thread CPU time per call: ${sides.map(([n, t]) => `${n} ${formatSeconds(t)}`).join(", ")}`});
  sides.forEach(([name, seconds], i) => {
    const y = top + i * rowHeight;
    chart.append(svg("text", {x: labelWidth, y: y + 17, class: "label", "text-anchor": "end", text: name}));
    if (seconds === null || seconds === undefined) {
      chart.append(svg("text", {x: labelWidth + 8, y: y + 17, class: "note", "data-side": name, text: "not timed (it raised)"}));
      return;
    }
    const bar = svg("rect", {x: labelWidth + 8, y: y + 4, width: Math.max((seconds / longest) * plot, 1), height: rowHeight - 8,
      class: name === "native" ? "bar native" : name === "use()" ? "bar faster" : "bar reference", "data-side": name});
    bar.append(svg("title", {text: `${name}: ${formatSeconds(seconds)}`}));
    chart.append(bar, svg("text", {x: width - valueWidth, y: y + 17, class: "value", "data-side": name, text: formatSeconds(seconds)}));
  });
  return chart;
}

async function showCheck(id) {
  let check;
  try {
    check = await api("GET", `/checks/${encodeURIComponent(id)}`);
  } catch (error) {
    showError("checks-error", error);
    return;
  }
  state.selectedCheck = id;
  state.shownCheck = check;
  for (const row of document.querySelectorAll("#checks-table tbody tr")) row.classList.toggle("selected", row.dataset.check === id);
  renderCheck();
}

// The shown check, drawn for the view's width now (again when the view is shown: a hidden view has no width).
function renderCheck() {
  const check = state.shownCheck;
  if (!check || $("view-checks").hidden) return;
  const out = $("check-detail");
  const report = check.report;
  const available = $("view-checks").clientWidth || 700;
  const width = Math.max(240, Math.min(available - 40, 760));
  const decisions = report.decisions || [];
  out.replaceChildren(
    h("h3", {text: `${check.example} under ${check.transform} (policy ${check.policy})`}),
    h("p", {id: "check-summary", class: "reason", text: report.summary}),
    h("div", {class: "scroll"}, h("table", {id: "check-runs", class: "alternatives"},
      h("thead", {}, h("tr", {}, ["run", "verdict", "time", "worst output", "max abs", "max rel", "detail"].map((n) => h("th", {scope: "col", text: n})))),
      h("tbody", {}, runRow(report.native), runRow(report.use)))),
    h("h4", {text: "Thread CPU time per call"}),
    h("figure", {class: "card chart-card"}, h("figcaption", {text: report.timing}), timingChart(report, width)),
    h("h4", {text: "Decisions inside use()"}),
    decisions.length
      ? h("div", {class: "scroll"}, h("table", {id: "check-decisions", class: "alternatives"},
        h("thead", {}, h("tr", {}, ["op", "stack", "batched", "composite", "kind", "calls", "reason"].map((n) => h("th", {scope: "col", text: n})))),
        h("tbody", {}, decisions.map((d) => h("tr", {}, h("td", {text: d.op}), h("td", {text: d.stack}),
          h("td", {text: (d.batched || []).join(", ") || "none"}), h("td", {text: d.composite}), h("td", {text: d.kind}),
          h("td", {text: String(d.calls)}), h("td", {text: d.reason}))))))
      : h("p", {text: "None: no covered op was called under the transform."}),
    h("ul", {id: "check-notes"}, [
      ...(report.functionalized || []).map((f) => h("li", {text: `functionalized automatically: ${f}`})),
      ...(report.splits || []).map((s) => h("li", {text: `batch split: ${s}`})),
      h("li", {text: `compared at the ${report.tolerance} tolerance; ${check.function}; torch ${check.torch_version}`})]),
  );
  out.hidden = false;
}

async function startCheck(event) {
  event.preventDefault();
  showError("checks-error", null);
  const rounds = Number($("check-rounds").value);
  if (!Number.isInteger(rounds) || rounds < 1 || rounds > 20) {
    showError("checks-error", new Error("check: timing rounds must be a whole number from 1 to 20"));
    return;
  }
  try {
    const job = await api("POST", "/checks", {example: $("check-example").value, policy: $("check-policy").value, rounds});
    state.jobs.set(job.id, job);
    rememberJobs();
    renderJobs();
    $("checks-summary").textContent = `Check ${job.id.slice(0, 8)} started; its report shows here when it is done.`;
    pollJob(job.id);
  } catch (error) {
    showError("checks-error", error);
  }
}

// ---------------------------------------------------------------- start

async function workloadNames() {
  // The API's own list of workloads (its OpenAPI schema), so a new one shows here without a dashboard change.
  try {
    const schema = await api("GET", "/openapi.json");
    const field = schema.components.schemas.ProfileCreate.properties.workloads;
    const arrays = [field, ...(field.anyOf || [])].filter((s) => s.type === "array");
    const names = arrays.length && arrays[0].items && arrays[0].items.enum;
    if (Array.isArray(names) && names.length) return names;
  } catch {
    // An API without that schema still takes the workloads of issue 5.
  }
  return FALLBACK_WORKLOADS;
}

function checkboxes(container, name, values, checked) {
  container.replaceChildren(...values.map((value) => h("label", {},
    h("input", {type: "checkbox", name, value, checked: checked.includes(value)}), ` ${value}`)));
}

async function start() {
  window.addEventListener("hashchange", showView);
  renderLegend();
  showView();
  for (const id of ["matrix-op", "matrix-status", "matrix-kind"]) $(id).addEventListener("change", renderMatrix);
  for (const id of ["profiles-op", "profiles-workload"]) $(id).addEventListener("change", renderProfiles);
  $("matrix-reload").addEventListener("click", loadMatrix);
  $("matrix-table").addEventListener("keydown", moveInGrid);
  $("profiles-reload").addEventListener("click", loadProfiles);
  $("decide-form").addEventListener("submit", decide);
  $("decide-op").addEventListener("change", fillDecisionForm);
  $("verify-form").addEventListener("submit", (event) => startJob(event, "verify"));
  $("profile-form").addEventListener("submit", (event) => startJob(event, "profile"));
  $("check-form").addEventListener("submit", startCheck);
  $("check-example").addEventListener("change", describeExample);
  $("checks-reload").addEventListener("click", () => loadChecks());
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      renderProfiles();
      renderCheck();
    }, 150);
  });

  try {
    const [version, ops, workloads, examples] = await Promise.all([api("GET", "/version"), api("GET", "/ops"),
      workloadNames(), api("GET", "/checks/examples").catch(() => [])]);
    state.examples = examples;
    fillExamples();
    $("version").textContent = `${version.multicomposite} · torch ${version.torch} · ${version.device}`;
    state.ops = ops;
    const names = ops.map((o) => o.name);
    optionList($("matrix-op"), names);
    optionList($("profiles-op"), names);
    optionList($("decide-op"), names, false);
    fillDecisionForm();
    checkboxes($("verify-ops"), "verify-op", names, []);
    checkboxes($("profile-ops"), "profile-op", names, []);
    checkboxes($("profile-workloads"), "profile-workload", workloads, ["vmap"]);
  } catch (error) {
    showError("global-error", error);
  }
  // A remembered job the server no longer knows (restarted, or pruned it) is dropped.
  const [, , , ...remembered] = await Promise.all([loadMatrix(), loadProfiles(), loadChecks(), ...rememberedJobs().map((id) =>
    api("GET", `/jobs/${encodeURIComponent(id)}`).catch(() => null))]);
  for (const job of remembered) if (job) state.jobs.set(job.id, job); // in the order they were started
  rememberJobs();
  renderJobs();
  for (const job of state.jobs.values()) if (!TERMINAL_JOB_STATES.has(job.state)) pollJob(job.id, {forgetIfGone: true});
  document.body.dataset.ready = "true"; // the page has asked for everything once
}

document.addEventListener("DOMContentLoaded", start);
