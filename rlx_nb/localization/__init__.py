"""Localization: where in the model the error is born (capture, search, result, repro, graph)."""
