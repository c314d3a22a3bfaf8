"""The picture shows the fault: a bad row, column, channel or element is visible on the default heatmap and in
the explorer's first view, at every output size (1e3 to 1e8 elements), read back from the pixels."""

from __future__ import annotations

import base64
import io
import math

import matplotlib
import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.plot.heatmap import heatmap
from tests.pixels import near, rgba, top_colour

# (one xdist worker for this file: its module-scoped fixtures are built once, not once per worker)
pytestmark = pytest.mark.xdist_group("picture")

matplotlib.use("Agg")

SHAPES = {  # ~n elements: a 2-D output, and a 4-D one (batch, channels, height, width) for the channel fault
    1e3: ((25, 40), (2, 4, 5, 25)),
    1e4: ((100, 100), (2, 8, 25, 25)),
    1e5: ((250, 400), (4, 16, 40, 40)),
    1e6: ((1000, 1000), (8, 32, 64, 64)),
    1e7: ((2500, 4000), (16, 64, 100, 100)),
    1e8: ((10_000, 10_000), (32, 128, 160, 160)),
}
FAULTS = ("row", "column", "channel", "element")


PERIOD = 1_000_003
"""A prime: past this many elements, the values are a block of this length repeated, whose period shares no factor
with any row, column or channel length, so nothing lines up with a fault (1e8 fresh normals take 1.8 s each)."""


def _normal(rng, shape) -> np.ndarray:
    if math.prod(shape) <= PERIOD:
        return rng.standard_normal(shape, dtype=np.float32)
    return np.resize(rng.standard_normal(PERIOD, dtype=np.float32), shape)


def _fault(shape2d, shape4d, kind, rng):
    # (oracle, backend, the fault's indices) with round-off everywhere and one structure off by far more.
    shape = shape4d if kind == "channel" else shape2d
    o = _normal(rng, shape)
    b = o + _normal(rng, shape) * np.float32(2e-7)
    where = _where(shape, kind)
    b[where] += np.float32(3e-3)
    return o, b, where


def _where(shape, kind):
    # The fault's indices: one row, one column, one channel (axis 1 of an NCHW output) or one element.
    return {
        "row": (shape[0] // 3, slice(None)),
        "column": (slice(None), shape[1] // 2 + 1),
        "channel": (slice(None), shape[1] // 2, slice(None), slice(None)),
        "element": tuple(d // 2 + 1 for d in shape),
    }[kind]


def _check_visible(drawn, pixels, scale: float, faulty: np.ndarray) -> None:
    # Every pooled cell holding a faulty element is drawn at the top of the colour scale, at least 3 pixels
    # wide and tall; the cells without one are far from it.
    hot = _pooled_mask(drawn, faulty)
    assert hot.any()
    top = top_colour(drawn.ax.images[0])
    height = pixels.shape[0]
    to_px = lambda y, x: drawn.ax.transData.transform((x, y)) * scale  # noqa: E731
    (x0, y0), (x1, y1) = to_px(-0.5, -0.5), to_px(0.5, 0.5)
    assert abs(x1 - x0) >= 3 and abs(y1 - y0) >= 3, "a pooled cell is under 3 pixels"
    shown = []
    for i, j in zip(*np.nonzero(hot), strict=True):
        px, py = to_px(i, j)
        shown.append(near(pixels[round(height - py), round(px)][None, :], top, tol=60)[0])
    # (the "worst" marker and its label may cover a few cells of a row or column; never most of them)
    assert np.mean(shown) >= 0.8, (np.mean(shown), len(shown))
    cold = [(i, j) for i, j in zip(*np.nonzero(~hot), strict=True)]
    sample = cold[:: max(1, len(cold) // 200)]
    far = [not near(pixels[round(height - to_px(i, j)[1]), round(to_px(i, j)[0])][None, :], top, tol=60)[0]
           for i, j in sample]  # fmt: skip
    assert np.mean(far) > 0.95


def _mask(shape, where) -> np.ndarray:
    grid = np.zeros(shape, np.float32)
    grid[where] = 1.0
    return grid


def _pooled_mask(drawn, mask: np.ndarray) -> np.ndarray:
    # Which pooled cells hold a faulty element: the mask folded like the output and max-pooled like the map.
    m = np.nan_to_num(drawn.fold.to_2d(mask), nan=0.0)
    fy, fx = drawn.factors
    h, w = drawn.pooled.shape
    padded = np.zeros((h * fy, w * fx), np.float32)
    padded[: m.shape[0], : m.shape[1]] = m
    return padded.reshape(h, fy, w, fx).max(axis=(1, 3)) > 0


@pytest.mark.parametrize("size", list(SHAPES))
@pytest.mark.parametrize("kind", FAULTS)
def test_a_bad_row_column_channel_or_element_is_visible_on_the_default_heatmap(size, kind):
    rng = np.random.default_rng(int(size) % 97 + len(kind))
    o, b, where = _fault(*SHAPES[size], kind, rng)
    drawn = heatmap(o, b)  # the defaults, as a user calls plot_heatmap
    pixels = rgba(drawn.ax.figure)
    _check_visible(drawn, pixels, 1.0, _mask(o.shape, where))
    import matplotlib.pyplot as plt

    plt.close(drawn.ax.figure)


def _faulty_backend(where):
    def run(model, inputs):
        out = model(*inputs).clone()
        out[where] += 3e-3
        return out

    return run


@pytest.mark.parametrize("size", [1e3, 1e5, 1e6])
@pytest.mark.parametrize("kind", FAULTS)
def test_the_reports_heatmap_and_the_explorers_first_view_show_the_fault(size, kind):
    shape2d, shape4d = SHAPES[size]
    shape = shape4d if kind == "channel" else shape2d
    where = _where(shape, kind)
    rlx_nb.register_backend("test-picture-fault", _faulty_backend(where), replace=True)
    try:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        report = rlx_nb.backend_divergence(torch.nn.GELU(), x, backends=["cpu-nomkldnn", "test-picture-fault"],
                                           progress=False)  # fmt: skip
    finally:
        rlx_nb.unregister_backend("test-picture-fault")
    assert report.suspects == ["test-picture-fault"]
    drawn = report.plot.heatmap_picture()  # the default: the suspect, its worst output, on the SUSPECT line's scale
    assert "SUSPECT line" in drawn.ax.images[0].colorbar.ax.get_ylabel()
    _check_visible(drawn, rgba(drawn.ax.figure), 1.0, _mask(shape, where))
    ex = rlx_nb.explore(report)
    assert ex.backend_picker.value == "test-picture-fault" and ex.metric_toggle.value == "line"
    png = base64.b64decode(ex.heatmap_out.outputs[0]["data"]["image/png"])
    pixels = (matplotlib.image.imread(io.BytesIO(png), format="png") * 255).astype(np.uint8)
    fig = ex._heatmap.ax.figure
    _check_visible(ex._heatmap, pixels, 80 / fig.dpi, _mask(shape, where))  # (the explorer's PNGs: 80 dpi)


# -- one colour language: red only for SUSPECT ---------------------------------------------------------------


def _reddish(colour) -> bool:
    r, g, b = matplotlib.colors.to_rgb(colour)
    return r > 0.55 and g < 0.35 and b < 0.35


@pytest.fixture(scope="module")
def mixed_report():
    from rlx_nb.models import demo

    model, inputs = demo.transformer()
    return rlx_nb.backend_divergence(
        model, inputs, backends=["cpu-nomkldnn", "onnxruntime", "cpu-bf16", "fault:softmax-row"], progress=False
    )


def test_no_legitimate_backend_is_drawn_red_and_the_suspect_is(mixed_report):
    from rlx_nb.plot.style import SUSPECT_COLOUR

    report = mixed_report
    legit = [b for b in report.results.candidates if b not in report.suspects]
    assert report.suspects == ["fault:softmax-row"] and legit
    drawn = {
        "histogram": [(p.get_label(), p.get_edgecolor()) for p in report.plot.histogram(metric="line").patches],
        "tolerance curve": [(line.get_label(), line.get_color()) for line in report.plot.tolerance_curve().lines],
    }
    bits = report.plot.effective_bits()
    drawn["effective bits"] = [
        (t.get_text(), p.get_facecolor()) for t, p in zip(bits.get_xticklabels(), bits.patches, strict=True)
    ]
    for plot, artists in drawn.items():
        for label, colour in artists:
            name = label.split(" (")[0]
            if name in legit:
                assert not _reddish(colour), (plot, name, colour)
            if name in report.suspects:
                assert matplotlib.colors.to_hex(colour) == SUSPECT_COLOUR, (plot, name, colour)


def test_the_baseline_plot_labels_its_points_and_reds_only_the_suspect_ones(mixed_report):
    moved = rlx_nb.compare_reports(mixed_report, mixed_report)
    ax = moved.plot()
    labels = [t.get_text() for t in ax.texts]
    assert any("fault:softmax-row" in t for t in labels) and any("cpu-nomkldnn" in t for t in labels)
    for collection in ax.collections:
        red = _reddish(collection.get_facecolor()[0])
        assert red == ("SUSPECT now" in collection.get_label()), collection.get_label()


def test_a_declared_reduced_precision_is_not_red_in_the_precision_sweep():
    from rlx_nb.plot.charts import plot_effective_bits

    sweep = rlx_nb.precision_sweep(torch.nn.Linear(64, 64), torch.randn(8, 64))
    rows = sweep.set_index("setting")
    assert rows.loc["autocast bf16", "verdict"] == "round-off" and rows.loc["autocast bf16", "closest_format"] == "bf16"
    ax = plot_effective_bits(dict(zip(sweep.setting, sweep.effective_bits, strict=True)),
                             verdicts=dict(zip(sweep.setting, sweep.verdict, strict=True)))  # fmt: skip
    for label, patch in zip(ax.get_xticklabels(), ax.patches, strict=True):
        assert _reddish(patch.get_facecolor()) == (rows.loc[label.get_text(), "verdict"] == "SUSPECT")


# -- the explorer opens where the error is -----------------------------------------------------------------


def test_without_suspects_the_explorer_opens_on_the_worst_backend_and_its_worst_element():
    from rlx_nb.models import demo

    model, inputs = demo.transformer()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "onnxruntime"], progress=False)
    assert not report.suspects
    ex = rlx_nb.explore(report)
    lines = {b: report.record(b).judgement.line for b in report.results.candidates}
    assert ex.backend_picker.value == max(lines, key=lines.get)
    frame = ex._elements
    assert (frame.abs_err > 0).all()  # no exact elements listed while others differ
    assert ex.selected_index == ex._heatmap.worst == report.record(ex.backend_picker.value).pair.worst_index
    ex.index_box.value = "1, 2, 3"
    assert ex.selected_index == (1, 2, 3) and ex.element_picker.value is None  # the old row no longer highlighted


def test_the_explorer_shows_a_static_snapshot_beside_the_live_widget(mixed_report):
    ex = rlx_nb.explore(mixed_report)
    snap = ex.snapshot()
    assert snap["image/png"] and "<img src='data:image/png;base64," in snap["text/html"]
    assert "fault:softmax-row" in snap["text/html"] and "rlx-elements" in snap["text/html"]
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    InteractiveShell.instance()
    with capture_output() as shown:
        from IPython.display import display

        display(ex)
    first, second = shown.outputs[:2]
    assert "image/png" in first.data and "text/html" in first.data
    assert "application/vnd.jupyter.widget-view+json" in second.data


# -- localize and the model's graph --------------------------------------------------------------------------


def _perturb(model, inputs):
    return model(*inputs) * (1 + 1e-4)


def test_localize_says_when_every_module_is_beyond_round_off():
    rlx_nb.register_backend("test-perturb-all", _perturb, replace=True)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        loc = rlx_nb.localize(model, torch.randn(8, 16), backend="test-perturb-all")
    finally:
        rlx_nb.unregister_backend("test-perturb-all")
    assert loc.everywhere and loc.culprit is None
    assert "every one of the 3 modules checked is beyond round-off" in loc.finding
    assert "no one module is the culprit" in loc._repr_html_()


def test_a_localization_exports_node_data_model_explorer_reads():
    model_explorer = pytest.importorskip("model_explorer")
    import json

    from model_explorer.pytorch_exported_program_adapter_impl import PytorchExportedProgramAdapterImpl

    from rlx_nb.models import demo

    model, inputs = demo.transformer()
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    path = loc.to_model_explorer(f"{__import__('tempfile').mkdtemp()}/nodes")
    data = json.loads(path.read_text())["graph"]
    program, _ = loc._exported(None, None, None)
    graph = PytorchExportedProgramAdapterImpl(program, {"const_element_count_limit": 16}).convert()["graphs"][0]
    nodes = {n.id: n for n in graph.nodes}
    assert data["results"] and set(data["results"]) <= set(nodes)  # every value on a node of Model Explorer's graph
    red = [k for k, v in data["results"].items() if v["value"] > 1]
    assert "softmax" in red and all(nodes[k].namespace.endswith("Attention_attn") for k in red)
    assert all(v["bgColor"] != "#b00020" for k, v in data["results"].items() if k not in red)
    config = model_explorer.config().add_model_from_pytorch("block", program).add_node_data_from_path(str(path))
    assert config.node_data_sources == [str(path)]


def test_the_small_items_a_short_backend_repr_an_honest_closing_line_and_a_legend_beside_the_bars(
    mixed_report, tmp_path
):
    backend = rlx_nb.register_backend("test-short-repr", lambda m, xs: m(*xs), replace=True)
    try:
        shown = repr(backend)
        assert len(shown) < 80 and "test-short-repr" in shown and "default" in shown  # not Backend(fn=..., ...)
    finally:
        rlx_nb.unregister_backend("test-short-repr")
    page = mixed_report.to_html(tmp_path / "r.html").read_text()
    assert "report.save(" in page and not (tmp_path / "r.rlxnb").exists()  # says how to write one, names none
    from rlx_nb.models import demo

    model, inputs = demo.transformer()
    ax = rlx_nb.localize(model, inputs, backend="fault:softmax-row").plot()
    fig = ax.figure
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1 - 1  # beside the axes: it covers no bar


def test_a_pooled_maps_ticks_read_the_element_indices_a_user_looks_up():
    # Pooled x4, a tick at cell 5 read "5" while the worst element, at column 22, is named by its own index:
    # the ticks now read the first element each cell holds, on the same scale as "worst (0, 22)".
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    oracle = rng.standard_normal((3, 512)).astype(np.float32)
    backend = oracle.copy()
    backend[1, 300] += 1.0
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    try:
        drawn = heatmap(oracle, backend, oracle.astype(np.float64), ax=ax)
        fig.canvas.draw()
        fy, fx = drawn.factors
        assert fx > 1 and fy == 1
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        values = [int(v) for v in labels]
        cells = [round(v) for v in ax.get_xticks() if 0 <= v < drawn.pooled.shape[1]]
        assert values and all(v % fx == 0 for v in values)
        assert max(values) > drawn.pooled.shape[1]  # (element indices, not pooled cells)
        assert [c * fx for c in cells] == [v for v in values if v // fx in cells]
        rows = [t.get_text() for t, v in zip(ax.get_yticklabels(), ax.get_yticks(), strict=True) if 0 <= v <= 2]
        assert rows == ["0", "1", "2"]  # rows: not pooled, their own indices
    finally:
        plt.close(fig)
