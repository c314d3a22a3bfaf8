"""Same model, another batch: where bit for bit breaks, and whether it is only round-off (``rlx_nb.invariance``)."""
