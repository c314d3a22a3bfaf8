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
"""

from __future__ import annotations

import html
import re

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


__all__ = ["html_text", "plot_text", "term_text"]
