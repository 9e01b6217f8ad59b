// kvserve cache dashboard (docs/dashboard.md). No framework, no build step.
//
// Polls /admin/dashboard/stats every REFRESH_MS with the admin token from sessionStorage (sent
// only as `Authorization: Bearer`, never in a URL), and the selected pool's radix tree every
// TREE_REFRESH_MS. Rates over time are differences of the cache service's counters between
// polls, kept here: any gateway can answer any poll.
//
// Everything that comes from the cache (decoded prompts, namespaces, pool ids, addresses) is
// hostile: it is written with textContent or as a property (title, value, dataset), never
// as markup. The page's Content-Security-Policy forbids inline script and style anyway.
"use strict";
(() => {
  const REFRESH_MS = 2000;
  // InspectTree walks the index on the cache service's event loop (~5 us a node, up to 10k
  // nodes): a tree every 5 s, not every 2, keeps a wall screen's cost off the data plane.
  const TREE_REFRESH_MS = 5000;
  const WINDOW_S = 60; // "last minute" figures
  const SMOOTH_S = 30; // the hit-rate chart's moving window
  const HISTORY_S = 600; // what the charts show at most
  const TREE_NODES = 500;
  const OPEN_DEPTH = 1; // tree nodes this shallow start open: a namespace's first nodes
  const MAX_BRANCHES = 12; // children shown per node until "show" is clicked
  const TOKEN_KEY = "kvserve.adminToken";

  const $ = (id) => document.getElementById(id);
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  const state = {
    paused: false,
    running: false,
    generation: 0, // of the poll loop: see start()
    timer: null,
    lastOk: null, // performance.now() of the last good poll
    lastTree: 0,
    prev: new Map(), // pool id -> its stats at the previous poll
    history: [], // one sample per poll: counter differences since the previous one
    pools: [],
    selected: null, // the tree's pool
    treeSeq: 0,
    open: new Set(), // tree nodes the user opened ...
    closed: new Set(), // ... or closed
    all: new Set(), // nodes whose every child is shown
  };

  // -- formatting --------------------------------------------------------------------------

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function num(n) {
    if (n === null || n === undefined || !Number.isFinite(n)) return "–";
    const a = Math.abs(n);
    const units = [[1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [scale, unit] of units) {
      if (a >= scale) return (n / scale).toFixed(a >= 10 * scale ? 0 : 1) + unit;
    }
    return Number.isInteger(n) ? String(n) : n.toFixed(a >= 10 ? 0 : 1);
  }

  function bytes(n) {
    const units = [[2 ** 40, "TiB"], [2 ** 30, "GiB"], [2 ** 20, "MiB"], [2 ** 10, "KiB"]];
    for (const [scale, unit] of units) {
      if (n >= scale) return (n / scale).toFixed(n >= 10 * scale ? 0 : 1) + " " + unit;
    }
    return n + " B";
  }

  function pct(x) {
    if (x === null || x === undefined || !Number.isFinite(x)) return "–";
    return (100 * x).toFixed(x === 0 || x === 1 ? 0 : 1) + "%";
  }

  function ago(s) {
    if (s === null || s === undefined) return "never";
    if (s < 1) return "now";
    if (s < 60) return s.toFixed(0) + " s";
    if (s < 3600) return (s / 60).toFixed(0) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  // Control characters as visible symbols (a newline as ⏎), bidi and zero-width controls as
  // U+FFFD: a prompt must not reorder or hide the text around it.
  const INVISIBLE = /\r\n|[\u0000-\u001f\u007f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]/g;
  function visible(s) {
    return s.replace(INVISIBLE, (c) => {
      if (c === "\n" || c === "\r\n") return "⏎";
      if (c === "\t") return "⇥";
      const code = c.charCodeAt(0);
      if (code < 0x20) return String.fromCharCode(0x2400 + code);
      return code === 0x7f ? "␡" : "\ufffd";
    });
  }

  // -- token and errors --------------------------------------------------------------------

  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

  function showError(text) {
    const box = $("error");
    box.textContent = text;
    box.hidden = false;
  }

  function clearError() {
    $("error").hidden = true;
    $("error").textContent = "";
  }

  function askForToken() {
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    $("main").hidden = true;
    $("pause").hidden = true;
    $("forget").hidden = true;
    $("token-form").hidden = false;
    $("updated").textContent = "not connected";
    $("token-input").focus();
  }

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function getJSON(path) {
    let resp;
    try {
      resp = await fetch(path, {
        headers: { Authorization: "Bearer " + token() },
        cache: "no-store",
        credentials: "omit",
      });
    } catch (e) {
      // A token with characters a header cannot carry fails here too, before any request.
      throw new HttpError(0, "the gateway did not answer (" + e.message + ")");
    }
    let body = null;
    try {
      body = await resp.json();
    } catch (e) {
      body = null;
    }
    if (!resp.ok) {
      const msg = body && body.error && typeof body.error.message === "string"
        ? body.error.message : resp.statusText;
      throw new HttpError(resp.status, msg);
    }
    return body;
  }

  function failed(e) {
    if (e.status === 401 || e.status === 403) {
      askForToken();
      showError(e.status + " Unauthorized: the admin token was refused (" + e.message +
        "). Enter the cache service's admin token.");
      return;
    }
    const what = e.status ? "HTTP " + e.status : "no answer";
    showError(what + ": " + e.message + " (retrying every " + REFRESH_MS / 1000 + " s)");
  }

  // -- polling -----------------------------------------------------------------------------

  // Each start (and stop) begins a new generation of the poll loop: a poll still in flight
  // from an earlier one ends without drawing or scheduling anything, so there is never more
  // than one loop (a token entered again while the refused one's poll was out).
  function stop() {
    state.running = false;
    state.generation += 1;
    clearTimeout(state.timer);
  }

  function start() {
    stop();
    state.running = true;
    $("token-form").hidden = true;
    $("main").hidden = false;
    $("pause").hidden = false;
    $("forget").hidden = false;
    tick(state.generation);
  }

  async function tick(generation) {
    const current = () => state.running && generation === state.generation;
    if (!current()) return;
    if (!state.paused) {
      try {
        const data = await getJSON("/admin/dashboard/stats");
        if (!current()) return;
        clearError();
        state.lastOk = performance.now();
        render(data);
        if (state.selected && performance.now() - state.lastTree >= TREE_REFRESH_MS - 100) {
          await refreshTree();
        }
      } catch (e) {
        if (!current()) return;
        failed(e);
      }
    }
    if (current()) state.timer = setTimeout(() => tick(generation), REFRESH_MS);
  }

  // -- history -----------------------------------------------------------------------------

  // A pool's counters only grow within one incarnation: a re-registered pool (new incarnation)
  // or a restarted cache service (counters back at 0) adds no difference for that poll.
  function record(pools) {
    const t = performance.now() / 1000;
    const last = state.history[state.history.length - 1];
    const s = { t, dt: last ? t - last.t : null, prompt: 0, cached: 0, acquires: 0, hits: 0,
      evicted: 0, leases: 0, per: new Map() };
    for (const p of pools) {
      s.leases += p.live_leases;
      const q = state.prev.get(p.pool_id);
      const same = q && q.incarnation === p.incarnation && p.prompt_tokens >= q.prompt_tokens &&
        p.acquires >= q.acquires && p.evicted_blocks >= q.evicted_blocks;
      if (same && s.dt !== null) {
        const d = {
          prompt: p.prompt_tokens - q.prompt_tokens,
          cached: p.cached_tokens - q.cached_tokens,
          acquires: p.acquires - q.acquires,
          hits: p.acquire_hits - q.acquire_hits,
          evicted: p.evicted_blocks - q.evicted_blocks,
        };
        for (const k of Object.keys(d)) s[k] += d[k];
        s.per.set(p.pool_id, d);
      }
    }
    state.prev = new Map(pools.map((p) => [p.pool_id, p]));
    state.history.push(s);
    while (state.history.length && t - state.history[0].t > HISTORY_S + WINDOW_S) {
      state.history.shift();
    }
  }

  // Sums of the differences over the last `span` seconds before `end` (and for one pool).
  function windowSums(span, end, pool) {
    const w = { prompt: 0, cached: 0, acquires: 0, hits: 0, evicted: 0, seconds: 0 };
    for (const s of state.history) {
      if (s.dt === null || s.t <= end - span || s.t > end) continue;
      const d = pool === undefined ? s : s.per.get(pool);
      w.seconds += s.dt;
      if (!d) continue;
      for (const k of ["prompt", "cached", "acquires", "hits", "evicted"]) w[k] += d[k];
    }
    return w;
  }

  const ratio = (a, b) => (b > 0 ? a / b : null);

  // -- rendering ---------------------------------------------------------------------------

  function render(data) {
    const pools = data.pools;
    state.pools = pools;
    record(pools);
    $("model").textContent = "model " + data.model;
    $("cache-service").textContent = "cache service " + data.cache_service;
    renderTiles(pools);
    renderPools(pools);
    renderCharts();
    renderPoolChoice(pools);
  }

  function setTile(id, big, sub) {
    $(id).textContent = big;
    $(id + "-sub").textContent = sub;
  }

  function renderTiles(pools) {
    const sum = (f) => pools.reduce((a, p) => a + f(p), 0);
    const total = sum((p) => p.num_blocks);
    const used = total - sum((p) => p.free_blocks);
    const tokens = (f) => sum((p) => f(p) * p.block_size);
    const now = performance.now() / 1000;
    const w = windowSums(WINDOW_S, now);
    const healthy = pools.filter((p) => p.worker && p.worker.healthy).length;
    const running = sum((p) => (p.worker && p.worker.running) || 0);
    const waiting = sum((p) => (p.worker && p.worker.waiting) || 0);

    setTile("t-pools", sum((p) => (p.alive ? 1 : 0)) + " / " + pools.length,
      healthy + " reachable from this gateway");
    setTile("t-used", pct(ratio(used, total)), num(used) + " / " + num(total) + " blocks · " +
      num(tokens((p) => p.num_blocks - p.free_blocks)) + " / " + num(tokens((p) => p.num_blocks)) +
      " tok");
    setTile("t-hit", w.seconds ? pct(ratio(w.cached, w.prompt)) : "…",
      "since start " + pct(ratio(sum((p) => p.cached_tokens), sum((p) => p.prompt_tokens))) +
      " · requests " + pct(ratio(sum((p) => p.acquire_hits), sum((p) => p.acquires))));
    setTile("t-tps", w.seconds ? num(w.prompt / w.seconds) : "…",
      w.seconds ? "cached " + num(w.cached / w.seconds) + " tok/s · " +
        num((60 * w.acquires) / w.seconds) + " acquires/min" : "collecting");
    setTile("t-leases", num(sum((p) => p.live_leases)),
      "workers: " + running + " running · " + waiting + " waiting");
    setTile("t-evict", w.seconds ? num(w.evicted) + " blk" : "…",
      "total " + num(sum((p) => p.evicted_blocks)) + " blk · " +
      num(sum((p) => p.expired_leases)) + " leases expired");
  }

  function occupancy(p) {
    const td = el("td", "occ left");
    td.dataset.k = "occupancy";
    const bar = el("div", "bar");
    for (const [cls, n] of [["referenced", p.referenced_blocks], ["cached", p.cached_blocks],
      ["free", p.free_blocks]]) {
      const seg = el("div", "seg " + cls);
      seg.style.flex = n + " 0 0"; // CSSOM, which the CSP allows (style attributes it does not)
      seg.title = n + " blocks " + cls;
      bar.append(seg);
    }
    const pins = el("div", "pintrack");
    const pin = el("div", "pinbar");
    pin.style.width = (100 * (p.num_blocks ? p.pinned_blocks / p.num_blocks : 0)) + "%";
    pins.append(pin);
    const used = p.num_blocks - p.free_blocks;
    // Memory only where the worker reported what a block holds (older workers: 0).
    const memory = p.bytes_per_block ? bytes(used * p.bytes_per_block) + " / " +
      bytes(p.num_blocks * p.bytes_per_block) + " · " : "";
    // The worker's tiers beside its pool (docs/kv-tiers.md): blocks held, of how many.
    const tiers = (p.tiers || []).filter((t) => t.medium !== "device").map((t) =>
      " · " + t.medium + " tier " + num(t.blocks) + " / " + num(t.capacity_blocks) +
      " (" + num(t.loaded_blocks) + " loaded)").join("");
    const caption = el("div", "caption", used + " / " + p.num_blocks + " used (" +
      pct(ratio(used, p.num_blocks)) + ") · " + num(used * p.block_size) + " / " +
      num(p.num_blocks * p.block_size) + " tok · " + memory + p.block_size + " tok/block" +
      tiers);
    td.append(bar, pins, caption);
    return td;
  }

  function renderPools(pools) {
    const body = $("pools").querySelector("tbody");
    const now = performance.now() / 1000;
    const rows = pools.map((p) => {
      const tr = el("tr");
      tr.dataset.pool = p.pool_id;
      if (p.pool_id === state.selected) tr.classList.add("selected");
      tr.addEventListener("click", () => select(p.pool_id));
      const name = el("td", "pool left");
      name.dataset.k = "pool";
      const dot = el("span", p.alive ? "dot" : "dot down");
      dot.title = p.alive ? "heartbeating" : "no heartbeat: its leases expire";
      const addr = p.worker_address || (p.worker && p.worker.address) || "";
      name.append(dot, el("span", "id", p.pool_id), el("span", "addr", addr));
      if (p.worker && !p.worker.healthy) name.title = "unreachable: " + p.worker.reason;
      const w = windowSums(WINDOW_S, now, p.pool_id);
      const runWait = p.worker && p.worker.running !== null
        ? p.worker.running + " / " + p.worker.waiting : "–";
      const cell = (k, v) => {
        const td = el("td", null, v);
        td.dataset.k = k;
        return td;
      };
      tr.append(
        name,
        occupancy(p),
        cell("referenced", num(p.referenced_blocks)),
        cell("cached", num(p.cached_blocks)),
        cell("free", num(p.free_blocks)),
        cell("pinned", num(p.pinned_blocks)),
        cell("peak", num(p.peak_used_blocks)),
        cell("leases", num(p.live_leases)),
        cell("run-wait", runWait),
        cell("hit-1m", w.prompt ? pct(w.cached / w.prompt) : "–"),
        cell("hit-tok", pct(p.token_hit_rate)),
        cell("hit-req", pct(p.request_hit_rate)),
        cell("acquires", num(p.acquires)),
        cell("evicted", num(p.evicted_blocks)),
        cell("expired", num(p.expired_leases)),
        cell("deferred", num(p.deferrals)),
        cell("exhausted", num(p.exhausted)),
      );
      if (!p.alive) tr.classList.add("dead");
      return tr;
    });
    body.replaceChildren(...rows);
    $("no-pools").hidden = pools.length > 0;
  }

  // -- charts ------------------------------------------------------------------------------

  function canvas(id) {
    const c = $(id);
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px " + css("--mono");
    return { g, w, h };
  }

  // One chart: stacked `bars` (per sample, over its interval) scaled to their own maximum, and
  // `lines` (per sample) scaled to `lineMax` (or theirs). x: the seconds shown, now at the right.
  function chart(id, { bars = [], lines = [], barUnit = "", lineMax = null, lineFmt = num }) {
    const { g, w, h } = canvas(id);
    const hist = state.history.filter((s) => s.dt !== null);
    const now = performance.now() / 1000;
    const first = hist.length ? hist[0].t - hist[0].dt : now;
    const span = Math.min(HISTORY_S, Math.max(60, now - first));
    const top = 14;
    const bottom = h - 14;
    const x = (t) => w - ((now - t) / span) * w;
    const y = (v, max) => bottom - (max > 0 ? (v / max) * (bottom - top) : 0);

    g.strokeStyle = css("--line");
    g.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const yy = Math.round(bottom - f * (bottom - top)) + 0.5;
      g.beginPath();
      g.moveTo(0, yy);
      g.lineTo(w, yy);
      g.stroke();
    }
    g.fillStyle = css("--muted");
    g.textBaseline = "bottom";
    g.textAlign = "left";
    g.fillText("−" + ago(span), 2, h);
    g.textAlign = "right";
    g.fillText("now", w - 2, h);

    if (bars.length) {
      const total = (s) => bars.reduce((a, b) => a + (b.value(s) || 0), 0);
      const max = Math.max(0, ...hist.map(total));
      for (const s of hist) {
        let base = 0;
        const x0 = x(s.t - s.dt);
        const bw = Math.max(1, x(s.t) - x0 - 1);
        for (const b of bars) {
          const v = b.value(s) || 0;
          g.fillStyle = b.color;
          g.fillRect(x0, y(base + v, max), bw, y(base, max) - y(base + v, max));
          base += v;
        }
      }
      g.fillStyle = css("--muted");
      g.textAlign = "left";
      g.textBaseline = "top";
      g.fillText(num(max) + " " + barUnit, 2, 0);
    }
    if (lines.length) {
      const max = lineMax !== null ? lineMax
        : Math.max(1, ...lines.flatMap((l) => hist.map((s) => l.value(s) || 0)));
      for (const l of lines) {
        g.strokeStyle = l.color;
        g.lineWidth = 2;
        g.beginPath();
        let pen = false;
        for (const s of hist) {
          const v = l.value(s);
          if (v === null || v === undefined) {
            pen = false;
            continue;
          }
          if (pen) g.lineTo(x(s.t), y(v, max));
          else g.moveTo(x(s.t), y(v, max));
          pen = true;
        }
        g.stroke();
      }
      g.fillStyle = css("--muted");
      g.textAlign = "right";
      g.textBaseline = "top";
      g.fillText(lineFmt(max), w - 2, 0);
    }
  }

  function renderCharts() {
    const smoothed = (k, of) => (s) => {
      const win = windowSums(SMOOTH_S, s.t);
      return ratio(win[k], win[of]);
    };
    chart("c-hit", {
      lines: [
        { value: smoothed("cached", "prompt"), color: css("--cached") },
        { value: smoothed("hits", "acquires"), color: css("--leases") },
      ],
      lineMax: 1,
      lineFmt: pct,
    });
    const w = windowSums(WINDOW_S, performance.now() / 1000);
    $("c-hit-sub").textContent = "tokens (green) and requests (blue), " + SMOOTH_S +
      " s window · last min " + pct(ratio(w.cached, w.prompt));
    chart("c-tokens", {
      bars: [
        { value: (s) => s.cached / s.dt, color: css("--cached") },
        { value: (s) => (s.prompt - s.cached) / s.dt, color: css("--computed") },
      ],
      barUnit: "tok/s",
    });
    chart("c-leases", {
      bars: [{ value: (s) => s.evicted / s.dt, color: css("--evicted") }],
      barUnit: "blk/s",
      lines: [{ value: (s) => s.leases, color: css("--leases") }],
      lineFmt: (v) => num(v) + " leases",
    });
  }

  // -- radix tree --------------------------------------------------------------------------

  function renderPoolChoice(pools) {
    const ids = pools.map((p) => p.pool_id);
    // The first pool at the start, and another when the one shown is gone (not re-registered
    // under its id: a worker removed, or its shard away).
    if (ids.length && !ids.includes(state.selected)) select(ids[0]);
    const box = $("tree-pool");
    const have = Array.from(box.options, (o) => o.value);
    if (have.join("\n") !== ids.join("\n")) {
      box.replaceChildren(...ids.map((id) => {
        const o = el("option", null, id);
        o.value = id;
        return o;
      }));
    }
    box.value = state.selected || "";
  }

  function select(pool) {
    if (pool === state.selected) return;
    state.selected = pool;
    state.open.clear();
    state.closed.clear();
    state.all.clear();
    $("tree").replaceChildren(el("p", "muted", "loading…"));
    for (const tr of $("pools").querySelectorAll("tbody tr")) {
      tr.classList.toggle("selected", tr.dataset.pool === pool);
    }
    $("tree-pool").value = pool;
    if (state.running && !state.paused) refreshTree().catch(failed);
  }

  async function refreshTree() {
    const pool = state.selected;
    const seq = ++state.treeSeq;
    state.lastTree = performance.now();
    const query = new URLSearchParams({ pool, max_nodes: String(TREE_NODES) });
    let data;
    try {
      data = await getJSON("/admin/dashboard/tree?" + query);
    } catch (e) {
      if (e.status === 404 || e.status === 400) {
        $("tree").replaceChildren(el("p", "muted", e.message));
        return;
      }
      throw e;
    }
    if (seq === state.treeSeq && pool === state.selected) renderTree(data);
  }

  function isOpen(n) {
    const key = n.namespace + "\u0000" + n.id;
    return state.open.has(key) || (n.depth <= OPEN_DEPTH && !state.closed.has(key));
  }

  function toggle(n) {
    const key = n.namespace + "\u0000" + n.id;
    if (isOpen(n)) {
      state.open.delete(key);
      state.closed.add(key);
    } else {
      state.closed.delete(key);
      state.open.add(key);
    }
  }

  function renderTree(data) {
    const key = (ns, id) => ns + "\u0000" + id;
    const children = new Map();
    for (const n of data.nodes) {
      const k = key(n.namespace, n.parent);
      if (!children.has(k)) children.set(k, []);
      children.get(k).push(n);
    }
    // Tokens in each node's subtree. The nodes come parents first, so backwards every node
    // is reached after all of its descendants.
    const weight = new Map(data.nodes.map((n) => [key(n.namespace, n.id), n.tokens]));
    for (let i = data.nodes.length - 1; i >= 0; i--) {
      const n = data.nodes[i];
      const up = key(n.namespace, n.parent);
      if (n.parent && weight.has(up)) {
        weight.set(up, weight.get(up) + weight.get(key(n.namespace, n.id)));
      }
    }
    const heavier = (a, b) =>
      weight.get(key(b.namespace, b.id)) - weight.get(key(a.namespace, a.id)) || a.id - b.id;
    for (const list of children.values()) list.sort(heavier);
    const tokens = data.nodes.reduce((a, n) => a + n.tokens, 0);
    $("tree-summary").textContent = data.nodes.length + " nodes" +
      (data.truncated ? " (of " + data.total_nodes + "+, truncated)" : "") + " · " +
      num(tokens) + " tokens indexed";

    const node = (n) => {
      const li = el("li", "node");
      li.dataset.node = String(n.id);
      const row = el("div", "row");
      const here = key(n.namespace, n.id);
      const kids = children.get(here) || [];
      const open = isOpen(n);
      const tog = el("span", "toggle", kids.length ? (open ? "▾" : "▸") : "·");
      if (kids.length) {
        tog.addEventListener("click", () => {
          toggle(n);
          renderTree(data);
        });
      }
      const shown = n.text === null ? n.ids.join(" ") : visible(n.text);
      const text = el("span", "text", shown + (n.preview_complete ? "" : "…"));
      text.title = (n.text === null ? "" : n.text + "\n\n") + "token ids: " + n.ids.join(" ");
      const hot = n.referenced > 0;
      row.append(
        tog,
        text,
        el("span", "meta", num(n.tokens) + " tok"),
        el("span", "meta", n.blocks + " blk"),
        el("span", hot ? "meta hot" : "meta",
          hot ? "ref " + n.referenced + "/" + n.blocks + " ×" + n.max_refcount : "unreferenced"),
        el("span", "meta", "used " + (n.idle_s === null ? "never" : ago(n.idle_s) + " ago")),
      );
      if (n.pinned) row.append(el("span", "meta pin", "pinned"));
      if (kids.length && !open) {
        const below = weight.get(here) - n.tokens;
        const branches = kids.length === 1 ? " branch, " : " branches, ";
        row.append(el("span", "meta", kids.length + branches + num(below) + " tok below"));
      }
      li.append(row);
      if (kids.length && open) li.append(list(kids, here));
      return li;
    };
    // The heaviest MAX_BRANCHES children, then a row that shows the rest: a system prompt
    // with hundreds of conversations under it stays one screen.
    const list = (nodes, parent) => {
      const ul = el("ul");
      const shown = state.all.has(parent) ? nodes : nodes.slice(0, MAX_BRANCHES);
      ul.append(...shown.map(node));
      if (shown.length < nodes.length) {
        const rest = nodes.slice(shown.length);
        const li = el("li", "more", "+ " + rest.length + " lighter branches, " +
          num(rest.reduce((a, n) => a + weight.get(key(n.namespace, n.id)), 0)) + " tok: show");
        li.addEventListener("click", () => {
          state.all.add(parent);
          renderTree(data);
        });
        ul.append(li);
      }
      return ul;
    };

    const namespaces = [...new Set(data.nodes.map((n) => n.namespace))].sort();
    const out = [];
    for (const ns of namespaces) {
      const label = ns === "" ? "namespace (none)" : "namespace “" + visible(ns) + "”";
      out.push(el("div", "ns", label), list(children.get(key(ns, 0)) || [], key(ns, 0)));
    }
    if (!out.length) out.push(el("p", "muted", "empty: nothing is indexed in this pool yet"));
    const box = $("tree");
    const scroll = box.scrollTop;
    box.replaceChildren(...out);
    box.scrollTop = scroll;
  }

  // -- wiring ------------------------------------------------------------------------------

  function updatedLabel() {
    const label = $("updated");
    if (!state.running || state.lastOk === null) return;
    const age = (performance.now() - state.lastOk) / 1000;
    const when = age < 1 ? "just now" : ago(age) + " ago";
    label.textContent = state.paused ? "paused" : "updated " + when;
    label.classList.toggle("stale", !state.paused && age > (3 * REFRESH_MS) / 1000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      // Pasted with its scheme ("Bearer xyz") or with spaces: the token itself.
      const given = $("token-input").value.trim().replace(/^bearer\s+/i, "");
      $("token-input").value = "";
      if (!given) return;
      sessionStorage.setItem(TOKEN_KEY, given);
      clearError();
      start();
    });
    $("forget").addEventListener("click", () => {
      clearError();
      askForToken();
    });
    $("pause").addEventListener("click", () => {
      state.paused = !state.paused;
      $("pause").textContent = state.paused ? "resume" : "pause";
      updatedLabel();
    });
    $("tree-pool").addEventListener("change", (ev) => select(ev.target.value));
    window.addEventListener("resize", () => state.history.length && renderCharts());
    setInterval(updatedLabel, 500);
    if (token()) start();
    else askForToken();
  });
})();
