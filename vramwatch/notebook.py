"""The monitor in a Jupyter notebook: ``vw`` as the last line of a cell shows its run's live page.

Pure string building (no import of IPython, no network): Jupyter calls ``Monitor._repr_html_``,
which calls :func:`live_view`. The iframe points at the collector the monitor sends to; the
collector's read token is never written into the notebook (a notebook is shared and saved), so a
collector started with ``--auth-read`` asks for it in the frame.
"""

from __future__ import annotations

import html
from urllib.parse import quote, urlsplit

#: the iframe's height in CSS pixels: the run card, the charts and the first rank rows
FRAME_HEIGHT_PX = 720


def page_url(collector_url: str, run: str) -> str:
    """The run's live page on the collector whose ingest URL is ``collector_url``."""
    parts = urlsplit(collector_url)
    return f"{parts.scheme}://{parts.netloc}/#/run/{quote(run, safe='')}"


def live_view(collector_url: str | None, run: str, *, where: str | None = None) -> str:
    """HTML for a notebook cell: an iframe of the run's live page, or, without a collector, how to
    start one on this machine (the samples meanwhile go to ``where``)."""
    if not collector_url:
        target = f" Samples go to <code>{html.escape(where)}</code>." if where else ""
        return ("<div><b>vramwatch</b>: no collector configured for run <code>"
                f"{html.escape(run)}</code>.{target} Start one on this machine with "
                "<code>vramwatch serve --host 127.0.0.1 --port 8765</code> and call "
                "<code>vramwatch.init(url=\"http://127.0.0.1:8765\")</code> to watch it live here.</div>")
    url = page_url(collector_url, run)
    link = html.escape(url, quote=True)
    return (f'<div><b>vramwatch</b> · run <code>{html.escape(run)}</code> · <a href="{link}" target="_blank" '
            f'rel="noopener">open in a tab</a></div><iframe src="{link}" title="vramwatch: {html.escape(run)}" '
            f'style="width:100%;height:{FRAME_HEIGHT_PX}px;border:1px solid #ccc" loading="lazy"></iframe>')


__all__ = ["FRAME_HEIGHT_PX", "live_view", "page_url"]
