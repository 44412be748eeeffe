"""The one redaction: secrets out of every text that leaves a host or enters the store.

Command lines (the processes beside a training job), URLs and messages travel to the
collector, are stored and served (``/runs/{run}/processes``, the post-mortem, exception text).
People put credentials in all of them. :func:`redact_args` (an argument vector) and
:func:`redact_text` (any text: a joined command line, a message, a URL) replace each secret
by :data:`REDACTED`, and keep everything else, so a process stays recognisable:

* **URL userinfo**: ``scheme://user:PASS@host`` keeps the user, ``scheme://TOKEN@host`` hides
  all of it (``https``, ``postgres``, ``mysql``, ``redis``, ``amqp``, ``mongodb+srv`` ...);
* **secret-named values**: ``--api-key=V``, ``--token V``, ``--password -V`` (the value even
  when it starts with a dash), ``HF_TOKEN=V``, ``password=V`` in a libpq DSN, ``-e KEY=V``;
  a name is secret-looking when one of its parts (split at ``-``, ``_``, ``.``, case changes)
  is ``key``, ``token``, ``secret``, ``pass``, ``pwd``, ``auth``, ``credential(s)``,
  ``cookie``, ``session``, ``signature``, ``sig``, or it contains ``password``, ``passwd``,
  ``secret``, ``apikey``, ``accesskey``, ``privatekey`` (``PGPASSWORD``, ``--tokenizer`` no);
* **positional secrets**: a bare secret-named word followed by its value
  (``aws configure set aws_secret_access_key V``, ``wandb login V``, ``huggingface-cli login
  --token V``);
* **HTTP headers**: ``Authorization: Bearer V``, ``Proxy-Authorization: Basic V``,
  ``X-Api-Key: V``, ``Cookie: V`` (inside one argument or spread over words), and any
  ``Bearer V`` / ``Basic V``;
* **tool flags**: ``curl -u user:PASS`` / ``--user user:PASS`` (the password), ``-pPASS`` and
  ``-p PASS`` of ``mysql``/``mariadb``/``docker login``-style clients, ``sshpass -p V``.

Cost: linear in the text (regular expressions without nested quantifiers, one pass over the
words). Output is never longer than the input plus three characters per secret.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REDACTED = "***"

_STRONG = ("password", "passwd", "secret", "apikey", "accesskey", "privatekey", "credential")
_PARTS = frozenset({"key", "token", "secret", "pass", "pwd", "auth", "credential", "credentials", "cookie",
                    "session", "signature", "sig", "authorization", "bearer", "passphrase", "apikey"})
#: flags whose value is a path or a switch, not the secret itself
_NOT_SECRET_SUFFIXES = ("-stdin", "-file", "_file", "-path", "_path", "-env", "-cmd", "-command", "-helper")
_SPLIT = re.compile(r"[-_.]+|(?<=[a-z0-9])(?=[A-Z])")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]{0,30}://)(?P<user>[^\s/@:]{0,256})"
                           r"(?P<pw>:[^\s/@]{0,1024})?@")
_HEADER = re.compile(r"(?i)\b(?P<name>(?:proxy-)?authorization|x-api-key|api-key|x-auth-token|cookie|set-cookie|"
                     r"x-amz-security-token|private-token)\s*:\s*(?P<value>\S.*)")
_SCHEME_VALUE = re.compile(r"(?i)\b(?P<scheme>bearer)\s+(?P<value>[^\s\"',;]+)")
_SCHEMES = frozenset({"bearer", "basic", "token", "digest"})
#: programs whose ``-p`` is a password, not a port (the second set: in ``login`` only)
_MYSQL_P = frozenset({"mysql", "mysqldump", "mariadb", "mysqladmin", "sshpass"})
_LOGIN_P = frozenset({"docker", "podman", "nerdctl", "skopeo", "buildah", "oras", "helm", "regctl"})


def secret_name(name: str) -> bool:
    """Whether an option, variable or header name says its value is a secret."""
    bare = name.lstrip("-").rstrip(":")
    low = bare.lower()
    if not bare or low.endswith(_NOT_SECRET_SUFFIXES) or low.startswith("no-"):
        return False
    if any(s in low for s in _STRONG):
        return True
    return any(part.lower() in _PARTS for part in _SPLIT.split(bare) if part)


def _userinfo(m: re.Match[str]) -> str:
    if m.group("pw"):
        return f"{m.group('scheme')}{m.group('user')}:{REDACTED}@"
    return f"{m.group('scheme')}{REDACTED}@" if m.group("user") else m.group(0)


def _header(m: re.Match[str]) -> str:
    words = m.group("value").split(None, 1)
    if len(words) == 2 and words[0].lower() in _SCHEMES:
        return f"{m.group('name')}: {words[0]} {REDACTED}"
    return f"{m.group('name')}: {REDACTED}"


def redact_word(word: str) -> str:
    """One argument with its embedded secrets hidden (URL userinfo, ``name=value``, a header)."""
    out = _URL_USERINFO.sub(_userinfo, word)
    if _HEADER.search(out):
        return _HEADER.sub(_header, out)
    out = _SCHEME_VALUE.sub(lambda m: f"{m.group('scheme')} {REDACTED}", out)
    name, eq, value = out.partition("=")
    if eq and value and secret_name(name.split()[-1] if name.split() else name):
        return f"{name}={REDACTED}"
    if eq and "=" in value:  # --env=HF_TOKEN=V, -e=...: the inner pair
        inner, _, rest = value.partition("=")
        if rest and secret_name(inner):
            return f"{name}={inner}={REDACTED}"
    return out


def redact_args(args: Sequence[str]) -> list[str]:
    """An argument vector with every secret replaced (see the module docstring)."""
    out: list[str] = []
    program = args[0].rsplit("/", 1)[-1].lower() if args else ""
    hide_next = False
    for i, arg in enumerate(args):
        if hide_next and not arg.startswith("--"):
            out.append(_hidden_value(arg, out[-1] if out else ""))
            hide_next = False
            continue
        hide_next = False
        word = redact_text(arg) if any(c.isspace() for c in arg) and not _HEADER.search(arg) else redact_word(arg)
        low = arg.lower()
        if low in ("-u", "--user", "--proxy-user") and i + 1 < len(args):
            out.append(word)
            hide_next = True
        elif arg.startswith("-p") and not arg.startswith("--") and _password_p(program, args):
            out.append(f"-p{REDACTED}" if len(arg) > 2 else arg)
            hide_next = len(arg) == 2
        elif _names_a_secret(arg) or (low == "login" and program == "wandb"):
            out.append(word)
            hide_next = True
        else:
            out.append(word)
    return out


def _password_p(program: str, args: Sequence[str]) -> bool:
    """Whether ``-p`` is a password here: mysql's and sshpass's always, a container client's
    only for ``login`` (``docker run -p`` publishes a port)."""
    if program in _MYSQL_P:
        return True
    return program in _LOGIN_P and "login" in args[1:4]


def _names_a_secret(arg: str) -> bool:
    """An option, a bare variable name or a header name whose *next* word is the secret."""
    shaped = arg.startswith("-") or arg.endswith(":") or arg.replace("_", "").replace("-", "").isalnum()
    return "=" not in arg and shaped and secret_name(arg)


def _hidden_value(value: str, flag: str) -> str:
    """The value after a secret flag: ``user:PASS`` keeps the user for ``-u``; a scheme word
    (``Bearer``) is kept and the next one hidden by the caller's text pass."""
    if "://" in value:  # redis-cli -u redis://user:PASS@host: the URL's own rule
        return redact_word(value)
    if flag.lower() in ("-u", "--user", "--proxy-user"):
        user, colon, _ = value.partition(":")
        return f"{user}:{REDACTED}" if colon else value
    if value.lower() in _SCHEMES:
        return value
    return REDACTED


def redact_text(text: str) -> str:
    """Any text (a joined command line, a message) with its secrets replaced: each
    whitespace-separated word as :func:`redact_args` treats an argument, headers and
    ``Bearer`` values across words. Spacing is kept."""
    if not text:
        return text
    pieces = re.split(r"(\s+)", text)
    words = pieces[0::2]
    hidden = redact_args(words)
    for i, w in enumerate(hidden):  # "Authorization: Bearer X" spread over words
        if w.lower() in _SCHEMES and i + 1 < len(hidden) and i and hidden[i - 1].endswith(":") and \
                secret_name(hidden[i - 1]):
            hidden[i + 1] = REDACTED
    pieces[0::2] = hidden
    out = "".join(pieces)
    return _SCHEME_VALUE.sub(lambda m: f"{m.group('scheme')} {REDACTED}", out) if "earer" in out else out


__all__ = ["REDACTED", "redact_args", "redact_text", "redact_word", "secret_name"]
