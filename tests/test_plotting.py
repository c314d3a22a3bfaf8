"""Plots checked through their artists (image data, markers, lines), never pixels."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.plot.charts import plot_histogram, plot_scatter, plot_tolerance_curve
from rlx_nb.plot.fold import error_map, make_fold
from rlx_nb.plot.heatmap import heatmap, plot_heatmap

# (one xdist worker for this file: its module-scoped fixtures are built once, not once per worker)
pytestmark = pytest.mark.xdist_group("plotting")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_every_planted_outlier_survives_pooling(rng):
    n = 4096
    o = rng.standard_normal((n, n), dtype=np.float32)
    b = o + rng.standard_normal((n, n), dtype=np.float32) * np.float32(1e-7)
    rows, cols = rng.choice(n, 20, replace=False), rng.choice(n, 20, replace=False)
    b[rows, cols] += np.float32(1.0)
    fig = plt.figure(figsize=(8, 8), dpi=100)  # an 800-px figure
    drawn = heatmap(o, b, ax=fig.add_subplot())
    data = drawn.ax.images[0].get_array()
    fy, fx = drawn.factors
    assert data.shape[0] <= 800 and data.shape[1] <= 800 and fy > 1
    for r, c in zip(rows, cols, strict=True):
        assert data[r // fy, c // fx] >= 0.99, (r, c)
    # Averaging to a 512-px image instead (what resampling a plain imshow does) loses them.
    averaged = np.abs(b - o).reshape(512, 8, 512, 8).mean(axis=(1, 3))
    assert averaged.max() < 0.1


@pytest.mark.parametrize("metric", ["abs", "rel"])
def test_pooled_error_map_matches_brute_force(rng, metric, metrics_path):
    # A ragged grid (blocks do not divide it), NaN/Inf that agree and that do not; both the numba
    # kernel and the numpy path against a brute-force max over every block.
    h, w = 1_537, 1_031
    o = rng.standard_normal((h, w), dtype=np.float32)
    b = o + (rng.standard_normal((h, w)) * 1e-4).astype(np.float32)
    o[5, 7] = b[5, 7] = np.nan  # agree: 0
    o[900, 1000], b[900, 1000] = np.inf, 1.0  # disagree: inf
    pooled, (fy, fx), _ = error_map(o, b, metric=metric, max_pixels=100)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.abs(b.astype(np.float64) - o)
        if metric == "rel":
            e = e / (np.abs(o.astype(np.float64)) + 1e-6)
    e[5, 7], e[900, 1000] = 0.0, np.inf
    ph, pw = -(-h // fy), -(-w // fx)
    want = np.array([[e[i * fy : (i + 1) * fy, j * fx : (j + 1) * fx].max() for j in range(pw)] for i in range(ph)])
    np.testing.assert_allclose(pooled, want, rtol=1e-6)


def test_worst_element_is_marked_and_labelled():
    o = np.zeros((2, 3, 8, 8), np.float32)
    b = o.copy()
    b[1, 2, 5, 6] = 0.5
    drawn = heatmap(o, b)
    ax = drawn.ax
    assert drawn.worst == (1, 2, 5, 6)
    (marker,) = [line for line in ax.lines if line.get_label() == "worst"]
    fold = drawn.fold
    row, col = fold.cell((1, 2, 5, 6))
    assert marker.get_xdata()[0] == col and marker.get_ydata()[0] == row
    assert any("(1, 2, 5, 6)" in t.get_text() for t in ax.texts)


def test_colour_bar_labels_are_plain_text():
    """Major and minor colour-bar labels avoid mathtext, whose parser costs more than a 1e8 map."""
    rng = np.random.default_rng(0)
    o = np.zeros((64, 64), np.float32)
    b = rng.uniform(2e-7, 8e-7, (64, 64)).astype(np.float32)  # under one decade: minor ticks get labels
    ax = plot_heatmap(o, b)
    ax.figure.canvas.draw()
    colorbar_axis = ax.images[0].colorbar.ax.yaxis
    labels = [t.get_text() for minor in (False, True) for t in colorbar_axis.get_ticklabels(minor=minor)]
    assert any(labels), labels
    assert not [text for text in labels if "$" in text], labels


def test_heatmap_figure_keeps_its_labels_inside_without_a_layout_engine():
    """The heatmap's own figure uses fixed margins (no layout engine); every label must still fit.

    A wide colour bar (here 5 decades) carries no minor ticks; a narrow one keeps them (see above).
    """
    o = np.zeros((1000, 1000), np.float32)
    b = np.full_like(o, 1e-7)
    b[999, 999] = 1e-2  # the worst marker's label near the bottom-right corner
    ax = plot_heatmap(o, b, title="a long title " * 5)
    fig = ax.figure
    assert fig.get_layout_engine() is None
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    drawn, frame = fig.get_tightbbox(renderer), fig.bbox_inches  # everything drawn, in inches
    assert ax.texts and ax.texts[0].get_text().startswith("worst")
    assert frame.x0 <= drawn.x0 and drawn.x1 <= frame.x1, (drawn, frame)
    assert frame.y0 <= drawn.y0 and drawn.y1 <= frame.y1, (drawn, frame)
    colorbar = ax.images[0].colorbar.ax
    assert not colorbar.yaxis.get_minorticklocs().size
    assert colorbar.get_yticklabels()


def test_fold_rules_round_trip():
    shape = (2, 3, 4, 5)
    for fold in [None, ((0, 2), (1, 3)), ((3,), (0, 1, 2))]:
        f = make_fold(shape, fold)
        x = np.arange(np.prod(shape)).reshape(shape)
        grid = f.to_2d(x)
        for idx in [(0, 0, 0, 0), (1, 2, 3, 4), (1, 0, 2, 3)]:
            r, c = f.cell(idx)
            assert grid[r, c] == x[idx]
            assert f.index(r, c) == idx
    f = make_fold(shape, select={0: 1, 2: 3})
    assert f.grid == (3, 5) and f.index(2, 4) == (1, 2, 3, 4) and f.cell((0, 0, 0, 0)) is None
    with pytest.raises(ValueError, match="must use each of the 4 axes"):
        make_fold(shape, ((0, 1), (2,)))
    with pytest.raises(ValueError, match="out of range"):
        make_fold(shape, select={0: 5})


def test_one_d_and_scalar_outputs_draw():
    drawn = heatmap(np.zeros(10, np.float32), np.arange(10, dtype=np.float32))
    assert drawn.pooled.shape == (3, 4)  # wrapped into rows of ceil(sqrt(10))
    assert drawn.worst == (9,)
    drawn = heatmap(np.float32(1.0).reshape(()), np.float32(2.0).reshape(()))
    assert drawn.pooled.shape == (1, 1)


def test_budget_metric_centres_one():
    rng = np.random.default_rng(0)
    r = rng.standard_normal((32, 32))
    o = r.astype(np.float32)
    b = o.copy()
    b[4, 4] += 1e-3
    drawn = heatmap(o, b, r, metric="budget", budget=1e-7)
    norm = drawn.ax.images[0].norm
    assert norm(1.0) == pytest.approx(0.5)  # the line (or the budget) at the colour bar's middle
    assert drawn.pooled[4, 4] == pytest.approx(1e-3 / 1e-7, rel=1e-2)


def test_nan_disagreement_is_infinite_on_the_map():
    o = np.ones((4, 4), np.float32)
    b = o.copy()
    b[2, 1] = np.nan
    pooled, _, _ = error_map(o, b)
    assert np.isinf(pooled[2, 1])


def test_histogram_lines_and_bins():
    rng = np.random.default_rng(0)
    o = rng.standard_normal(10_000).astype(np.float32)
    pairs = {"a": (o, o + np.float32(1e-6)), "b": (o, o + np.float32(1e-3))}
    ax = plot_histogram(pairs, lines={"a": 1e-5, "b": 1e-5})
    stairs = [p for p in ax.patches]
    assert len(stairs) == 2
    edges = stairs[0].get_data().edges
    assert np.allclose(np.diff(np.log10(edges)), np.diff(np.log10(edges))[0])  # log-spaced
    assert [v.get_xdata()[0] for v in ax.lines] == [1e-5]  # one shared limit line
    assert sum(stairs[1].get_data().values) == 10_000


def test_scatter_and_tolerance_curve():
    o = np.array([1e-7, 1.0, 2.0, 3.0], np.float32)
    b = o + np.float32(1e-6)
    ax = plot_scatter(o, b, tol_rel=2e-3)
    assert ax.collections[0].get_offsets().shape[0] == 4
    ax = plot_tolerance_curve({"x": (o, b)}, rtols=np.array([1e-9, 1e-2, 10]))
    assert ax.lines[0].get_ydata().tolist() == [1.0, 0.25, 0.0]


def test_report_plot_accessor():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Softmax(-1))
    report = rlx_nb.backend_divergence(model, torch.randn(8, 16), backends=["cpu-nomkldnn", "fault:softmax-row"])
    ax = report.plot.heatmap()  # the suspect, its worst output
    assert "fault:softmax-row" in " ".join(a.get_title() for a in ax.figure.axes)  # (above the column profile)
    assert report.plot.heatmap_picture().worst[0] == 0
    assert len(report.plot.histogram().patches) == 2
    assert report.plot.scatter("cpu-nomkldnn").collections
    assert len(report.plot.tolerance_curve().lines) == 3
    with pytest.raises(rlx_nb.RlxError, match="metric must be"):
        report.plot.heatmap(metric="nope")


def _clipped_text(fig) -> list[str]:
    """Every drawn text whose box leaves the figure, or leaves the axes that clip it."""
    from matplotlib.text import Text

    if not hasattr(fig.canvas, "get_renderer"):  # a bare Figure, as the explorer draws
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    frame = fig.bbox
    out = []
    for ax in fig.axes:
        ax_tight = ax.get_tightbbox(renderer)  # the axes with its drawn tick labels, labels, title, legend
        if ax_tight is not None and not (
            frame.x0 - 1 <= ax_tight.x0 and ax_tight.x1 <= frame.x1 + 1 and frame.y0 - 1 <= ax_tight.y0
            and ax_tight.y1 <= frame.y1 + 1
        ):  # fmt: skip
            out.append(f"axes {ax.get_title()!r}: {ax_tight} outside the figure {frame}")
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or text.axes is None or text not in text.axes.texts:
            continue  # tick labels and titles are in the axes' tight box above
        box = text.get_window_extent(renderer)
        limit = text.axes.bbox if text.get_clip_on() else frame
        if not (
            limit.x0 - 1 <= box.x0 and box.x1 <= limit.x1 + 1 and limit.y0 - 1 <= box.y0 and box.y1 <= limit.y1 + 1
        ):
            out.append(f"{text.get_text()!r} at {box} outside {limit}")
    return out


@pytest.fixture(scope="module")
def suspect_report():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Softmax(-1))
    return rlx_nb.backend_divergence(
        model, torch.randn(32, 16), backends=["cpu-nomkldnn", "fault:softmax-row", "fault:layernorm-eps"]
    )


FIGURES = {
    "heatmap 2-D": lambda r: r.plot.heatmap(),
    "heatmap budget": lambda r: r.plot.heatmap(metric="budget"),
    "heatmap round-off": lambda r: r.plot.heatmap("cpu-nomkldnn"),
    "heatmap 1-D": lambda r: plot_heatmap(np.zeros(300, np.float32), np.linspace(0, 1e-6, 300, dtype=np.float32)),
    "heatmap a few ulps": lambda r: plot_heatmap(
        np.ones((40, 40), np.float32), np.full((40, 40), 1 + 1.2e-7, np.float32)
    ),
    "histogram": lambda r: r.plot.histogram(),
    "scatter": lambda r: r.plot.scatter("fault:softmax-row"),
    "tolerance curve": lambda r: r.plot.tolerance_curve(),
    "effective bits": lambda r: r.plot.effective_bits(),
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_no_text_is_cut_off(suspect_report, name):
    ax = FIGURES[name](suspect_report)
    assert not _clipped_text(ax.figure)


def test_the_explorers_figures_cut_off_no_text(suspect_report):
    ex = rlx_nb.explore(suspect_report)
    for _, metric in ex.metric_toggle.options:
        ex.metric_toggle.value = metric
        assert not _clipped_text(ex._heatmap_ax.figure), metric
        assert not _clipped_text(ex._histogram_ax.figure), metric
    ex.backend_picker.value = "cpu-nomkldnn"
    assert not _clipped_text(ex._heatmap_ax.figure)


def test_the_localization_plot_cuts_off_no_text():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    loc = rlx_nb.localize(model, torch.randn(16, 16), backend="fault:layernorm-eps")
    assert loc.culprit.startswith("1")
    assert not _clipped_text(loc.plot().figure)


@pytest.mark.parametrize("name", ["vendor-xnnpack-int8", "a-vendor-runtime-with-a-rather-long-name-v2", "x"])
def test_a_heatmap_title_is_broken_between_words_never_inside_one_and_stays_in_the_figure(name):
    # #46: titles were cut in their middle, inside a word ("|back… fp64|"), in notebooks, the explorer and the HTML.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Softmax(-1))
    faulty = rlx_nb.backends.registry.get_backend("fault:softmax-row").fn
    rlx_nb.register_backend(name, faulty, default=False, replace=True)
    try:
        report = rlx_nb.backend_divergence(model, torch.randn(32, 16), backends=[name], progress=False)
    finally:
        rlx_nb.unregister_backend(name)
    ex = rlx_nb.explore(report)  # (the explorer's figure: 5 x 4 inches, the narrowest)
    for fig in (ex._heatmap_ax.figure, report.plot.heatmap().figure):
        (title,) = [a.get_title() for a in fig.axes if a.get_title()]
        full = f"{name} · out · |backend - fp64|, x of the SUSPECT line".split()
        shown = title.replace("\n", " ").removesuffix(" …").split()
        assert shown == full[: len(shown)], title  # whole words, in order: cut, if at all, after a word
        assert len(title.splitlines()) <= 2 and not _clipped_text(fig), title


@pytest.mark.parametrize("shape", [(1, 50257), (4, 250_000), (3, 7)])
def test_a_heatmaps_column_ticks_never_run_together(shape, rng):
    # #46: the generation explorer's logits heatmap (a vocabulary's columns, pooled) had x tick labels running
    # into each other.
    from matplotlib.figure import Figure

    from rlx_nb.plot.heatmap import draw_heatmap
    from rlx_nb.plot.style import HEATMAP_MARGINS

    o = rng.standard_normal(shape).astype(np.float32)
    b = o + rng.standard_normal(shape).astype(np.float32) * 1e-3
    fig = Figure(figsize=(5, 4))
    fig.subplots_adjust(**HEATMAP_MARGINS)
    ax = draw_heatmap(o, b, o.astype(np.float64), ax=fig.add_subplot(), metric="abs").ax
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    lo, hi = sorted(ax.get_xlim())
    boxes = [
        t.get_window_extent(renderer) for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi and t.get_text()
    ]
    assert len(boxes) >= 2
    assert all(a.x1 + 2 <= b.x0 for a, b in itertools.pairwise(boxes)), [(b.x0, b.x1) for b in boxes]


def test_a_backend_identical_to_the_oracle_has_no_worst_element_marked(rng):
    # #46: a module identical to the oracle was marked "worst (0, 0, 0)" (its map, on fp64's scale, shows the
    # oracle's own round-off; the first element of an all-zero difference was called its worst).
    from rlx_nb.plot.heatmap import heatmap

    r = rng.standard_normal((3, 4, 5))
    o = r.astype(np.float32)
    same = heatmap(o, o.copy(), r, metric="line", budget=1e-7)
    assert same.worst is None and not [t for t in same.ax.texts if t.get_text().startswith("worst")]
    b = o.copy()
    b[1, 2, 3] += 1e-3
    off = heatmap(o, b, r, metric="line", budget=1e-7)
    assert off.worst == (1, 2, 3)


def _texts_outside(fig) -> list[str]:
    # Every drawn text (titles, tick labels, annotations, legends) whose box leaves the figure: what a reader would
    # see cut.  Axes' tight boxes hold only what is drawn (a tick label outside the view is not).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer, fb = canvas.get_renderer(), fig.bbox
    out = []
    for ax in fig.axes:
        for t in [*ax.texts, ax.title, ax._left_title, ax._right_title, *ax.get_xticklabels(), *ax.get_yticklabels()]:
            if not isinstance(t, Text) or not t.get_visible() or not t.get_text() or not t.get_in_layout():
                continue
            if t in ax.get_xticklabels() or t in ax.get_yticklabels():
                bb = ax.get_tightbbox(renderer)  # (tick labels: the ones drawn, through the axes' own box)
                words = f"{ax.get_label() or 'axes'} tick labels"
            else:
                bb, words = t.get_window_extent(renderer), t.get_text()
            if bb.x0 < fb.x0 - 0.5 or bb.x1 > fb.x1 + 0.5 or bb.y0 < fb.y0 - 0.5 or bb.y1 > fb.y1 + 0.5:
                out.append(words)
    return sorted(set(out))


@pytest.mark.parametrize("shape", [(16, 10), (64, 2), (2, 64), (10, 16), (3, 400), (400, 3)])
def test_no_label_of_a_heatmap_is_cut_at_any_size_the_explorer_or_the_page_draws_it(shape):
    # #62: notebook 08's explorer read "3% of the error; worst (31, 1)" where the heatmap said "[:, 1]: 53% of the
    # error": the band's label, centred on a column near the edge, ran out of the 5-inch figure and was cut.
    from matplotlib.figure import Figure
    from torch.overrides import TorchFunctionMode

    from rlx_nb.plot.style import HEATMAP_MARGINS

    class Column(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.nn.functional.linear:
                out = out.clone()
                out[..., 1] *= 1.0001
                out[-1, -1] *= 1.00001
            return out

    def faulty(model, inputs):
        with Column():
            return model(*inputs)

    rlx_nb.register_backend("test:column", faulty, default=False, replace=True)
    torch.manual_seed(0)
    report = rlx_nb.backend_divergence(torch.nn.Linear(8, shape[1]), torch.randn(shape[0], 8),
                                       backends=["test:column"], progress=False)  # fmt: skip
    # (the explorer's figure and report.plot.heatmap's; the HTML page saves its figures with bbox_inches="tight",
    # which grows the image to hold every text)
    for width, height in ((5.0, 4.0), (6.0, 4.5)):
        fig = Figure(figsize=(width, height))
        fig.subplots_adjust(**HEATMAP_MARGINS)
        report.plot.heatmap(ax=fig.add_subplot())
        assert _texts_outside(fig) == [], (shape, width)
    explorer = rlx_nb.explore(report)
    assert _texts_outside(explorer._heatmap_ax.figure) == []


def test_a_heatmaps_frames_stay_on_the_map():
    # #62: the band's frame on a 16 x 10 output's first row reached past the map's top edge and ran over the column
    # profile above it, where it read as a stray line.
    from matplotlib.patches import Rectangle

    o = np.zeros((16, 10), np.float32)
    b = o.copy()
    b[0, :] = 1e-3  # (a bad first row)
    b[:, 9] += 1e-4  # (and a column that stands out at the right edge)
    h = heatmap(o, b, band=((0,), (0,), "[0]: a bad row"))
    rows, cols = h.pooled.shape
    for p in h.ax.patches:
        if isinstance(p, Rectangle):
            x0, y0, w, ht = p.get_x(), p.get_y(), p.get_width(), p.get_height()
            assert -0.5 - 1e-9 <= x0 and x0 + w <= cols - 0.5 + 1e-9, (x0, w)
            assert -0.5 - 1e-9 <= y0 and y0 + ht <= rows - 0.5 + 1e-9, (y0, ht)
    plt.close(h.ax.figure)
