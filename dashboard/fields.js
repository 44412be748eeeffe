/* Generated from FIELD_TABLE in vramwatch/wire/fields.py; regenerate with
 * `python -c "from vramwatch import wire; print(wire.fields_js(), end='')" > dashboard/fields.js`
 * (tests/wire/test_wire.py fails when this file is stale). */

/** Sample fields each chart fetches (besides ts), in the table's order. */
export const CHART_FIELDS = {
  rank: ["allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes", "alloc_retries", "nvml_used_bytes", "total_bytes"],
  device: ["reserved_bytes", "nvml_used_bytes", "foreign_used_bytes"],
  host: ["host_rss_bytes", "host_children_rss_bytes", "host_available_bytes", "host_pinned_bytes"],
};

/** The name of a field's line where a chart draws one line per field. */
export const FIELD_LABELS = {
  host_rss_bytes: "trainer RSS",
  host_children_rss_bytes: "children RSS (workers)",
  host_available_bytes: "node available",
  host_pinned_bytes: "pinned",
};
