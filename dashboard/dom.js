/* DOM helpers. Data strings reach the DOM only through textContent and attribute setters
 * (el's "text" and attributes), never as HTML. */

export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  if (attrs) {
    for (const key of Object.keys(attrs)) {
      const value = attrs[key];
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "class") node.className = value;
      else if (key === "on") {
        for (const ev of Object.keys(value)) node.addEventListener(ev, value[ev]);
      } else if (key === "dataset") {
        for (const d of Object.keys(value)) node.dataset[d] = String(value[d]);
      } else node.setAttribute(key, value === true ? "" : String(value));
    }
  }
  for (const child of children) append(node, child);
  return node;
}

export function append(node, ...children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(node, ...child);
    else if (typeof child === "string" || typeof child === "number") node.appendChild(document.createTextNode(String(child)));
    else node.appendChild(child);
  }
}

export function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
export function $(id) { return document.getElementById(id); }
export function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

/** Set text only when it changed: an unchanged cell costs no layout. */
export function setText(node, text) {
  const s = String(text);
  if (node.textContent !== s) node.textContent = s;
}

const marked = new Set();
/** A performance mark, once per page (the benchmark and the tests read them). */
export function markOnce(name) {
  if (marked.has(name)) return;
  marked.add(name);
  try { performance.mark(name); } catch (e) { /* old browsers */ }
}

/** "interactive": verdicts, cards and the rank chart are drawn and respond to input. */
export function markInteractive() {
  if (document.documentElement.dataset.ready === "1") return;
  document.documentElement.dataset.ready = "1";
  markOnce("vramwatch:interactive");
}

/** Run ``fn``; when the page was opened with ``window.__vwTiming`` set (the benchmark),
 * record its duration as a performance measure ``vramwatch:NAME`` to attribute main-thread
 * time. Off by default: entries would pile up over a day of polling. */
export function timed(name, fn) {
  if (!window.__vwTiming) return fn();
  const t0 = performance.now();
  try { return fn(); } finally {
    performance.measure("vramwatch:" + name, { start: t0, end: performance.now() });
  }
}

/** A promise resolved in a later task: work after it is not part of the current task, so
 * one poll's pieces (a grid, then its chart) are separate tasks, each well under 50 ms.
 * scheduler.yield() where the browser has it (the continuation keeps its priority). */
export function nextTask() {
  if (window.scheduler && typeof window.scheduler.yield === "function") return window.scheduler.yield();
  return new Promise((resolve) => setTimeout(resolve, 0));
}
