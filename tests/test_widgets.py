"""The explorer, driven headless through its widgets' traits."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

import rlx_nb
from rlx_nb.models import demo

# (one xdist worker for this file: its module-scoped fixtures are built once, not once per worker)
pytestmark = pytest.mark.xdist_group("widgets")


@pytest.fixture(scope="module")
def report():
    model, inputs = demo.transformer()
    return rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "fault:softmax-row"], backward=True)


def test_suspects_first_and_marked(report):
    ex = rlx_nb.explore(report)
    labels = [label for label, _ in ex.backend_picker.options]
    assert labels[0] == "⚠ fault:softmax-row (SUSPECT)"
    assert ex.backend_picker.value == "fault:softmax-row"
    # worst output first, marked
    assert ex.output_picker.options[0][0].startswith("⚠ ")
    assert ex.selected_index == report.elements("fault:softmax-row", ex.output_picker.value, top=1)["index"][0]


def test_changing_backend_updates_outputs_plots_and_table(report):
    ex = rlx_nb.explore(report)
    before_outputs = ex.output_picker.options
    before_map = ex.heatmap_data.copy()
    before_table = ex.table.value
    before_png = ex.heatmap_out.outputs[0]["data"]["image/png"]
    ex.backend_picker.set_state({"index": 1})  # the path a frontend update takes
    assert ex.backend_picker.value == "cpu-nomkldnn"
    assert ex.output_picker.options != before_outputs
    assert not any(label.startswith("⚠") for label, _ in ex.output_picker.options)
    assert (ex.heatmap_data.shape != before_map.shape) or (ex.heatmap_data != before_map).any()
    assert ex.table.value != before_table
    assert ex.heatmap_out.outputs[0]["data"]["image/png"] != before_png
    assert "backend (cpu-nomkldnn)" in ex.inspector.value
    assert ex.selected_index == report.record("cpu-nomkldnn", ex.output_picker.value).pair.worst_index


def test_metric_toggle_redraws_the_heatmap_and_the_histogram(report):
    ex = rlx_nb.explore(report)
    ex.output_picker.value = "out"
    assert ex.metric_toggle.value == "line"  # opens on the verdict's own scale, where every element shows
    assert ex.heatmap_data.max() > 1  # the faulty row, past the SUSPECT line
    budget_map, budget_hist = ex.heatmap_data.copy(), [h.copy() for h in ex.histogram_data]
    ex.metric_toggle.value = "abs"
    assert ex.heatmap_data.max() != budget_map.max()
    assert [h.tolist() for h in ex.histogram_data] != [h.tolist() for h in budget_hist]  # the histogram follows


def test_the_histogram_follows_the_picked_backend_and_the_picked_element_is_marked(report):
    ex = rlx_nb.explore(report)
    ex.output_picker.value = "out"
    before = ex.histogram_out.outputs[0]["data"]["image/png"]
    ex.backend_picker.value = "cpu-nomkldnn"
    ex.output_picker.value = "out"
    assert ex.histogram_out.outputs[0]["data"]["image/png"] != before
    ex.select((0, 1, 2))
    ring = [line for line in ex._heatmap_ax.lines if line.get_label() == "picked"]
    cell = ex._heatmap.fold.cell((0, 1, 2))
    factors = ex._heatmap.factors
    assert ring and ring[0].get_xydata().tolist() == [[cell[1] // factors[1], cell[0] // factors[0]]]


def test_element_inspector_from_picker_and_typed_index(report):
    ex = rlx_nb.explore(report)
    ex.output_picker.value = "out"
    second = ex.element_picker.options[1][1]
    ex.element_picker.value = second
    assert ex.selected_index == second
    assert "fp64 reference" in ex.inspector.value and "neighbourhood" in ex.inspector.value
    ex.index_box.value = "1, 2, 3"
    assert ex.selected_index == (1, 2, 3)
    o, _, _ = report.arrays(ex.backend_picker.value, "out")
    assert f"{float(o[1, 2, 3]):.9g}" in ex.inspector.value
    ex.index_box.value = "9, 9, 9"
    assert "is not inside the output" in ex.inspector.value


def test_click_selects_the_worst_element_of_the_block(report):
    ex = rlx_nb.explore(report)
    ex.output_picker.value = "out"
    ax = ex._heatmap_ax

    class Click:
        inaxes = ax
        xdata, ydata = 117.0 / ex._heatmap.factors[1], 0.0

    ex._on_click(Click())
    assert ex.selected_index[:2] == (0, 0)


def test_explore_needs_a_backend_that_ran():
    def broken(model, inputs):
        raise RuntimeError("no")

    rlx_nb.register_backend("test-widget-broken", broken, replace=True)
    r = rlx_nb.backend_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["test-widget-broken"])
    with pytest.raises(rlx_nb.RlxError, match="nothing to explore"):
        rlx_nb.explore(r)
    rlx_nb.unregister_backend("test-widget-broken")


def test_localization_view_picks_modules_and_draws_their_heatmaps():
    model, inputs = demo.layered(fault_layer=1)
    report = rlx_nb.backend_divergence(model, inputs, backends=["fault:softmax-row"])
    loc = report.localize()
    ex = rlx_nb.explore(report, localization=loc)
    assert ex.localization_bars.outputs[0]["data"]["image/png"]
    assert ex.module_picker.value == "blocks.1.attn :: F.softmax"  # the culprit shown first
    culprit_map = ex.module_heatmap_data.copy()
    ex.module_picker.value = "blocks.0"
    assert ex.module_heatmap_data.max() < culprit_map.max()
    # The module heatmap speaks the explorer's language: the SUSPECT line's scale and colours, a colour bar
    # label and a title (it was another colour map, unlabelled).
    drawn = loc.heatmap_picture("blocks.1.attn :: F.softmax")
    assert drawn.ax.images[0].get_cmap().name.startswith("coolwarm")
    assert "SUSPECT line" in drawn.ax.images[0].colorbar.ax.get_ylabel()
    assert drawn.ax.figure.axes[1].get_title().endswith("F.softmax (alone)")  # (over the profile above the map)
    # The module picker is as wide as its longest name (#46: it cut them), and the static copy a reader without a
    # kernel sees holds the localization view: its heading, bars, the module picked and its heatmap (#46: none).
    longest = max(len(label) for label, _ in ex.module_picker.options)
    assert ex.module_picker.layout.width == f"calc({longest + 4}ch + 8em)"
    snapshot = ex.snapshot()["text/html"]
    assert "Localization on fault:softmax-row: culprit <code>blocks.1.attn :: F.softmax</code>" in snapshot
    assert "module: <code>blocks.0</code>" in snapshot and snapshot.count("<img") >= 4
