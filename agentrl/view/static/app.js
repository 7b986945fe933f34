// agentrl view: a page over the JSON API of agentrl/view/server.py. No framework and no CDN, so it
// works offline; every text from a run (model output, sandbox output) goes in through textContent.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

async function api(path) {
  const r = await fetch(path);
  if (!r.ok) {
    const body = await r.text();
    let said = body;
    try { said = JSON.parse(body).detail ?? body; } catch { /* not JSON: shown as it came */ }
    throw new Error(`${path}: ${r.status} ${said}`);
  }
  return r.json();
}

const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? x.toFixed(d) : String(x));

// -- warnings (corrupt or torn lines) -----------------------------------------------------

// per source, its latest answer's: a torn line the writer has since finished, or a resume removed, stops showing
const warningsBy = {};
function warn(source, list) {
  warningsBy[source] = list || [];
  const all = [...new Set(Object.values(warningsBy).flat())];
  const box = $("#warnings");
  box.hidden = all.length === 0;
  box.replaceChildren(el("b", { text: "Some lines could not be read; what is readable is shown:" }),
    el("ul", {}, ...all.map((w) => el("li", { text: w }))));
}

// -- overview: config and metric curves, refreshed while the run goes -----------------------

const CURVES = [
  { title: "training reward", series: [["metrics", "rollout/reward"]] },
  { title: "success rate: training (T=1) and held-out (greedy)",
    series: [["metrics", "rollout/success_rate"], ["eval", "success_rate"]] },
  { title: "clip fraction", series: [["metrics", "train/clip_fraction"]] },
  { title: "engine/trainer mismatch (mean |Δ logprob|)", series: [["metrics", "train/mismatch_abs_logprob_diff"]] },
  { title: "expert flip rate", series: [["metrics", "train/expert_flip_rate"]] },
  { title: "sandbox failures and retries", series: [["metrics", "rollout/failed"], ["metrics", "rollout/retried"]] },
  { title: "partial rollouts: parked and trained after carry-over",
    series: [["metrics", "rollout/parked"], ["metrics", "rollout/partial_trained"]] },
];
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

function chart(spec, data) {
  const W = 320, H = 150, P = 28;
  const lines = spec.series.map(([src, key]) => ({
    key, points: (data[src] || []).filter((r) => typeof r[key] === "number").map((r) => [r.iteration, r[key]]),
  }));
  const all = lines.flatMap((l) => l.points);
  const box = el("div", { class: "chart", "data-title": spec.title }, el("h3", { text: spec.title }));
  if (!all.length) return box.appendChild(el("div", { class: "empty", text: "no data yet" })), box;
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) [y0, y1] = [y0 - 1, y1 + 1];
  const sx = (x) => P + ((x - x0) / (x1 - x0)) * (W - P - 6), sy = (y) => H - 16 - ((y - y0) / (y1 - y0)) * (H - 24);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const text = (x, y, s, anchor = "start") => {
    const t = document.createElementNS(ns, "text");
    Object.entries({ x, y, "font-size": 9, fill: "#666", "text-anchor": anchor }).forEach(([k, v]) => t.setAttribute(k, v));
    t.textContent = s;
    svg.appendChild(t);
  };
  text(2, 10, fmt(y1, 3)); text(2, H - 16, fmt(y0, 3)); text(P, H - 3, `it ${x0}`); text(W - 4, H - 3, `it ${x1}`, "end");
  lines.forEach((l, i) => {
    if (!l.points.length) return;
    const pl = document.createElementNS(ns, "polyline");
    pl.setAttribute("points", l.points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "));
    pl.setAttribute("fill", "none");
    pl.setAttribute("stroke", COLORS[i]);
    pl.setAttribute("stroke-width", "1.5");
    pl.setAttribute("data-key", l.key);
    svg.appendChild(pl);
  });
  box.append(svg, el("div", { class: "legend" },
    ...lines.map((l, i) => el("span", { style: `color:${COLORS[i]}`, text: `— ${l.key} (${l.points.length})` }))));
  return box;
}

async function overview(main) {
  const info = await api("/api/overview");
  const charts = el("div", { class: "charts", id: "charts" });
  main.replaceChildren(el("h2", { text: info.kind === "eval" ? "Evaluation" : "Run" }));
  if (info.summary) main.append(el("pre", { class: "config", id: "summary", text: JSON.stringify(info.summary, null, 1) }));
  if (info.kind === "run") main.append(charts);
  if (info.config) main.append(el("details", { open: "" }, el("summary", { text: "config.yaml" }),
    el("pre", { class: "config", id: "config", text: info.config })));
  if (info.kind !== "run") return;
  const draw = async () => {
    const data = await api("/api/metrics");
    warn("metrics", data.warnings);
    // eval.benchmarks: one chart per benchmark, its pass@k curves
    const benches = [...new Set(data.bench.map((r) => r.env))].map((env) => {
      data[`bench:${env}`] = data.bench.filter((r) => r.env === env);
      const keys = [...new Set(data[`bench:${env}`].flatMap((r) => Object.keys(r).filter((k) => k.startsWith("pass@"))))];
      return { title: `${env}: ${keys.join(", ")}`, series: keys.map((k) => [`bench:${env}`, k]) };
    });
    charts.replaceChildren(...[...CURVES, ...benches].map((c) => chart(c, data)));
    $("#live").textContent = `${data.metrics.length} iterations · refreshed ${new Date().toLocaleTimeString()}`;
  };
  await draw();
  return draw;
}

// -- the trajectory list: filters and pages (the server pages, nothing loads whole) -----------

const FILTERS = ["iteration", "task", "group", "min_reward", "max_reward", "failure", "turns", "partial", "multi"];

async function trajectories(main, params) {
  const facets = await api("/api/facets");
  const options = (name, values) => el("select", { name }, el("option", { value: "", text: "any" }),
    ...values.map((v) => el("option", { value: v, text: v })));
  const form = el("form", { class: "filters" },
    el("label", {}, "iteration", options("iteration", facets.iterations)),
    el("label", {}, "task contains", el("input", { name: "task" })),
    el("label", {}, "group", el("input", { name: "group" })),
    el("label", {}, "reward ≥", el("input", { name: "min_reward", type: "number", step: "any" })),
    el("label", {}, "reward ≤", el("input", { name: "max_reward", type: "number", step: "any" })),
    el("label", {}, "failure / status", options("failure", facets.failures)),
    el("label", {}, "turns", options("turns", facets.turns)),
    el("label", {}, "partial", options("partial", ["true", "false"])),
    el("label", {}, "sequences", el("select", { name: "multi" }, el("option", { value: "", text: "any" }),
      el("option", { value: "true", text: "several" }), el("option", { value: "false", text: "one" }))),
    el("button", { type: "submit", text: "filter" }));
  for (const k of FILTERS) if (params.get(k) !== null && form.elements[k]) form.elements[k].value = params.get(k);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    for (const k of FILTERS) if (form.elements[k].value !== "") q.set(k, form.elements[k].value);
    location.hash = `#/trajectories?${q}`;
  });
  const offset = Number(params.get("offset") || 0), limit = Number(params.get("limit") || 50);
  const q = new URLSearchParams(params);
  q.set("offset", offset); q.set("limit", limit);
  const page = await api(`/api/trajectories?${q}`);
  warn("trajectories", page.warnings);
  const move = (to) => { const p = new URLSearchParams(params); p.set("offset", to); location.hash = `#/trajectories?${p}`; };
  const pager = el("div", { class: "pager" },
    el("button", { text: "◀ newer", disabled: offset > 0 ? null : "", onclick: () => move(Math.max(0, offset - limit)) }),
    el("span", { id: "count", text: `${page.matching ? offset + 1 : 0}–${offset + page.items.length} of ${page.matching} matching (${page.total} saved)` }),
    el("button", { text: "older ▶", disabled: offset + limit < page.matching ? null : "", onclick: () => move(offset + limit) }));
  const head = ["iteration", "task", "group", "reward", "turns", "seq", "versions", "status", "failure", "s_i", "clipped"];
  const rows = page.items.map((t) => {
    const verdict = page.verdicts[t.task_id];
    return el("tr", { class: "row", "data-episode": t.episode_id, onclick: () => { location.hash = `#/t/${t.episode_id}`; } },
      el("td", { text: t.iteration ?? "eval" }), el("td", { text: t.task_id + (verdict ? ` (${verdict.correct}/${verdict.n} correct)` : "") }),
      el("td", { text: t.group_id }), el("td", { text: fmt(t.reward, 2) }), el("td", { text: t.turns }),
      el("td", { class: (t.sequences ?? 1) > 1 ? "seqs multi" : "seqs", text: t.sequences ?? 1 }),
      el("td", { text: t.versions.join(",") + (t.partial ? " (partial)" : "") }), el("td", { text: t.status }),
      el("td", { class: t.failure === "ok" ? "" : "bad", text: t.failure }), el("td", { text: fmt(t.ratio, 4) }),
      el("td", { class: t.clipped ? "clipped" : "", text: t.clipped === null ? "–" : fmt(t.clipped, 2) }));
  });
  main.replaceChildren(el("h2", { text: "Trajectories" }), form, pager,
    el("table", { id: "trajectories" }, el("tr", {}, ...head.map((h) => el("th", { text: h }))), ...rows));
}

// -- one trajectory, turn by turn, tokens coloured on demand ----------------------------------

const MODES = {
  none: { label: "no colour", color: () => null, scale: "" },
  advantage: { label: "advantage", scale: "green: positive advantage, red: negative (saturates at |A| = 2)",
    color: (t) => (t.a === null ? null : t.a >= 0 ? `rgba(0,160,0,${0.08 + Math.min(t.a / 2, 1) * 0.6})`
      : `rgba(220,0,0,${0.08 + Math.min(-t.a / 2, 1) * 0.6})`) },
  version: { label: "policy version", scale: "one hue per policy version that sampled the token",
    color: (t) => `hsl(${(t.v * 67) % 360},70%,80%)` },
  logprob: { label: "engine logprob", scale: "darker: less likely under the engine (1 − p)",
    color: (t) => `rgba(255,140,0,${(1 - Math.exp(t.lp)) * 0.85})` },
  diff: { label: "engine vs trainer", scale: "darker: larger |lp_θ − lp_engine| (saturates at 0.5)",
    color: (t) => (t.tlp === null ? null : `rgba(128,0,200,${Math.min(Math.abs(t.tlp - t.lp) / 0.5, 1) * 0.85})`) },
  router: { label: "router disagreement", scale: "darker: more MoE layers routed otherwise by the trainer than by the engine (none coloured: the same experts, or no record)",
    color: (t) => (t.rd === null || t.rd <= 0 ? null : `rgba(0,90,200,${0.15 + t.rd * 0.7})`) },
};
let colourMode = "advantage";

function tokens(turn) {
  return turn.tokens.map((s, j) => ({ s, lp: turn.logprob[j], v: turn.version[j],
    a: turn.advantage ? turn.advantage[j] : null, tlp: turn.trainer_logprob ? turn.trainer_logprob[j] : null,
    rd: turn.router_differs ? turn.router_differs[j] : null }));
}

function paint(root) {
  const mode = MODES[colourMode];
  for (const span of root.querySelectorAll(".tok")) {
    const t = span._tok, c = mode.color(t);
    span.style.background = c || "";
    span.dataset.colour = c ? colourMode : "";
  }
  const scale = root.querySelector(".scale");
  if (scale) scale.textContent = mode.scale;
}

function generated(turn) {
  return el("div", { class: "gen" }, ...tokens(turn).map((t) => {
    const routed = t.rd === null || t.rd < 0 ? "" : ` · router differs ${fmt(t.rd, 2)}`;
    const span = el("span", { class: "tok", title: `lp ${fmt(t.lp, 4)} · v${t.v} · A ${fmt(t.a, 3)} · lp_θ ${fmt(t.tlp, 4)}${routed}`, text: t.s });
    span._tok = t;
    return span;
  }));
}

function calls(info) {
  if (!info || !info.calls || !info.calls.length) return null;
  const pre = (s) => el("pre", { text: s ?? "" });
  return el("table", { class: "calls" },
    el("tr", {}, ...["tool", "status", "arguments", "sandbox run", "stdout", "stderr"].map((h) => el("th", { text: h }))),
    ...info.calls.map((c) => el("tr", {},
      el("td", { text: c.tool ?? "(unparsed)" }), el("td", { class: c.status === "ok" ? "good" : "bad", text: c.status }),
      el("td", {}, pre(c.arguments ? Object.entries(c.arguments).map(([k, v]) => `${k}:\n${typeof v === "string" ? v : JSON.stringify(v)}`).join("\n") : c.output)),
      el("td", { text: c.run ? `${c.run.status} (exit ${c.run.exit_code ?? "–"}, ${fmt(c.run.wall_s, 3)} s)` : "–" }),
      el("td", {}, pre(c.run ? c.run.stdout : "")), el("td", {}, pre(c.run ? c.run.stderr : "")))));
}

// A repository episode's final diff (repo_fix puts it in the graded turn's info), lines coloured as added or removed.
function diffBox(info) {
  if (!info || typeof info.diff !== "string") return null;
  const files = info.changed_files || [];
  const left = Object.entries(info.left_out || {}).map(([p, why]) => `${p} (${why})`);
  const title = `the agent's diff: ${files.length} file${files.length === 1 ? "" : "s"}` + (left.length ? ` · left out: ${left.join(", ")}` : "");
  const kind = (line) => (/^\+(?!\+\+ )/.test(line) ? "add" : /^-(?!-- )/.test(line) ? "del" : /^@@/.test(line) ? "hunk" : null);
  const lines = info.diff ? info.diff.replace(/\n$/, "").split("\n") : ["(no change)"];
  return el("details", { class: "diffbox", open: "" }, el("summary", { text: title }),
    el("pre", { class: "diff" }, ...lines.map((line) => el("span", { class: kind(line), text: line + "\n" }))));
}

// GiGPO's step group: the turns of the group (saved ones only) that acted in the same state as this one.
function stepGroup(turn) {
  const key = turn.state_key, g = turn.step_group;
  if (key === null || key === undefined) return "";
  const where = g ? ` · step group: ${g.size} turn${g.size === 1 ? "" : "s"} among saved (in ${g.trajectories} of ${g.saved} saved trajectories of the group)` : "";
  const members = g ? g.members.map(([e, i]) => `${e.slice(0, 8)} turn ${i}`).join("\n") : "";
  return el("span", { class: "stepgroup", "data-state": key, "data-size": g ? g.size : null, title: `state ${key}${members ? "\n" + members : ""}`,
    text: ` · state ${key.slice(0, 8)}${where}` });
}

function turnBox(turn) {
  const adv = turn.advantage ? turn.advantage.find((a) => a !== 0) ?? 0 : null;
  const info = turn.info || {};
  const outcome = "outcome" in info ? ` · outcome ${info.outcome}` + ("tests_passed" in info ? ` (${info.tests_passed}/${info.tests_total} tests)` : "") : "";
  return el("div", { class: "turn", "data-turn": turn.index },
    el("h3", {}, `turn ${turn.index} · reward ${fmt(turn.reward, 3)} · advantage ${fmt(adv, 3)} · ${turn.tokens.length} tokens · ${turn.finish_reason ?? "unfinished"}${outcome}`,
      stepGroup(turn)),
    generated(turn), calls(info) || "", el("pre", { class: "obs", text: turn.observation || "(no reply: the episode ended)" }),
    diffBox(info) || "");
}

const infoText = (info) => Object.entries(info || {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(", ");

// A trajectory's body: its prompt (optional) and turns; with several sequences, each under a header of its own,
// a later sequence's prompt (the conversation re-rendered, folded or rewritten: context, never trained) collapsed.
function episode(t, withPrompt) {
  const prompt = () => el("details", {}, el("summary", { text: "prompt (system, tools, task)" }), el("pre", { class: "obs", text: t.prompt }));
  const seqs = t.sequences || [];
  if (seqs.length <= 1) return [withPrompt ? prompt() : "", ...t.turns.map(turnBox)];
  return seqs.map((s) => {
    const why = s.index === 0 ? "the episode's start" : s.reason + (Object.keys(s.info || {}).length ? ` (${infoText(s.info)})` : "");
    const ratio = s.ratio === null || s.ratio === undefined ? "" : ` · s_i ${fmt(s.ratio, 4)}`;
    return el("section", { class: "sequence", "data-sequence": s.index, "data-reason": s.reason ?? "start" },
      el("h3", { class: "seq-head", text: `sequence ${s.index + 1} of ${seqs.length} — ${why} · ${s.tokens} tokens (${s.generated} generated) · prompt ${s.prompt} tokens${ratio}` }),
      s.index === 0 ? (withPrompt ? prompt() : "")
        : el("details", { class: "context" }, el("summary", { text: `context: the conversation so far, re-rendered as this sequence's prompt (${s.prompt} tokens, repeats earlier turns, not trained)` }),
          el("pre", { class: "context", text: s.context })),
      s.lead ? el("pre", { class: "obs", text: s.lead }) : "",
      ...s.turns.map((i) => turnBox(t.turns[i])));
  });
}

function modeSelect(root) {
  const sel = el("select", { id: "colour" }, ...Object.entries(MODES).map(([k, m]) => el("option", { value: k, text: m.label })));
  sel.value = colourMode;
  sel.addEventListener("change", () => { colourMode = sel.value; paint(root); });
  return el("label", {}, "colour tokens by ", sel, " ", el("span", { class: "scale" }));
}

async function trajectory(main, id) {
  const t = await api(`/api/trajectory/${encodeURIComponent(id)}`);
  const tr = t.trained;
  const seqs = (t.sequences || []).length;
  const clipText = tr ? (tr.clipped > 0 ? `${(100 * tr.clipped).toFixed(0)}% of tokens on the clipped branch` : "not clipped") : "not trained (failed, dropped or unsaved)";
  main.replaceChildren(
    el("h2", { text: `Trajectory ${t.episode_id}` }),
    el("div", { class: "meta", id: "meta" },
      el("span", {}, el("b", { text: "task " }), t.task_id),
      el("span", {}, el("b", { text: "iteration " }), t.iteration ?? "eval"),
      el("span", {}, el("b", { text: "episode return " }), fmt(t.reward, 3)),
      el("span", {}, el("b", { text: "status " }), `${t.status} / ${t.failure}${t.error ? ": " + t.error : ""}${t.truncation ? " (truncated: " + t.truncation + ")" : ""}`),
      el("span", {}, el("b", { text: "policy versions " }), t.versions.join(", ") + (t.versions.length > 1 ? " (partial rollout)" : "")),
      seqs > 1 ? el("span", { id: "sequences" }, el("b", { text: "sequences " }), `${seqs} (` + t.sequences.slice(1).map((s) => s.reason).join(", ") + ")") : "",
      el("span", { id: "ratio" }, el("b", { text: "sequence ratio s_i " }), tr ? fmt(tr.ratio, 5) + (seqs > 1 ? ` (mean of ${seqs} sequences)` : "") : "–"),
      el("span", { id: "clip", class: tr && tr.clipped > 0 ? "clipped" : "" }, el("b", { text: "clip " }), clipText),
      el("span", {}, el("b", { text: "minibatch " }), tr ? tr.minibatch : "–"),
      el("span", {}, el("b", { text: "turn rewards " }), t.turns.map((x) => fmt(x.reward, 2)).join(", ")),
      el("a", { href: `#/g/${encodeURIComponent(t.group_id)}/${t.iteration ?? ""}`, text: `group ${t.group_id} side by side` })),
    modeSelect(main),
    ...episode(t, true));
  paint(main);
}

async function group(main, gid, iteration) {
  const answer = await api(`/api/group/${encodeURIComponent(gid)}${iteration !== "" ? `?iteration=${iteration}` : ""}`);
  warn("group", answer.warnings);
  const members = answer.members;
  const side = el("div", { class: "side", id: "group" }, ...members.map((t) => el("div", { class: "sample", "data-episode": t.episode_id },
    el("div", {}, el("a", { href: `#/t/${t.episode_id}`, text: t.episode_id.slice(0, 8) }),
      ` · return ${fmt(t.reward, 3)} · s_i ${t.trained ? fmt(t.trained.ratio, 4) : "–"}` + (t.trained && t.trained.clipped > 0 ? " · clipped" : "")
      + ((t.sequences || []).length > 1 ? ` · ${t.sequences.length} sequences` : "")),
    ...episode(t, false))));
  main.replaceChildren(el("h2", { text: `Group ${gid}: ${members.length} samples of one task` }), modeSelect(main), side);
  paint(main);
}

// -- evaluation results ----------------------------------------------------------------------

async function results(main, params) {
  const offset = Number(params.get("offset") || 0);
  const page = await api(`/api/results?offset=${offset}&limit=50`);
  warn("results", page.warnings);
  const keys = page.items.length ? Object.keys(page.items[0]).filter((k) => k !== "returns") : [];
  main.replaceChildren(el("h2", { text: `Results: ${page.matching} rows` }),
    el("div", { class: "pager" },
      el("button", { text: "◀", disabled: offset > 0 ? null : "", onclick: () => { location.hash = `#/results?offset=${Math.max(0, offset - 50)}`; } }),
      el("span", { text: `${offset + 1}–${offset + page.items.length}` }),
      el("button", { text: "▶", disabled: offset + 50 < page.matching ? null : "", onclick: () => { location.hash = `#/results?offset=${offset + 50}`; } })),
    el("table", { id: "results" }, el("tr", {}, ...keys.map((k) => el("th", { text: k }))),
      ...page.items.map((r) => el("tr", { class: "row", onclick: () => { location.hash = `#/trajectories?task=${encodeURIComponent(r.task_id)}`; } },
        ...keys.map((k) => el("td", {}, k === "completion" ? el("pre", { text: r[k] }) : typeof r[k] === "object" ? JSON.stringify(r[k]) : String(r[k])))))));
}

// -- routing ---------------------------------------------------------------------------------

// A page is built apart and shown once loaded, only if it is still the one asked for: a slow one (a group of long
// trajectories) the user has left meanwhile must not replace the page they went to, nor keep refreshing.
let timer = null, latest = 0;

async function route() {
  clearInterval(timer);
  const mine = ++latest;
  const view = el("div");
  const [path, query] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  const parts = (path || "/").split("/").filter(Boolean).map(decodeURIComponent);
  let again = null;  // what the page redraws every 3 s (the overview's curves, while the run goes)
  try {
    if (parts[0] === "trajectories") await trajectories(view, params);
    else if (parts[0] === "t") await trajectory(view, parts[1]);
    else if (parts[0] === "g") await group(view, parts[1], parts[2] ?? "");
    else if (parts[0] === "results") await results(view, params);
    else again = await overview(view);
  } catch (e) {
    view.replaceChildren(el("pre", { class: "bad", text: String(e) }));
  }
  if (mine !== latest) return;
  $("#main").replaceChildren(view);
  if (again) timer = setInterval(() => again().catch((e) => { $("#live").textContent = String(e); }), 3000);
}

(async () => {
  const info = await api("/api/overview");
  $("#folder").textContent = info.path;
  $("#nav-results").hidden = info.kind !== "eval";
  window.addEventListener("hashchange", route);
  await route();
})();
