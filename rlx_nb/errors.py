"""The errors rlx_nb raises on purpose; every one derives from :class:`RlxError`."""

from __future__ import annotations


class RlxError(Exception):
    """Base of every error rlx_nb raises on purpose.

    The message says what failed, the offending value, and what is allowed.
    """


class BackendError(RlxError):
    """A backend name is unknown, not live here, or registered twice."""


class InputError(RlxError):
    """The model, its inputs or its params cannot be used as given."""


class TargetError(RlxError):
    """A CLI target (``file.py:factory`` or ``package.module:factory``) cannot be loaded."""
