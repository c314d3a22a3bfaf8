"""Generation: a decode as one module, its exported and compiled forms, the divergence call and its report."""
