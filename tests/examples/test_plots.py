"""Recording and showing a run: histories, the closing report, the pictures."""

import math

import pytest

from dptorch.cli.examples.plots import format_report
from dptorch.cli.plots import RunHistory, moving_average, save_pictures

pytest.importorskip("matplotlib")


def test_moving_average_is_trailing_and_skips_steps_without_a_loss():
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([1.0, math.nan, 3.0], window=3) == [1.0, 1.0, 2.0]
    assert moving_average([2.0] * 30) == [2.0] * 30  # default window: a tenth of the run


def test_history_keeps_only_what_the_run_has():
    history = RunHistory("non-private")
    history.record(loss=0.5)
    history.record(loss=0.4, epsilon=None, clipped_fraction=None)
    assert history.steps == 2 and history.epsilon == [] and history.clipped_fraction == []


def test_pictures_are_png_files(tmp_path):
    private, non_private = RunHistory("private"), RunHistory("non-private")
    for step in range(1, 21):
        private.record(loss=1 / step + 0.3, epsilon=0.4 * math.sqrt(step), clipped_fraction=1 / step)
        non_private.record(loss=1 / step)
    paths = save_pictures(str(tmp_path / "pictures"), private, non_private, delta=1e-5, target_epsilon=2.0)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["epsilon.png", "loss.png", "clipped_fraction.png"]
    for epoch in range(3):
        private.record_test_accuracy(epoch, 0.5 + 0.1 * epoch)
    paths = save_pictures(str(tmp_path / "pictures"), private, delta=1e-5)  # a loop without a baseline
    assert [p.rsplit("/", 1)[1] for p in paths] == ["epsilon.png", "loss.png", "test_accuracy.png",
                                                    "clipped_fraction.png"]
    for path in paths:
        with open(path, "rb") as picture:
            assert picture.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_lines_name_accuracy_privacy_and_time():
    report = dict(
        private_accuracy=0.8761, non_private_accuracy=0.94, test_size=500, epsilon=7.94, delta=1e-5,
        accountant="pld", noise_multiplier=0.676, steps=48, sample_rate=0.064, per_sample_max_grad_norm=1.0,
        total_seconds=120.0, private_seconds=60.0, non_private_seconds=50.0,
    )
    assert format_report(report).splitlines() == [
        "accuracy: private 0.876, non-private 0.940 (test set of 500)",
        "privacy: epsilon 7.94 at delta 1e-05 (pld accountant), noise multiplier 0.676, 48 steps, "
        "sample rate 0.0640, max grad norm 1",
        "wall time: 120.0 s (private training 60.0 s, non-private 50.0 s)",
    ]


def test_report_without_the_baseline_and_with_the_mode():
    report = dict(
        private_accuracy=0.8761, non_private_accuracy=None, test_size=500, epsilon=7.94, delta=1e-5,
        accountant="pld", noise_multiplier=0.676, steps=48, sample_rate=0.064, max_grad_norm=1.0,
        grad_sample_mode="bk", total_seconds=70.0, private_seconds=60.0, non_private_seconds=None,
        pictures=["demo-pictures/epsilon.png", "demo-pictures/loss.png"],
    )
    assert format_report(report).splitlines() == [
        "accuracy: private 0.876, non-private not run (--no-baseline) (test set of 500)",
        "privacy: epsilon 7.94 at delta 1e-05 (pld accountant), noise multiplier 0.676, 48 steps, "
        "sample rate 0.0640, max grad norm 1, per-sample gradients bk",
        "wall time: 70.0 s (private training 60.0 s)",
        "pictures in demo-pictures/: epsilon.png, loss.png",
    ]


def test_the_loss_picture_explains_the_private_curve_and_draws_without_a_baseline(tmp_path, monkeypatch):
    from dptorch.cli import plots

    texts = []
    monkeypatch.setattr(plots, "_save", lambda figure, path: texts.extend(t.get_text() for t in figure.texts))
    private = RunHistory("private")
    for step in range(1, 11):
        private.record(loss=0.5 + 0.1 * math.sin(step), epsilon=step / 10, clipped_fraction=0.5)
    plots.plot_loss(private, RunHistory("non-private"), str(tmp_path / "loss.png"))
    assert any("it is not diverging" in text for text in texts)


def test_the_clipped_fraction_legend_names_both_series(tmp_path, monkeypatch):
    from dptorch.cli import plots

    legends = []
    monkeypatch.setattr(plots, "_save", lambda figure, path: legends.extend(
        text.get_text() for text in figure.axes[0].get_legend().get_texts()))
    private = RunHistory("private")
    for step in range(1, 31):
        private.record(loss=0.5, epsilon=step / 10, clipped_fraction=1 / step)
    plots.plot_clipped_fraction(private, str(tmp_path / "clipped.png"))
    assert legends == ["each step", "moving average (3 steps)"]


def test_the_accuracy_picture_draws_each_run_that_recorded_one(tmp_path, monkeypatch):
    from dptorch.cli import plots

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda figure, path: drawn.extend(
        (line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in figure.axes[0].get_lines()))
    private, non_private = RunHistory("private"), RunHistory("non-private")
    for epoch, (a, b) in enumerate([(0.5, 0.5), (0.7, 0.9), (0.8, 0.95)]):
        private.record_test_accuracy(epoch, a)
        non_private.record_test_accuracy(epoch, b)
    plots.plot_test_accuracy(private, non_private, str(tmp_path / "accuracy.png"))
    assert drawn == [("non-private", [0.0, 1.0, 2.0], [0.5, 0.9, 0.95]), ("private", [0.0, 1.0, 2.0], [0.5, 0.7, 0.8])]
