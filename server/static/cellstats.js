// Beside the cell map: counters, the legend, and one table row per live sequence.

import { holderColor, seqColor } from "./cellmap.js";

function fmt(n) {
  return Number(n).toLocaleString("en-US");
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function percent(part, whole) {
  return whole ? `${((100 * part) / whole).toFixed(1)}%` : "0%";
}

function renderCounters(els, s) {
  const t = s.totals;
  els.used.textContent = `${fmt(t.used)} (${percent(t.used, s.n_cells)})`;
  els.shared.textContent = fmt(t.shared);
  els.cached.textContent = fmt(t.cached);
  els.free.textContent = fmt(t.free);
  const p = s.prefix_cache;
  els.prefixHits.textContent =
    `${fmt(p.hit_tokens)} / ${fmt(p.queried_tokens)} (${percent(p.hit_tokens, p.queried_tokens)})`;
  els.contextShifts.textContent = fmt(s.num_context_shifts);
  els.preemptions.textContent = fmt(s.num_preemptions);
  // speculative decoding, when the server runs it: drafted tokens accepted, and tokens per
  // verification round (accepted drafts + the model's own)
  const sd = s.speculative;
  els.specBox.hidden = !sd;
  if (sd) {
    const perRound = sd.num_drafts ? (sd.num_emitted_tokens / sd.num_drafts).toFixed(2) : "–";
    els.specAccepted.textContent =
      `${fmt(sd.num_accepted_tokens)} / ${fmt(sd.num_draft_tokens)} ` +
      `(${percent(sd.num_accepted_tokens, sd.num_draft_tokens)}) · ${perRound} tokens/round`;
  }
  renderExperts(els, s.experts);
  els.mapSize.textContent =
    `${fmt(s.n_cells)} cells · head ${fmt(s.head)} · ${s.num_running} running · ` +
    `${s.num_waiting} waiting`;
}

// A mixture-of-experts model's expert load (cumulative rows per layer and expert): one bar per
// expert over all MoE layers, and the most uneven layer's busiest expert against an even share
// (1.00x: the router spread that layer's rows evenly; top-k counts each row k times)
function expertSummary(rows) {
  const nExperts = Math.max(0, ...rows.map((r) => r.length));
  const perExpert = new Array(nExperts).fill(0);
  let routed = 0;
  let worst = { ratio: 0, layer: -1, expert: -1 };
  rows.forEach((counts, layer) => {
    const total = counts.reduce((a, b) => a + b, 0);
    counts.forEach((n, e) => {
      perExpert[e] += n;
    });
    routed += total;
    if (!total) return;
    const busiest = counts.indexOf(Math.max(...counts));
    const ratio = (counts[busiest] * counts.length) / total;
    if (ratio > worst.ratio) worst = { ratio, layer, expert: busiest };
  });
  const idle = perExpert.filter((n) => n === 0).length;
  return { nExperts, nLayers: rows.length, routed, perExpert, worst, idle };
}

function renderExperts(els, experts) {
  els.expertBox.hidden = !experts;
  if (!experts) return;
  const sum = expertSummary(experts.rows);
  let text = `${plural(sum.nExperts, "expert")} × ${plural(sum.nLayers, "layer")} · ${fmt(sum.routed)} rows routed`;
  if (sum.worst.layer >= 0) {
    text +=
      ` · busiest: expert ${sum.worst.expert} of layer ${sum.worst.layer} ` +
      `at ${sum.worst.ratio.toFixed(2)}x an even share`;
  }
  if (sum.routed && sum.idle) text += ` · ${sum.idle} never chosen`;
  els.expertLoad.textContent = text;
  const top = Math.max(1, ...sum.perExpert);
  const bars = sum.perExpert.map((n, e) => {
    const bar = document.createElement("span");
    bar.style.height = `${Math.max(2, Math.round((100 * n) / top))}%`;
    bar.title = `expert ${e}: ${fmt(n)} rows (${percent(n, sum.routed)})`;
    return bar;
  });
  els.expertBars.replaceChildren(...bars);
}

function legendItem(swatchClass, color, text) {
  const li = document.createElement("li");
  const swatch = document.createElement("span");
  swatch.className = `swatch ${swatchClass}`;
  if (color) swatch.style.background = color;
  li.append(swatch, document.createTextNode(text));
  return li;
}

function shortId(reqId) {
  return reqId.length > 14 ? `${reqId.slice(0, 8)}…${reqId.slice(-4)}` : reqId;
}

function renderLegend(list, s) {
  const items = s.slots
    .filter((slot) => slot.seq_id >= 0)
    .map((slot) => legendItem("seq", seqColor(slot.seq_id), `seq ${slot.seq_id} · ${shortId(slot.req_id)}`));
  const holderColorSample = s.holder_seq_ids.length ? holderColor(s.holder_seq_ids[0]) : holderColor(0);
  items.push(
    legendItem("shared", null, "shared (2+ owners)"),
    legendItem("holder", holderColorSample, `prefix cache (${plural(s.holder_seq_ids.length, "holder")})`),
    legendItem("free", null, "free"),
    legendItem("head", null, "write head"),
  );
  list.replaceChildren(...items);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function slotRow(slot) {
  const tr = document.createElement("tr");
  tr.dataset.seqId = slot.seq_id;
  tr.dataset.reqId = slot.req_id;
  const seq = cell(slot.seq_id >= 0 ? String(slot.seq_id) : "–");
  if (slot.seq_id >= 0) seq.style.borderLeft = `6px solid ${seqColor(slot.seq_id)}`;
  const pos = slot.pos_max >= 0 ? `${slot.pos_min}–${slot.pos_max}` : "–";
  tr.append(
    seq,
    cell(shortId(slot.req_id), "req"),
    cell(slot.state, `state ${slot.state}`),
    cell(fmt(slot.num_prompt)),
    cell(fmt(slot.num_computed)),
    cell(fmt(slot.num_generated)),
    cell(fmt(slot.cells_owned)),
    cell(fmt(slot.cells_shared)),
    cell(pos),
  );
  tr.title = slot.req_id;
  return tr;
}

function renderTable(tbody, s) {
  if (!s.slots.length) {
    const tr = document.createElement("tr");
    const td = cell("no live sequences", "empty");
    td.colSpan = 9;
    tr.append(td);
    tbody.replaceChildren(tr);
    return;
  }
  tbody.replaceChildren(...s.slots.map(slotRow));
}

export function createCellStats(els) {
  return {
    render(snapshot) {
      renderCounters(els, snapshot);
      renderLegend(els.legend, snapshot);
      renderTable(els.tbody, snapshot);
    },
  };
}
