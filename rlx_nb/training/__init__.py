"""Training over many steps: a run's drift from the oracle's, chaos or a bug, and at which step, phase and op."""
