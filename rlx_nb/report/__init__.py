"""Present, as a report: the report object, element look-ups, the HTML page, the saved file and its schema, merging nodes, baselines."""
