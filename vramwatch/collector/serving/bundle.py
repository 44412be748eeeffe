"""The dashboard's ES modules as one inline ``<script type="module">`` for report files.

The live page loads ``dashboard/*.js`` as native ES modules (no build step). A report is a
single HTML file opened from disk, where a module cannot import its siblings (``file://``
has no origin), so the report inlines them: each module becomes a function scope that
returns its exports, called in dependency order, and each ``import {a, b as c} from
"./x.js"`` becomes ``const {a, b: c} = __vw["x.js"]``. This works because the modules
keep to a small, checked subset of the syntax: single-line named imports of sibling
modules, and ``export`` only on ``function`` / ``class`` / ``const`` declarations (no
default, no re-export, no ``export let``). Anything else raises :class:`BundleError`.
Cost: one pass over ~100 KB of text.
"""

from __future__ import annotations

import re
from pathlib import Path

from vramwatch.errors import VramwatchError

ENTRY = "app.js"
_IMPORT = re.compile(r'^import\s*\{([^}]*)\}\s*from\s*"\./([\w.-]+\.js)";\s*$', re.M)
_EXPORT = re.compile(r"^export\s+(?:async\s+)?(function\*?|class|const)\s+([A-Za-z_$][\w$]*)", re.M)
_OTHER_EXPORT = re.compile(r"^export\s+(?!(?:async\s+)?(?:function|class|const)\s)", re.M)
_OTHER_IMPORT = re.compile(r"^import\b", re.M)


class BundleError(VramwatchError, ValueError):
    """A dashboard module uses syntax the report bundler does not handle."""

    status = 500


def _rewrite(name: str, text: str) -> tuple[str, list[str], list[str]]:
    deps: list[str] = []

    def binding(match: re.Match[str]) -> str:
        names = []
        for part in match.group(1).split(","):
            part = part.strip()
            if not part:
                continue
            original, _, alias = part.partition(" as ")
            names.append(f"{original.strip()}: {alias.strip()}" if alias else original.strip())
        deps.append(match.group(2))
        return f"const {{ {', '.join(names)} }} = __vw[{match.group(2)!r}];"

    body = _IMPORT.sub(binding, text)
    if _OTHER_IMPORT.search(body):
        raise BundleError(f"{name}: only single-line named imports of sibling modules are supported")
    if _OTHER_EXPORT.search(body):
        raise BundleError(f"{name}: only `export function|class|const NAME` is supported")
    exports = [m.group(2) for m in _EXPORT.finditer(body)]
    body = re.sub(r"^export\s+", "", body, flags=re.M)
    return body, deps, exports


def bundle(directory: Path, entry: str = ENTRY) -> str:
    """One module script holding ``entry`` and every module it imports (dependencies first)."""
    modules: dict[str, tuple[str, list[str], list[str]]] = {}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in modules:
            return
        if name in visiting:
            raise BundleError(f"{name}: circular import")
        visiting.add(name)
        try:
            text = (directory / name).read_text(encoding="utf-8")
        except OSError as exc:
            raise BundleError(f"{name}: cannot read ({exc})") from None
        body, deps, exports = _rewrite(name, text)
        for dep in deps:
            visit(dep)
        visiting.discard(name)
        modules[name] = (body, deps, exports)
        order.append(name)

    visit(entry)
    parts = ["const __vw = {};"]
    for name in order:
        body, _, exports = modules[name]
        parts.append(f"// ---- {name}\n__vw[{name!r}] = (() => {{\n{body}\nreturn {{ {', '.join(exports)} }};\n}})();")
    return "\n".join(parts) + "\n"


__all__ = ["BundleError", "bundle"]
