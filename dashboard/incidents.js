/* The post-mortem's story (vramwatch/incidents): the incidents in time order, each the
 * collector's sentence with its moment in the viewer's zone; what is still wrong at the end; and
 * the next step, in order, with its exact command. Every sentence is the API's `text`, rendered
 * from a typed finding where its numbers are: the page adds times, never claims. */

import { clock, intText } from "./format.js";
import { el } from "./dom.js";

const KIND = { oom: "OOM", suspected_oom: "suspected OOM", death: "death", job_stop: "job stop" };
/** Causes whose name alone would not read right (the rest: underscores as spaces). */
const CAUSE = { suspected_oom: "suspected OOM (device memory)" };

export function storyNodes(pm) {
  const incidents = pm.incidents || [];
  const still = pm.open_findings || [];
  const next = pm.next || [];
  const nodes = [el("h4", { text: incidents.length ? "What happened" : "No incident" })];
  if (incidents.length) {
    nodes.push(el("ol", { class: "pm-incidents", id: "pm-incidents" }, incidents.map((i) =>
      el("li", { dataset: { kind: i.kind, cause: i.cause, rank: i.rank, ts: i.ts } },
        el("strong", { text: (KIND[i.kind] || i.kind) + " · " + (CAUSE[i.cause] || i.cause.replace(/_/g, " ")) }),
        " · " + clock(i.ts) + " · step " + intText(i.step) + " — " + i.text))));
  }
  if (still.length) {
    nodes.push(el("h4", { text: "Still open" }), el("ul", { class: "pm-open", id: "pm-open" }, still.map((f) =>
      el("li", { dataset: { kind: f.kind, rank: f.rank }, text: f.text }))));
  }
  if (next.length) {
    nodes.push(el("h4", { text: "Next step" }), el("ol", { class: "pm-next", id: "pm-next" }, next.map((n) =>
      el("li", { dataset: { action: n.action } }, n.text,
        n.command ? el("pre", null, el("code", { class: "pm-command", text: n.command })) : null))));
  }
  return nodes;
}
