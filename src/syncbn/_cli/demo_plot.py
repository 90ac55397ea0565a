"""The figure of ``syncbn demo``: loss and accuracy curves of the three runs.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend
change), so it works headless and leaves the caller's matplotlib state alone.
"""

from __future__ import annotations

from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["save_plot"]

# (colour, line width, line style, z-order): (c) is drawn wide and pale underneath, so
# that (b), drawn thin on top of it, stays visible where the two coincide.
_STYLES = {
    "plain_ddp": ("#d95f02", 1.8, "-", 3),
    "syncbn_ddp": ("#1b4f9c", 1.6, "-", 4),
    "single_process": ("#9ecae1", 7.0, "-", 2),
}


def _largest_difference(record: dict[str, Any]) -> float:
    difference = record["max_abs_diff_vs_single_process"]
    return float(max(difference["parameters"], difference["buffers"]))


def save_plot(results: dict[str, Any], path: str) -> None:
    """Write a PNG with the training-loss and test-accuracy curves of the demo's runs.

    Args:
        results: the demo's results (as in ``results.json``).
        path: the PNG file to write.
    """
    figure = Figure(figsize=(11, 5.0), dpi=110)
    FigureCanvasAgg(figure)
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    runs = results["runs"]
    for key, record in runs.items():
        colour, width, style, order = _STYLES[key]
        label = record["label"]
        if key == "single_process":
            label += "   (reference)"
        else:
            label += f"   max |diff| vs (c) = {_largest_difference(record):.1e}"
        curve = record["curve"]
        for axes, values in (
            (loss_axes, curve["train_loss"]),
            (accuracy_axes, [100 * value for value in curve["test_accuracy"]]),
        ):
            axes.plot(
                curve["step"],
                values,
                color=colour,
                linewidth=width,
                linestyle=style,
                zorder=order,
                label=label,
                solid_capstyle="round",
            )
    loss_axes.set_title("training loss (global batches, mean per interval)")
    loss_axes.set_ylabel("cross-entropy")
    accuracy_axes.set_title(f"held-out accuracy ({results['test_size']} test images)")
    accuracy_axes.set_ylabel("accuracy (%)")
    for axes in (loss_axes, accuracy_axes):
        axes.set_xlabel("optimizer step")
        axes.grid(True, which="major", alpha=0.3)
    handles, labels = loss_axes.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=1, frameon=False)
    # room for the legend below the axes (works with matplotlib >= 3.5)
    figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=0.27, wspace=0.2)
    config = results["config"]
    figure.suptitle(
        f"syncbn demo: digits, {config['nproc']} ranks \u00d7 {config['batch_per_proc']} per rank "
        f"vs 1 process \u00d7 {results['global_batch']}, {config['steps']} steps, "
        f"seed {config['seed']}, {config['dtype']}",
        fontsize=12,
    )
    figure.savefig(path, format="png")
