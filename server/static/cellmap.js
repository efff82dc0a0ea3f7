// The live map of the KV cells: one square per cell on a <canvas>, coloured by owner.
// Payload: GET /v1/cache/cells (owner_runs = [value, run_length, ...]; -1 free, -2 shared).

const FREE = -1;
const SHARED = -2;
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

export function createCellMap(els) {
  const ctx = els.canvas.getContext("2d");
  const pattern = sharedPattern(ctx);
  let grid = null;
  let runs = [];
  let last = null;

  function resize(nCells) {
    const width = els.canvas.parentElement.clientWidth;
    const next = layout(nCells, width, Math.max(200, Math.min(520, window.innerHeight * 0.5)));
    const dpr = window.devicePixelRatio || 1;
    els.canvas.style.width = `${next.cols * next.size}px`;
    els.canvas.style.height = `${next.rows * next.size}px`;
    els.canvas.width = Math.round(next.cols * next.size * dpr);
    els.canvas.height = Math.round(next.rows * next.size * dpr);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    Object.assign(els.canvas.dataset, { cellSize: next.size, cols: next.cols, rows: next.rows });
    return next;
  }

  function draw(snapshot) {
    grid = resize(snapshot.n_cells);
    runs = decodeRuns(snapshot.owner_runs);
    const holders = new Set(snapshot.holder_seq_ids);
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
    drawHead(ctx, grid, snapshot.head);
    els.canvas.dataset.drawnSeqs = [...drawn].sort((a, b) => a - b).join(",");
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
    if (owner === FREE) return `cell ${cell}: free`;
    if (owner === SHARED) return `cell ${cell}: shared by 2+ sequences`;
    const slot = last.slots.find((s) => s.seq_id === owner);
    if (slot) return `cell ${cell}: seq ${owner} (${slot.req_id})`;
    if (last.holder_seq_ids.includes(owner)) return `cell ${cell}: prefix cache (seq ${owner})`;
    return `cell ${cell}: seq ${owner}`;
  }

  function showTip(event) {
    if (!grid || !last) return;
    const rect = els.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / grid.size);
    const row = Math.floor((event.clientY - rect.top) / grid.size);
    const cell = row * grid.cols + col;
    if (col >= grid.cols || cell >= last.n_cells) {
      els.tip.hidden = true;
      return;
    }
    els.tip.textContent = describeCell(cell);
    els.tip.style.left = `${event.clientX - rect.left + 12}px`;
    els.tip.style.top = `${event.clientY - rect.top + 12}px`;
    els.tip.hidden = false;
  }

  els.canvas.addEventListener("mousemove", showTip);
  els.canvas.addEventListener("mouseleave", () => { els.tip.hidden = true; });
  window.addEventListener("resize", () => { if (last) draw(last); });

  return {
    render(snapshot) {
      last = snapshot;
      draw(snapshot);
    },
  };
}
