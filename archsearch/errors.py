"""User-facing errors.

Every error a user can cause (bad flag, bad config, bad data) is an :class:`ArchsearchError`.
The CLI turns it into one line on stderr and exit status 2, with no traceback. The message
names the field and says what would be valid, so the user can fix it without reading code.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# user:password@ in a URL (scheme://user:password@host): the password is what redact() masks
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s]*:)(?P<password>[^@\s]*)@")
# a URL's parameter (?key=value, &key=value, ;key=value, or in the fragment #key=value); its key,
# percent-decoded (pass%77ord is password), names a secret when it holds one of these words, any case
_PARAM = re.compile(r"(?P<head>[?&;#](?P<key>[\w.\-%+]+)=)(?P<secret>[^&;#\s'\"]*)")
_SECRET_KEY = re.compile(r"password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|credential", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every secret of a URL in it masked, in each form a URL carries one: the
    password of ``scheme://user:password@host`` (``postgresql://u:***@host/db``) and a secret
    parameter in its query or fragment (``?password=***``, ``&sslpassword=***``, ``&token=***``,
    ``#password=***``, its key percent-encoded or not). What the project prints or writes of a
    config, a command line or an error goes through here (the one mask), so a storage password is
    used to connect and never shown or stored."""
    if not isinstance(text, str) or "=" not in text and "://" not in text:
        return text
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m['head']}***@", text)
    if "=" not in text:
        return text
    return _PARAM.sub(lambda m: f"{m['head']}***" if _SECRET_KEY.search(unquote(m["key"])) else m[0], text)


class ArchsearchError(ValueError):
    """A problem with the user's input; ``field`` names what to fix. No part of the message shows
    a URL's password (:func:`redact`)."""

    def __init__(self, field: str, problem: str, fix: str | None = None):
        field, problem, fix = redact(field), redact(problem), redact(fix)
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


class MissingDependencyError(ArchsearchError):
    """An optional engine (vLLM, SGLang, lm-eval, ...) is not installed or cannot run here."""

    def __init__(self, what: str, problem: str, fix: str):
        super().__init__(what, problem, fix)
