"""Text from outside, made safe where it is shown: in HTML and in matplotlib.

Output names (a dict key a model returns), module names, backend names, labels and exception messages
come from the model, the backend or a received ``.rlxnb`` file, so any of them may hold markup, script,
math text or control characters.  Every view rlx_nb draws passes them through here:

- :func:`html_text`: escaped, so markup shows as text and never runs (a notebook renders HTML reprs as
  they are); lone surrogates, which no encoder can write, are replaced.
- :func:`term_text`: printed to a terminal or a CI log: control characters (an ANSI escape sequence
  could recolour or rewrite the log) show as ``\x1b``-style escapes.
- :func:`plot_text`: shown literally by matplotlib: a ``$`` never starts math text (``$\\x$`` made
  ``to_html`` crash inside the math parser), control characters show as ``\\x07``-style escapes (the
  fonts have no glyphs for them), lone surrogates (which crash matplotlib's text engine) are replaced.
- :func:`md_text`, :func:`md_code`, :func:`md_fence`: in markdown (an issue to file): on one line, no markup
  or HTML of its own, and a fence no line of the text can close.
- :func:`code_text`: in a comment or a docstring of generated Python (a repro): the text itself where it is
  plain, else its ``repr()`` -- never a newline, a quote or a backslash that would end the comment or string.
- :func:`file_stem` and :func:`inside`: a file name made from a user's string, and the check that a path made
  from one stays inside its folder; :func:`write_new` writes a file whole or not at all, never through a link
  planted at its name.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import os
import re
import tempfile
from pathlib import Path

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _no_surrogates(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8") if any("\ud800" <= c <= "\udfff" for c in text) else text


def html_text(value: object) -> str:
    """``value`` as text escaped for HTML (``&``, ``<``, ``>``, quotes).

    Examples
    --------
    >>> html_text("<img src=x onerror=alert(1)>")
    '&lt;img src=x onerror=alert(1)&gt;'
    """
    return html.escape(_no_surrogates(str(value)))


def term_text(value: object) -> str:
    """``value`` as text for a terminal: control characters other than newlines and tabs escaped.

    Examples
    --------
    >>> term_text("red\x1b[31m")
    'red\\\\x1b[31m'
    """
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", _no_surrogates(str(value)))


def plot_text(value: object) -> str:
    """``value`` as text matplotlib shows literally: no math text, control characters escaped.

    Examples
    --------
    >>> plot_text("cost in $ and $\\\\x$")
    'cost in \\\\$ and \\\\$\\\\x\\\\$'
    >>> plot_text("bell\\x07")
    'bell\\\\x07'
    """
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", _no_surrogates(str(value)).replace("\t", " "))
    return text.replace("$", r"\$")


_PLAIN = re.compile(r"[\w .,:;+*/=<>()\[\]{}@#%&!?^|~$-]*")


def code_text(value: object) -> str:
    """``value`` for a comment or docstring of generated Python: as it is when it holds only plain printable
    characters (no quote, backslash, newline or control character), else its ``repr()``.

    Examples
    --------
    >>> code_text("blocks.0.attn :: F.softmax")
    'blocks.0.attn :: F.softmax'
    >>> code_text('x\\n    open("PWN", "w")')
    '\\'x\\\\n    open("PWN", "w")\\''
    """
    text = str(value)
    return text if _PLAIN.fullmatch(text) and text.isprintable() else repr(text)


def docstring(text: str) -> str:
    """``text`` as a triple-quoted string literal that evaluates to exactly ``text``: a backslash, a quote that
    would close it and every control character but the newline escaped.

    Examples
    --------
    >>> nasty = 'a ' + '"' * 3 + ' ends it, a \\\\ escapes, a \\x00 breaks it'
    >>> import ast; ast.literal_eval(docstring(nasty)) == nasty
    True
    """
    import ast

    body = text.replace("\\", "\\\\").replace('"', '\\"')
    body = re.sub(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", body)
    body = re.sub(r"[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", body)  # (no encoder writes these)
    literal = f'"""{body}"""'
    assert ast.literal_eval(literal) == text
    return literal


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#~])")


def _one_line(text: str) -> str:
    # Newlines, tabs and other control characters as escapes: the text stays on its line.
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: repr(m.group())[1:-1], _no_surrogates(text))


def md_text(value: object) -> str:
    """``value`` for markdown prose: one line, HTML escaped, markdown's own characters backslash-escaped.

    Examples
    --------
    >>> print(md_text("a\\n# heading <img src=x>"))
    a\\\\n\\# heading &lt;img src=x&gt;
    """
    return _MD_SPECIAL.sub(r"\\\1", html.escape(_one_line(str(value)), quote=False))


def md_code(value: object) -> str:
    """``value`` as inline code: one line, between more backticks than it holds in a row.

    Examples
    --------
    >>> md_code("F.softmax")
    '`F.softmax`'
    >>> md_code("a`b")
    '`` a`b ``'
    """
    text = _one_line(str(value))
    ticks = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if ticks != "`" or text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def md_fence(text: str, info: str = "") -> str:
    """``text`` in a fenced block whose fence is longer than any run of backticks in it (so no line closes it).

    Examples
    --------
    >>> print(md_fence("x = 1", "python"))
    ```python
    x = 1
    ```
    """
    ticks = "`" * max(3, max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    return f"{ticks}{info}\n{text}\n{ticks}"


NAME_CHARS = 100
"""The longest file-name stem made from a user's string (a file system takes 255 bytes a name)."""


def file_stem(value: object) -> str:
    """A file-name stem made from a user's string (a backend's name, a node's): letters, digits, ``_``, ``-`` and
    ``.`` only (every other run of characters one ``_``), never starting with a dot, at most :data:`NAME_CHARS`
    characters (a longer one ends in a hash of the whole, so two long names stay apart).

    Examples
    --------
    >>> file_stem("fault:softmax-row"), file_stem("evil/../../../ESCAPED"), file_stem("..")
    ('fault_softmax-row', 'evil_.._.._.._ESCAPED', 'unnamed')
    """
    text = _no_surrogates(str(value))
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).lstrip(".")
    stem = stem if stem.strip("._") else "unnamed"
    if len(stem) > NAME_CHARS:
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
        stem = f"{stem[: NAME_CHARS - 13]}-{digest}"
    return stem


def inside(folder: str | Path, name: str, what: str = "a file") -> Path:
    """``folder / name``, checked to stay inside ``folder`` (links and ``..`` resolved): an
    :class:`~rlx_nb.errors.InputError` naming both where it would not.

    Examples
    --------
    >>> inside("out", "repro_cpu.py").as_posix()
    'out/repro_cpu.py'
    >>> inside("out", "../x.py")
    Traceback (most recent call last):
    rlx_nb.errors.InputError: a file '../x.py' would be written outside its folder 'out'; refused
    """
    from rlx_nb.errors import InputError

    folder = Path(folder)
    path = folder / name
    try:  # (the folders on the way resolved, links included; the file itself not: write_new replaces a link)
        ok = path.name not in ("", ".", "..") and (path.parent.resolve() / path.name).is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # (a name the file system refuses, a loop of links)
        ok = False
    if not ok or Path(name).is_absolute():
        raise InputError(f"{what} {name!r} would be written outside its folder {str(folder)!r}; refused")
    return path


def write_new(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all: into a new file beside it, then renamed over it (a link
    planted at ``path`` is replaced, never followed; a reader never sees half a file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:40]}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


__all__ = [
    "code_text",
    "docstring",
    "file_stem",
    "html_text",
    "inside",
    "md_code",
    "md_fence",
    "md_text",
    "plot_text",
    "term_text",
    "write_new",
]
