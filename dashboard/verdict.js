/* One rank's verdict as the page shows it: state, liveness, deaths (OOM / restart / crash),
 * severity order and the headroom figures. A rank's life (liveness, how its latest process died,
 * OOM and restart counts, severity) is the collector's model (vramwatch/runlife.py), read from
 * the /ranks row as it is: nothing here judges it again. The vocabulary (states, liveness, run
 * statuses and their meanings, figure scopes, the low-headroom threshold) comes from
 * GET /api/v1/meta (state.js `vocab`), never retyped. */

import { isNum } from "./format.js";
import { vocab } from "./state.js";

const PHASE_CAUSE = /ckpt|checkpoint|save|eval|val/i;

export function verdictOf(r) { return (r && r.verdict) || {}; }

/** When the collector last heard from a rank: its receive time, else the sample's own time. */
export function lastHeard(r) { return Math.max(isNum(r.last_seen) ? r.last_seen : 0, isNum(r.last_ts) ? r.last_ts : 0); }
export function stateOf(r) { return verdictOf(r).state || "unknown"; }

function lastEvent(r, type) {
  const evs = (r.events || []).filter((e) => e.type === type);
  return evs.length ? evs[evs.length - 1] : null;
}

/** A rank whose latest process still runs (live, or silent and not judged yet). */
export function isRunning(r) { return r.liveness === "live" || r.liveness === "silent"; }

/** How a death reads: "OOM", "killed alone", "stopped with the job", and the causes a process's
 * last words name (vramwatch/causes.py). */
export const DEATH_TEXT = { oom: "OOM", killed: "killed alone", stopped: "stopped with the job",
  cuda_error: "CUDA error", collective_timeout: "collective timeout", crash: "crash",
  checkpoint_failed: "checkpoint failed", exception: "exception" };
const KILLED_BY = { host_oom: "the host's OOM killer", launcher: "the launcher" };

/** What a dead process said, as one line: "torch.OutOfMemoryError: CUDA out of memory… (in checkpoint)". */
export function lastWordsText(words) {
  if (!words || !words.type) return "";
  return words.type + (words.message ? ": " + words.message : "") + (words.phase && words.phase !== "train" ? " (in " + words.phase + ")" : "");
}

function deathHow(d) {
  let how = DEATH_TEXT[d.cause] || d.cause;
  if (d.culprit) how += ", waiting for rank " + d.culprit.rank;
  if (d.cause === "killed" && KILLED_BY[d.killed_by]) how += ", by " + KILLED_BY[d.killed_by];
  return how;
}

/**
 * Everything the table, cards and charts say about a rank's life, kept on the row as ``r.vw``
 * once per poll: the collector's liveness, OOM and restart counts, its death (``died``:
 * cause, step, time), severity, and the state as displayed.
 */
export function annotate(rows) {
  for (const r of rows) r.vw = describe(r);
}

function describe(r) {
  const d = r.died;
  const death = d ? { cause: d.cause, how: deathHow(d), said: lastWordsText(d.last_words), step: d.step, ts: d.ts } : null;
  return { liveness: r.liveness, ooms: r.ooms || 0, restarts: r.restarts || 0, deaths: r.deaths || 0, death,
    suspectedOoms: r.suspected_ooms || 0,
    severity: isNum(r.severity) ? r.severity : -1, ...shownState(r, verdictOf(r)) };
}

/** What part of a rank's life a figure covers ("its current process" / "every process of the
 * rank"), from the meta's figure scopes: said in the column tips. */
export function scopeText(figure) {
  const scope = (vocab.figure_scopes || {})[figure];
  return scope && vocab.scopes ? vocab.scopes[scope] : "";
}

/** A checkpoint's one-time ratchet is not a growing problem: show its cause instead of "rising". */
function shownState(r, v) {
  const state = stateOf(r);
  const brk = lastEvent(r, "plateau_break");
  const cause = v.plateau_break_cause ? String(v.plateau_break_cause) : null;
  const phaseCause = (!!brk && brk.relevel === true) || (cause !== null && PHASE_CAUSE.test(cause));
  if (state === "rising" && phaseCause) {
    return { shown: "ratchet", cause: cause, title: "reserved stepped up once at a " + (cause || "marked phase") +
      " (the allocator keeps that phase's buffers): the plateau re-levels, this is not a growing problem" };
  }
  if (state === "plateau" && phaseCause && ((brk && brk.relevel === true) || v.plateau_relevels > 0)) {
    return { shown: state, cause: cause, title: "plateau re-levelled after a " + cause + " ratchet" };
  }
  return { shown: state, cause: null, title: null };
}

/** The smallest headroom of a rank: at the training step boundary or at the checkpoint peak. */
export function worstHeadroom(r) {
  const v = verdictOf(r);
  return isNum(v.worst_headroom_bytes) ? v.worst_headroom_bytes : null;
}

/** The latest checkpoint's peak: the same checkpoint as ``checkpoint_headroom_bytes`` (one scope). */
export function checkpointPeak(r) {
  const v = verdictOf(r);
  return isNum(v.checkpoint_peak_bytes) ? v.checkpoint_peak_bytes : null;
}

export function totalOf(r) {
  return verdictOf(r).total_bytes || null;
}

/** The one low-headroom rule (vramwatch.verdicts.is_low_headroom): under the meta fraction of the device. */
export function isLowHeadroom(headroom, total) {
  const f = vocab.low_headroom_fraction;
  return isNum(headroom) && isNum(total) && total > 0 && isNum(f) && headroom < f * total;
}

export function lowHeadroomText() {
  return isNum(vocab.low_headroom_fraction) ? "under " + Math.round(vocab.low_headroom_fraction * 100) + " % of the device" : "";
}

/** Worst first: severity, then earliest projected OOM, then least headroom, then rank. */
export function severityCompare(a, b) {
  const sa = a.vw.severity, sb = b.vw.severity;
  if (sa !== sb) return sb - sa;
  const oa = oomEta(a), ob = oomEta(b);
  if (isNum(oa) !== isNum(ob)) return isNum(oa) ? -1 : 1;
  if (isNum(oa) && oa !== ob) return oa - ob;
  const ha = worstHeadroom(a), hb = worstHeadroom(b);
  if (isNum(ha) !== isNum(hb)) return isNum(ha) ? -1 : 1;
  if (isNum(ha) && ha !== hb) return ha - hb;
  return a.rank - b.rank || (a.host < b.host ? -1 : a.host > b.host ? 1 : 0);
}

/** Projected time (or steps) to OOM; null for a rank already dead (it has nothing left to project). */
export function oomEta(r) {
  if (r.vw && r.vw.death) return null;
  const v = verdictOf(r);
  return isNum(v.seconds_to_oom) ? v.seconds_to_oom : isNum(v.steps_to_oom) ? v.steps_to_oom : null;
}

export function sortValue(r, key) {
  const v = verdictOf(r);
  switch (key) {
    case "rank": return r.rank;
    case "host": return r.host;
    case "state": return r.vw.severity;
    case "plateau": return v.plateau_bytes;
    case "headroom": return v.headroom_bytes;
    case "ckpt": return checkpointPeak(r);
    case "ckpt_headroom": return v.checkpoint_headroom_bytes;
    case "slope": return v.slope_bytes_per_step;
    case "oom": return oomEta(r);
    case "outside": return v.outside_allocator_bytes;
    case "step": return r.last_step;
    default: return null;
  }
}

export function sortRanks(ranks, key, dir) {
  const copy = ranks.slice();
  if (key === "severity" || key === "state") {
    copy.sort((a, b) => (dir < 0 ? severityCompare(a, b) : severityCompare(b, a)));
    return copy;
  }
  copy.sort((a, b) => {
    const va = sortValue(a, key), vb = sortValue(b, key);
    const na = va === null || va === undefined, nb = vb === null || vb === undefined;
    if (na !== nb) return na ? 1 : -1; // blanks last either way
    if (!na && va !== vb) return (va < vb ? -1 : 1) * dir;
    return severityCompare(a, b);
  });
  return copy;
}

/** Words a filter matches: rank, host, state, liveness and the death flags. */
export function filterWords(r) {
  const w = [stateOf(r), r.vw.shown, r.vw.liveness];
  if (r.vw.ooms) w.push("oom");
  if (r.vw.restarts) w.push("restart");
  if (r.vw.death) w.push("dead", "died", r.vw.death.cause, r.vw.death.how);
  if (r.vw.cause) w.push(r.vw.cause);
  return w.join(" ").toLowerCase();
}

/** States in the meta's order, most severe first (for counts in cards and the table foot). */
export function statesBySeverity(keys) {
  const sev = vocab.severity || {};
  return keys.slice().sort((a, b) => (sev[b] !== undefined ? sev[b] : -1) - (sev[a] !== undefined ? sev[a] : -1));
}
