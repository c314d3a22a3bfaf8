"""The ``rlx-nb`` command's entry point, a module beside the package: what stops rlx_nb from importing (a torch older
than its range, no torch at all) is a usage error, exit code 2, with the message, never a traceback and exit 1
(which ``rlx-nb check`` means as "some backend is SUSPECT")."""

from __future__ import annotations

import sys
from collections.abc import Sequence

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from rlx_nb.cli import main as run
    except ImportError as exc:  # (rlx_nb._version.check_torch's message, or a missing dependency's)
        print(f"rlx-nb: error: rlx_nb cannot start: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
