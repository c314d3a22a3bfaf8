"""What changed after the upgrade: :func:`~rlx_nb.changes.record.snapshot` records one environment's run module by
module, :func:`~rlx_nb.changes.diff.diff` finds where another environment parts from it, each change judged against
that module's round-off."""
