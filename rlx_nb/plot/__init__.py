"""Present, as figures: the style every figure shares, folding outputs to 2-D, the heatmap, the charts, a report's plots, a generation's steps."""
