"""Plumbing every stage uses: nested outputs, text made safe, progress, process-wide switches, module copies, each phase's meter, huge pages, the background warm-up."""
