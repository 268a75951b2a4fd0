"""The command line's pictures, checked on their artists (issue 31): every accountant's line on
``epsilon --plot`` has its own style, and the log axis of ``noise --plot`` labels no two ticks on
top of each other."""

import pytest

from dptorch.accounting import epsilon_curve, get_noise_multiplier
from dptorch.cli import commands

pytest.importorskip("matplotlib")


def test_each_accountant_line_is_drawn_its_own_way_and_named():
    curves = {name: epsilon_curve(name, noise_multiplier=1.0, sample_rate=0.01, steps=200, delta=1e-5, points=9)
              for name in ("pld", "prv", "rdp", "gdp")}
    figure = commands.curves_figure(curves, sigma=1.0, q=0.01, delta=1e-5)
    lines = figure.axes[0].get_lines()
    styles = [(line.get_linestyle(), line.get_marker(), line.get_linewidth()) for line in lines]
    assert len(set(styles)) == len(lines) == 4, styles
    pld, prv = lines[0], lines[1]
    # PRV lies on PLD: it is drawn after it, thinner, dashed, with markers, so both show
    assert prv.get_linewidth() < pld.get_linewidth() and prv.get_linestyle() != pld.get_linestyle()
    assert prv.get_marker() not in (None, "None", "")
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["pld", "prv", "rdp", "gdp approximation, not a bound"]


@pytest.mark.parametrize("target", [0.3, 3.0])
def test_the_noise_plot_labels_its_log_axis_without_overlap(target):
    from matplotlib.ticker import NullFormatter

    sigma = get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=0.01, steps=100)
    figure = commands.noise_figure("pld", shown=sigma, epsilon=target, target=target, q=0.01, steps=100, delta=1e-5)
    figure.canvas.draw()
    axes, renderer = figure.axes[0], figure.canvas.get_renderer()
    assert isinstance(axes.xaxis.get_minor_formatter(), NullFormatter)
    low, high = axes.get_xlim()
    ticks = [t for t in axes.xaxis.get_major_ticks() + axes.xaxis.get_minor_ticks()
             if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()]
    boxes = sorted((t.label1.get_window_extent(renderer) for t in ticks), key=lambda box: box.x0)
    assert len(boxes) >= 2  # the axis is labelled at all
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:])), [t.label1.get_text() for t in ticks]
