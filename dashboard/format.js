/* Number and text formatting shared by every panel. Pure functions, no DOM, no state. */

export const GIB = 1073741824;
export const MIB = 1048576;

export function isNum(v) { return typeof v === "number" && isFinite(v); }

export function gib(bytes, digits) {
  if (!isNum(bytes)) return "—";
  const g = bytes / GIB;
  if (digits === undefined) digits = Math.abs(g) >= 10 ? 1 : 2;
  return g.toFixed(digits) + " GiB";
}

/* The byte rules of vramwatch/units.py, mirrored: the same numbers read the same in the CLI,
 * the API's text and the page (tests/dashboard compare them on the same values). */
export function mib(bytes) {
  if (!isNum(bytes)) return "—";
  const m = bytes / MIB;
  return Math.abs(m) < 100 ? m.toFixed(2) + " MiB"
    : Math.round(m).toLocaleString("en-US") + " MiB";
}

/** A growth per step (a leak's slope): "60.00 MiB/step" (units.rate). */
export function rate(bytesPerStep) {
  return isNum(bytesPerStep) ? mib(bytesPerStep) + "/step" : "—";
}

/** Whole MiB as nvidia-smi prints them: "143,771 MiB" (units.smi_mib). */
export function smiMib(bytes) {
  return isNum(bytes) ? Math.round(bytes / MIB).toLocaleString("en-US") + " MiB" : "—";
}

/** A card's capacity: "140.4 GiB (143,771 MiB)" (units.capacity). */
export function capacity(bytes) {
  return isNum(bytes) ? gib(bytes) + " (" + smiMib(bytes) + ")" : "—";
}

/** Steps to OOM with the wall time beside them: "1,234 steps (2 h 18 min)" (units.runway). */
export function runway(steps, seconds) {
  if (!isNum(steps)) return "—";
  return Math.round(steps).toLocaleString("en-US") + " steps" + (isNum(seconds) ? " (" + duration(seconds) + ")" : "");
}

export function slopeText(bytesPerStep) {
  if (!isNum(bytesPerStep)) return "—";
  return (bytesPerStep > 0 ? "+" : "") + rate(bytesPerStep);
}

/** A runway or an age: "45 s", "12 min", "7 h 9 min", "3.2 days"; half up, minutes carried (units.duration). */
export function duration(seconds) {
  if (!isNum(seconds)) return "—";
  if (seconds < 0) seconds = 0;
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 90 * 60) return Math.round(seconds / 60) + " min";
  if (seconds < 48 * 3600) {
    const m = Math.round(seconds / 60);
    return Math.floor(m / 60) + " h " + (m % 60) + " min";
  }
  return (seconds / 86400).toFixed(1) + " days";
}

export function age(ts) {
  if (!isNum(ts)) return "—";
  const s = Date.now() / 1000 - ts;
  if (s < 1.5) return "just now";
  return duration(s) + " ago";
}

function pad2(n) { return String(n).padStart(2, "0"); }

/** The viewer's offset from UTC at that moment, "UTC+02:00". */
export function utcOffset(d) {
  const minutes = -d.getTimezoneOffset();
  const a = Math.abs(minutes);
  return "UTC" + (minutes >= 0 ? "+" : "-") + pad2(Math.floor(a / 60)) + ":" + pad2(a % 60);
}

/** An epoch timestamp in the viewer's time zone, with its date and zone stated:
 * "2025-10-09 14:03:12 UTC+02:00" (a report is read days later, elsewhere). */
export function clock(ts) {
  if (!isNum(ts)) return "—";
  const d = new Date(ts * 1000);
  return d.getFullYear() + "-" + pad2(d.getMonth() + 1) + "-" + pad2(d.getDate()) + " " +
    pad2(d.getHours()) + ":" + pad2(d.getMinutes()) + ":" + pad2(d.getSeconds()) + " " + utcOffset(d);
}

/** The viewer's time zone, as the page states it: "Europe/Berlin, UTC+02:00". */
export function timeZoneLabel() {
  let zone = "";
  try { zone = Intl.DateTimeFormat().resolvedOptions().timeZone || ""; } catch (e) { /* no Intl */ }
  return (zone ? zone + ", " : "") + utcOffset(new Date());
}

/** Epoch seconds as a wall-time chart x: plotly draws epoch milliseconds as UTC, so the
 * viewer's offset (at that moment: DST moves it) is added to show their own clock. */
export function chartMs(ts) {
  const ms = ts * 1000;
  return ms - new Date(ms).getTimezoneOffset() * 60000;
}

/** The inverse of chartMs: a wall-time chart x back to epoch seconds. */
export function chartTs(ms) {
  const guess = ms + new Date(ms).getTimezoneOffset() * 60000;
  return (ms + new Date(guess).getTimezoneOffset() * 60000) / 1000;
}

export function intText(n) { return isNum(n) ? Math.round(n).toLocaleString("en-US") : "—"; }

export function toGiB(arr) {
  const out = new Array(arr.length);
  for (let i = 0; i < arr.length; i++) out[i] = isNum(arr[i]) ? arr[i] / GIB : null;
  return out;
}

export function rankKey(host, rank) { return host + "\u0000" + rank; }
export function rankLabel(r) { return "rank " + r.rank + " · " + r.host; }

/** "#rrggbb" -> "rgba(r,g,b,a)" for translucent fills (other colour forms pass through). */
export function alpha(color, a) {
  const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(color);
  return m ? "rgba(" + parseInt(m[1], 16) + "," + parseInt(m[2], 16) + "," + parseInt(m[3], 16) + "," + a + ")" : color;
}

/** Entity-escape a data string for plotly labels (plotly renders a small HTML subset). */
export function plotlyText(value) {
  // No tag can form without "<"; plotly shows quotes literally (and "&quot;" too), so only these three.
  return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

export function plural(n, word) { return intText(n) + " " + word + (n === 1 ? "" : "s"); }
