// Markdown -> DOM nodes, for model replies. Safe by construction: every piece of the model's
// text enters the page through createTextNode / textContent, never as HTML, so a reply holding
// <script> or <img onerror=...> shows those characters and runs nothing. Links keep only
// http(s) and mailto targets.
//
// Blocks: fenced code (``` or ~~~, unterminated while streaming), ATX headings, rules,
// blockquotes, flat bullet and numbered lists, paragraphs (single newlines are line breaks).
// Inline: `code`, **bold** / __bold__, *italic* / _italic_, ~~strike~~, [text](url).

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const BULLET = /^ {0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^ {0,3}(\d{1,9})[.)]\s+(.*)$/;
const SAFE_URL = /^(https?:|mailto:)/i;
const INLINE = new RegExp(
  [
    "(`+)([^`][\\s\\S]*?)\\1(?!`)", // 1, 2: code span
    "\\[([^\\]\\n]+)\\]\\(([^)\\s]+)\\)", // 3, 4: link
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 5: bold
    "(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])", // 6: bold
    "~~(?=\\S)([\\s\\S]*?\\S)~~", // 7: strike
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 8: italic
    "(?<![\\w])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?![\\w])", // 9: italic
  ].join("|"),
  "g",
);

function el(tag, className, children = []) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

function inline(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(...lineBreaks(text.slice(last, m.index)));
    if (m[1] !== undefined) out.push(el("code", "", [document.createTextNode(m[2])]));
    else if (m[3] !== undefined) out.push(link(m[3], m[4]));
    else if (m[5] !== undefined || m[6] !== undefined) out.push(el("strong", "", inline(m[5] ?? m[6])));
    else if (m[7] !== undefined) out.push(el("del", "", inline(m[7])));
    else out.push(el("em", "", inline(m[8] ?? m[9])));
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(...lineBreaks(text.slice(last)));
  return out;
}

function lineBreaks(text) {
  const out = [];
  text.split("\n").forEach((line, i) => {
    if (i) out.push(document.createElement("br"));
    if (line) out.push(document.createTextNode(line));
  });
  return out;
}

function link(label, url) {
  if (!SAFE_URL.test(url)) return document.createTextNode(`[${label}](${url})`);
  const a = el("a", "", inline(label));
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return a;
}

function codeBlock(lang, lines) {
  const code = el("code", lang ? `language-${lang}` : "", [document.createTextNode(lines.join("\n"))]);
  const block = el("div", "code-block");
  if (lang) block.append(el("div", "code-lang", [document.createTextNode(lang)]));
  block.append(el("pre", "", [code]));
  return block;
}

function list(lines, i, pattern, ordered) {
  const items = [];
  let start = 1;
  while (i < lines.length) {
    const m = lines[i].match(pattern);
    if (m) {
      if (!items.length && ordered) start = Number(m[1]);
      items.push([ordered ? m[2] : m[1]]);
    } else if (items.length && /^\s{2,}\S/.test(lines[i])) {
      items[items.length - 1].push(lines[i].trim()); // a continuation line of the item
    } else {
      break;
    }
    i += 1;
  }
  const node = el(ordered ? "ol" : "ul", "", items.map((item) => el("li", "", inline(item.join("\n")))));
  if (ordered && start !== 1) node.start = start;
  return [node, i];
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence (absent while the reply is still streaming)
      out.push(codeBlock(fence[2], body));
    } else if (!line.trim()) {
      i += 1;
    } else if (HEADING.test(line)) {
      const [, marks, text] = line.match(HEADING);
      out.push(el(`h${marks.length}`, "", inline(text)));
      i += 1;
    } else if (RULE.test(line)) {
      out.push(document.createElement("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].match(QUOTE)[1]);
      out.push(el("blockquote", "", blocks(inner)));
    } else if (BULLET.test(line)) {
      const [node, next] = list(lines, i, BULLET, false);
      out.push(node);
      i = next;
    } else if (NUMBERED.test(line)) {
      const [node, next] = list(lines, i, NUMBERED, true);
      out.push(node);
      i = next;
    } else {
      const para = [];
      const starts = [FENCE, HEADING, RULE, QUOTE, BULLET, NUMBERED];
      while (i < lines.length && lines[i].trim() && !(para.length && starts.some((p) => p.test(lines[i])))) {
        para.push(lines[i++]);
      }
      out.push(el("p", "", inline(para.join("\n"))));
    }
  }
  return out;
}

export function renderMarkdown(container, text) {
  container.replaceChildren(...blocks(text.replace(/\r\n?/g, "\n").split("\n")));
}
