/* Page state shared by the panels of one page, and the verdict vocabulary from
 * GET /api/v1/meta. Reset on every route change; panels read and write its fields. */

export const S = {};

/** The verdict vocabulary (states, severity, liveness, run statuses, the low-headroom
 * threshold, headroom definitions) exactly as vramwatch/verdicts.py defines it. */
export const vocab = {
  loaded: false, states: [], severity: {}, liveness: [], run_statuses: [], low_headroom_fraction: null, headroom: {},
};

export function setVocab(meta) {
  Object.assign(vocab, meta || {}, { loaded: !!meta });
}

let generation = 0;

export function resetState(route) {
  if (S.pollTimer) clearTimeout(S.pollTimer);
  for (const key of Object.keys(S)) delete S[key];
  generation++;
  Object.assign(S, {
    gen: generation, page: route.page, run: route.run, x: route.x, pollTimer: null,
    want: route.rank !== null ? { rank: route.rank, host: route.host } : null,
    ranks: null, rows: null, selected: null, sort: { key: "severity", dir: -1 }, compare: null,
    zoom: null, stepTs: null, heatField: "headroom", heatMode: "deviation", overlayField: null, overlayAuto: true,
    tick: 0, lastOk: null, error: null, mainData: null, rendered: {}, heat: null, worstCard: null,
  });
}
