// The live map of the KV cells: one square per cell on a <canvas>, coloured by owner.
// Payload: GET /v1/cache/cells (owner_runs = [value, run_length, ...]; -1 free, -2 shared,
// -3 held by the prefix index over cells, no seq id).
// The main canvas is the full-attention pool; each other pool of `pools` (a sliding-window
// model's "swa" pool, a recurrent or hybrid model's state slots) gets its own labelled canvas
// below it, drawn the same way. A model without attention layers has only its state slots.

const FREE = -1;
const SHARED = -2;
const HELD = -3;
const HELD_COLOR = "hsl(210, 15%, 80%)";
const MAX_CELL_PX = 14;
const GRID_GAP_MIN_PX = 5; // cells at least this big are drawn with a 1px gap

export function seqColor(seqId) {
  const hue = (seqId * 137.508 + 210) % 360;
  return `hsl(${hue.toFixed(1)}, 70%, 48%)`;
}

export function holderColor(seqId) {
  const hue = (seqId * 137.508 + 210) % 360;
  return `hsl(${hue.toFixed(1)}, 30%, 82%)`;
}

function sharedPattern(ctx) {
  const tile = document.createElement("canvas");
  tile.width = tile.height = 6;
  const t = tile.getContext("2d");
  t.fillStyle = "#fde68a";
  t.fillRect(0, 0, 6, 6);
  t.strokeStyle = "#b45309";
  t.lineWidth = 2;
  t.beginPath();
  t.moveTo(-1, 7);
  t.lineTo(7, -1);
  t.stroke();
  return ctx.createPattern(tile, "repeat");
}

// Largest square size (CSS px) that fits n cells in width x maxHeight.
export function layout(nCells, width, maxHeight) {
  let size = MAX_CELL_PX;
  while (size > 1) {
    const cols = Math.floor(width / size);
    if (Math.ceil(nCells / cols) * size <= maxHeight) break;
    size -= 1;
  }
  const cols = Math.max(1, Math.floor(width / size));
  return { size, cols, rows: Math.ceil(nCells / cols) };
}

function decodeRuns(runs) {
  const out = [];
  for (let i = 0; i < runs.length; i += 2) out.push({ value: runs[i], length: runs[i + 1] });
  return out;
}

function fillStyleFor(value, holders, pattern) {
  if (value === SHARED) return pattern;
  if (value === HELD) return HELD_COLOR;
  if (holders.has(value)) return holderColor(value);
  return seqColor(value);
}

// Fills cells [start, start + length) row by row.
function fillRun(ctx, grid, start, length) {
  let cell = start;
  const end = start + length;
  while (cell < end) {
    const col = cell % grid.cols;
    const row = Math.floor(cell / grid.cols);
    const count = Math.min(end - cell, grid.cols - col);
    ctx.fillRect(col * grid.size, row * grid.size, count * grid.size, grid.size);
    cell += count;
  }
}

function drawGridLines(ctx, grid, color) {
  if (grid.size < GRID_GAP_MIN_PX) return;
  ctx.fillStyle = color;
  for (let c = 1; c <= grid.cols; c++) ctx.fillRect(c * grid.size - 1, 0, 1, grid.rows * grid.size);
  for (let r = 1; r <= grid.rows; r++) ctx.fillRect(0, r * grid.size - 1, grid.cols * grid.size, 1);
}

// A red outline on the head cell; at least 7px wide so it stays visible on tiny cells.
function drawHead(ctx, grid, head) {
  const col = head % grid.cols;
  const row = Math.floor(head / grid.cols);
  const box = Math.max(grid.size, 7);
  const lw = Math.max(1.5, box / 5);
  const x = col * grid.size + (grid.size - box) / 2;
  const y = row * grid.size + (grid.size - box) / 2;
  ctx.strokeStyle = "#dc2626";
  ctx.lineWidth = lw;
  ctx.strokeRect(x + lw / 2, y + lw / 2, box - lw, box - lw);
}

// One pool's grid on `canvas`: render({n_cells, head, owner_runs}, holders, slots).
function createGrid(canvas, tip, maxHeight) {
  const ctx = canvas.getContext("2d");
  const pattern = sharedPattern(ctx);
  let grid = null;
  let runs = [];
  let last = null;

  function resize(nCells) {
    const width = canvas.parentElement.clientWidth;
    const next = layout(nCells, width, maxHeight());
    const dpr = window.devicePixelRatio || 1;
    canvas.style.width = `${next.cols * next.size}px`;
    canvas.style.height = `${next.rows * next.size}px`;
    canvas.width = Math.round(next.cols * next.size * dpr);
    canvas.height = Math.round(next.rows * next.size * dpr);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    Object.assign(canvas.dataset, { cellSize: next.size, cols: next.cols, rows: next.rows });
    return next;
  }

  function draw() {
    const { pool, holders } = last;
    grid = resize(pool.n_cells);
    runs = decodeRuns(pool.owner_runs);
    ctx.fillStyle = "#eef1f5";
    ctx.fillRect(0, 0, grid.cols * grid.size, grid.rows * grid.size);
    const drawn = new Set();
    let start = 0;
    for (const run of runs) {
      if (run.value !== FREE) {
        ctx.fillStyle = fillStyleFor(run.value, holders, pattern);
        fillRun(ctx, grid, start, run.length);
        drawn.add(run.value);
      }
      start += run.length;
    }
    drawGridLines(ctx, grid, "#ffffff");
    drawHead(ctx, grid, pool.head);
    canvas.dataset.drawnSeqs = [...drawn].sort((a, b) => a - b).join(",");
  }

  function ownerAt(cell) {
    let start = 0;
    for (const run of runs) {
      if (cell < start + run.length) return run.value;
      start += run.length;
    }
    return FREE;
  }

  function describeCell(cell) {
    const owner = ownerAt(cell);
    const unit = last.pool.kind === "slots" ? "slot" : "cell";
    const where = last.pool.name ? `${last.pool.name} ${unit} ${cell}` : `${unit} ${cell}`;
    if (owner === FREE) return `${where}: free`;
    if (owner === SHARED) return `${where}: shared by 2+ sequences`;
    if (owner === HELD) return `${where}: prefix cache (index)`;
    const slot = last.slots.find((s) => s.seq_id === owner);
    if (slot) return `${where}: seq ${owner} (${slot.req_id})`;
    if (last.holders.has(owner)) return `${where}: prefix cache (seq ${owner})`;
    return `${where}: seq ${owner}`;
  }

  function showTip(event) {
    if (!grid || !last) return;
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / grid.size);
    const row = Math.floor((event.clientY - rect.top) / grid.size);
    const cell = row * grid.cols + col;
    if (col >= grid.cols || cell >= last.pool.n_cells) {
      tip.hidden = true;
      return;
    }
    tip.textContent = describeCell(cell);
    tip.style.left = `${event.clientX - rect.left + 12}px`;
    tip.style.top = `${event.clientY - rect.top + 12}px`;
    tip.hidden = false;
  }

  canvas.addEventListener("mousemove", showTip);
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });

  return {
    render(pool, holders, slots) {
      last = { pool, holders, slots };
      draw();
    },
    redraw() { if (last) draw(); },
  };
}

function formatBytes(n) {
  if (n >= 2 ** 30) return `${(n / 2 ** 30).toFixed(2)} GiB`;
  if (n >= 2 ** 20) return `${(n / 2 ** 20).toFixed(1)} MiB`;
  if (n >= 2 ** 10) return `${(n / 2 ** 10).toFixed(1)} KiB`;
  return `${n} B`;
}

// A pool of kind "slots" holds recurrent states (one per sequence, plus prefix-cache
// checkpoints), not K/V per token.
function poolLabel(pool) {
  if (pool.kind === "slots") {
    const bytes = pool.bytes_per_cell
      ? ` · states ${formatBytes(pool.bytes_used)} (${formatBytes(pool.bytes_per_cell)} each)`
      : "";
    return `${pool.name} state slots · ${pool.used} / ${pool.n_cells} slots used${bytes}`;
  }
  const window = pool.window ? ` · window ${pool.window}` : "";
  const bytes = pool.bytes_per_cell
    ? ` · ${formatBytes(pool.bytes_used)} (${formatBytes(pool.bytes_per_cell)} a cell)`
    : "";
  return `${pool.name} pool${window} · ${pool.used} / ${pool.n_cells} cells used${bytes}`;
}

// A labelled canvas (and its tooltip) for one more pool, after `after`.
function addPoolView(after, name) {
  const wrap = document.createElement("div");
  wrap.className = "canvas-wrap pool-wrap";
  wrap.dataset.pool = name;
  const label = document.createElement("div");
  label.className = "pool-label muted";
  label.style.margin = "8px 0 2px";
  const canvas = document.createElement("canvas");
  canvas.setAttribute("aria-label", `one square per cell of the ${name} pool`);
  const tip = document.createElement("div");
  tip.className = "cell-tip";
  tip.hidden = true;
  wrap.append(label, canvas, tip);
  after.after(wrap);
  return { wrap, label, grid: createGrid(canvas, tip, () => 160) };
}

export function createCellMap(els) {
  const mainHeight = () => Math.max(200, Math.min(520, window.innerHeight * 0.5));
  const main = createGrid(els.canvas, els.tip, mainHeight);
  const mainLabel = document.createElement("div");
  mainLabel.className = "pool-label muted";
  mainLabel.style.margin = "2px 0";
  mainLabel.hidden = true;
  els.canvas.parentElement.before(mainLabel);
  let extra = [];

  function renderPools(snapshot, holders) {
    const pools = snapshot.pools || [];
    const others = pools.slice(1);
    if (extra.length !== others.length || extra.some((v, i) => v.wrap.dataset.pool !== others[i].name)) {
      extra.forEach((v) => v.wrap.remove());
      extra = [];
      let after = els.canvas.parentElement;
      for (const pool of others) {
        const view = addPoolView(after, pool.name);
        extra.push(view);
        after = view.wrap;
      }
    }
    mainLabel.hidden = others.length === 0 && pools[0]?.kind !== "slots";
    if (pools.length) mainLabel.textContent = poolLabel(pools[0]);
    others.forEach((pool, i) => {
      extra[i].label.textContent = poolLabel(pool);
      extra[i].grid.render(pool, holders, snapshot.slots);
    });
  }

  let last = null;
  window.addEventListener("resize", () => {
    if (!last) return;
    main.redraw();
    extra.forEach((v) => v.grid.redraw());
  });

  return {
    render(snapshot) {
      last = snapshot;
      const holders = new Set(snapshot.holder_seq_ids);
      main.render({ name: "", ...snapshot }, holders, snapshot.slots);
      renderPools(snapshot, holders);
    },
  };
}
