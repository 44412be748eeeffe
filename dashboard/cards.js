/* The summary cards over the verdict table: worst rank, least headroom, time to OOM (or
 * the death that already happened), rank counts with deaths and liveness, last sample. */

import { age, clock, duration, gib, intText, isNum, rankKey, rate, runway, slopeText } from "./format.js";
import { $, clear, el } from "./dom.js";
import { STATIC } from "./api.js";
import { S } from "./state.js";
import { isLowHeadroom, lastHeard, lowHeadroomText, oomEta, sortRanks, statesBySeverity, totalOf, verdictOf } from "./verdict.js";

/**
 * The worst rank, with hysteresis: the card moves to another rank only when that rank is
 * strictly more severe, so ranks trading places inside one severity (warm-up, a plateau)
 * do not make it flicker. The choice is kept in ``S.worstCard``.
 */
export function worstRank(ranks) {
  const candidate = sortRanks(ranks, "severity", -1)[0];
  const prev = S.worstCard && ranks.find((r) => rankKey(r.host, r.rank) === rankKey(S.worstCard.host, S.worstCard.rank));
  const keep = prev && prev.vw.severity >= candidate.vw.severity;
  S.worstCard = keep ? prev : candidate;
  return S.worstCard;
}

function deathText(death) {
  return "died (" + death.how + ") at step " + intText(death.step) + " · " + clock(death.ts) + (death.said ? " · " + death.said : "");
}

function worstCard(worst) {
  const v = verdictOf(worst);
  const vw = worst.vw;
  let why = "";
  if (vw.death) why = deathText(vw.death);
  else if (v.state === "leak") why = slopeText(v.slope_bytes_per_step) + (v.leak_source ? " · " + v.leak_source : "");
  else if (vw.shown === "ratchet") why = "one-time " + (vw.cause || "phase") + " ratchet";
  else if (v.state === "fragmentation") why = "reserved far above allocated";
  else if (v.state === "warmup") why = "still warming up";
  else if (v.state === "plateau" && !vw.ooms && !vw.restarts) why = "all ranks stable";
  if (vw.ooms) why = "OOM ×" + vw.ooms + (why ? " · " + why : "");
  const badge = vw.death ? (vw.death.cause === "oom" ? "oom" : vw.liveness) : vw.shown;
  return {
    label: "Worst rank", alert: vw.shown === "leak" || !!vw.death || vw.ooms > 0,
    value: el("span", null, el("span", { class: "badge", dataset: { state: badge }, text: badge }), " ", el("span", { text: "rank " + worst.rank })),
    sub: worst.host + (why ? " · " + why : ""),
  };
}

function headroomCard(ranks) {
  let min = null, at = null;
  for (const r of ranks) {
    const v = verdictOf(r);
    for (const [value, where] of [[v.headroom_bytes, "at its step boundary"], [v.checkpoint_headroom_bytes, "at its checkpoint peak"]]) {
      if (isNum(value) && (min === null || value < min)) { min = value; at = { r, where }; }
    }
  }
  return {
    label: "Min headroom", alert: at !== null && isLowHeadroom(min, totalOf(at.r)), value: gib(min),
    sub: at ? "rank " + at.r.rank + " " + at.where + (isLowHeadroom(min, totalOf(at.r)) ? " · " + lowHeadroomText() : "") : "no verdict yet",
    title: "device capacity minus what the device holds (allocator plus memory outside it), the smallest over ranks, " +
      "at the latest training step or at the latest checkpoint peak",
  };
}

function oomCard(ranks) {
  const dead = ranks.filter((r) => r.vw.death && r.vw.death.cause === "oom");
  if (dead.length) {
    const first = dead.slice().sort((a, b) => (a.vw.death.ts || 0) - (b.vw.death.ts || 0))[0];
    return { label: "Out of memory", alert: true, value: "rank " + first.rank + " died",
      sub: "OOM at step " + intText(first.vw.death.step) + " · " + clock(first.vw.death.ts) + (dead.length > 1 ? " · " + dead.length + " ranks" : "") };
  }
  let soonest = null;
  for (const r of ranks) {
    const eta = oomEta(r);
    if (isNum(eta) && (soonest === null || eta < oomEta(soonest))) soonest = r;
  }
  if (!soonest) {
    // a rank whose process ended while leaking has no runway, but "no leak" would be false
    const leaking = ranks.find((r) => verdictOf(r).state === "leak");
    if (leaking) return { label: "Time to OOM", alert: true, value: "ended while leaking",
      sub: "rank " + leaking.rank + " · " + rate(verdictOf(leaking).slope_bytes_per_step) + " when it ended" };
    return { label: "Time to OOM", value: "no leak", sub: "no rank trending to OOM" };
  }
  const v = verdictOf(soonest);
  return { label: "Time to OOM", alert: true, value: isNum(v.seconds_to_oom) ? duration(v.seconds_to_oom) : intText(v.steps_to_oom) + " steps",
    sub: "rank " + soonest.rank + " · ≈ " + runway(v.steps_to_oom, v.seconds_to_oom) };
}

function ranksCard(ranks) {
  const hosts = new Set(ranks.map((r) => r.host)).size;
  const byState = {};
  let silent = 0, exited = 0, dead = 0, ooms = 0, oomRanks = 0, restarts = 0, suspected = 0;
  for (const r of ranks) {
    byState[r.vw.shown] = (byState[r.vw.shown] || 0) + 1;
    if (r.vw.liveness === "silent") silent++;
    if (r.vw.liveness === "exited") exited++;
    if (r.vw.liveness === "dead") dead++;
    if (r.vw.ooms) { ooms += r.vw.ooms; oomRanks++; }
    restarts += r.vw.restarts || 0;
    suspected += r.vw.suspectedOoms || 0;
  }
  const parts = [];
  if (dead) parts.push(dead + " dead");
  if (silent) parts.push(silent + " silent");
  // one OOM that took the job down and every rank's restart is one incident (the post-mortem's
  // count); the per-rank counts go in brackets beside it
  const perRank = [];
  if (oomRanks) perRank.push("OOM ×" + ooms + (oomRanks > 1 ? " on " + oomRanks + " ranks" : ""));
  if (suspected) perRank.push("suspected OOM ×" + suspected);
  if (restarts) perRank.push("restart ×" + restarts);
  if (isNum(S.runIncidents) && S.runIncidents > 0) {
    parts.push(S.runIncidents + (S.runIncidents === 1 ? " incident" : " incidents") + (perRank.length ? " (" + perRank.join(", ") + ")" : ""));
  } else parts.push(...perRank);
  if (exited) parts.push(exited + " exited");
  parts.push(statesBySeverity(Object.keys(byState)).map((k) => byState[k] + " " + k).join(", "));
  return { label: "Ranks", value: intText(ranks.length), alert: dead > 0 || silent > 0 || oomRanks > 0 || suspected > 0,
    sub: hosts + (hosts === 1 ? " host" : " hosts") + " · " + parts.join(" · ") };
}

export function drawCards() {
  const ranks = S.ranks;
  const worst = worstRank(ranks);
  const newest = ranks.reduce((m, r) => Math.max(m, lastHeard(r)), 0);
  const lastStep = ranks.reduce((m, r) => Math.max(m, r.last_step || 0), 0);
  const cards = [
    worstCard(worst), headroomCard(ranks), oomCard(ranks), ranksCard(ranks),
    // a report is read long after it was made: there the time itself, not "… ago"
    { label: "Last sample", value: STATIC ? clock(newest) : age(newest), sub: "step " + intText(lastStep), title: "last sample " + clock(newest) },
  ];
  const box = $("cards");
  clear(box);
  for (const c of cards) {
    box.appendChild(el("div", { class: "card" + (c.alert ? " alert" : ""), title: c.title || null },
      el("div", { class: "label", text: c.label }),
      el("div", { class: "value" }, c.value),
      el("div", { class: "sub", text: c.sub, title: c.sub })));
  }
}
