/* What each remedy would save on the binding rank (the advice document's `remedies`, largest
 * saving first): the saving, the batch the same model then allows, what it costs and what the
 * figure rests on. Below it the rank's memory by category and the input-peak finding (step peaks
 * following the longest sequence). Nothing here computes: every number is the collector's. */

import { gib, intText, isNum } from "./format.js";
import { el } from "./dom.js";

const NAMES = {
  eight_bit_optimizer: "8-bit optimizer", activation_checkpointing: "activation checkpointing",
  gradient_accumulation: "gradient accumulation", shorter_sequences: "shorter sequences", lora: "LoRA / freezing",
  mixed_precision: "mixed precision", sharding: "sharding (FSDP / ZeRO)", expandable_segments: "expandable segments",
  close_foreign_process: "close the other process",
};

export function remediesBlock(doc) {
  const found = doc.remedies || [];
  const memory = doc.memory || [];
  const rank = found.length ? found[0].rank : null;
  const facts = memory.find((f) => f.rank === rank && isNum(f.params_bytes));
  const peaks = memory.filter((f) => f.input_peak).map((f) => f.input_peak);
  if (!found.length && !peaks.length) return null;
  return el("div", { class: "remedies", id: "advice-remedies" },
    el("h3", { text: "What each remedy would save" + (rank !== null ? " · rank " + rank : "") }),
    facts ? el("p", { class: "muted", id: "remedies-memory", text: "Parameters " + gib(facts.params_bytes) + ", gradients " +
      gib(facts.grads_bytes) + ", optimizer state " + gib(facts.optimizer_bytes) +
      (isNum(facts.activation_bytes) ? ", activations and temporaries " + gib(facts.activation_bytes) + " at the step's peak" : "") + "." }) : null,
    peaks.map((p) => el("p", { class: "advice-input-peak", dataset: { rank: String(p.rank) }, text: "Inputs: " + p.text })),
    found.length ? el("div", { class: "table-wrap" }, el("table", { class: "data", id: "remedies-table" },
      el("thead", {}, el("tr", {}, ["remedy", "saves", "tokens / step after", "costs", "basis"].map((h) => el("th", { text: h })))),
      el("tbody", {}, found.map((r) => el("tr", { dataset: { remedy: r.remedy } },
        el("td", { title: r.text, text: NAMES[r.remedy] || r.remedy }),
        el("td", { class: "num", text: gib(r.saves_bytes) }),
        el("td", { class: "num", text: isNum(r.tokens_per_step_after) ? intText(r.tokens_per_step_after) : "—" }),
        el("td", { text: r.costs }),
        el("td", { class: "muted", text: r.basis })))))) : null);
}
