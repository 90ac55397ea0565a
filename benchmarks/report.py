"""Pure helpers of the benchmark suite: floors, ratios, verdicts and the markdown report.

Nothing here runs a benchmark; everything takes the raw numbers that ``suite.py``
measured (a JSON-like dict) and derives what ``results.md`` shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "CATEGORIES",
    "TARGETS",
    "categorize",
    "collective_summary",
    "derive",
    "derive_layer",
    "derive_model",
    "floors",
    "miss_factor",
    "render_markdown",
    "verdict",
]

#: Target limits of issue 5 (ratios; "at least" for the speed-up, "at most" otherwise).
TARGETS = {
    "compute_vs_batchnorm": 1.0,
    "compute_vs_batchnorm_float32_contiguous": 0.6,
    "compute_vs_traffic_floor_float32": 2.5,
    "speedup_vs_reference": 1.5,
    "model_overhead_vs_latency_floor": 1.5,
}

#: Profile categories: (category, substrings of aten op names), first match wins.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collectives", ("allreduce", "all_reduce", "gloo", "nccl", "barrier", "c10d")),
    ("host reads", ("aten::item", "aten::_local_scalar_dense")),
    ("native_batch_norm_backward", ("aten::native_batch_norm_backward",)),
    (
        "batch_norm forward kernel",
        ("aten::native_batch_norm", "aten::batch_norm", "aten::_batch_norm_impl_index", "legit"),
    ),
    ("addcmul", ("aten::addcmul",)),
    (
        "sub/square/sum",
        ("aten::sub", "aten::square", "aten::pow", "aten::sum"),
    ),
    ("dtype conversions / copies", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone")),
    (
        "allocations",
        ("aten::empty", "aten::zeros", "aten::new_zeros", "aten::fill_", "aten::zero_"),
    ),
)
OTHER = "other (small per-channel ops, autograd, Python)"

#: Bytes that must move, in units of the input's size: forward reads x twice (statistics,
#: normalization) and writes y; backward reads x and dy twice (reductions, input gradient)
#: and writes dx.
FORWARD_PASSES = 3
BACKWARD_PASSES = 5


def verdict(value: float | None, limit: float | None, at_least: bool = False) -> str:
    """``PASS`` if ``value`` meets ``limit`` (``<=``, or ``>=`` if ``at_least``), else ``MISS``.

    Returns ``n/a`` when either is missing.
    """
    if value is None or limit is None:
        return "n/a"
    met = value >= limit if at_least else value <= limit
    return "PASS" if met else "MISS"


def miss_factor(value: float, limit: float, at_least: bool = False) -> float:
    """How far ``value`` is from ``limit`` as a factor (> 1 means missed by that factor)."""
    return limit / value if at_least else value / limit


def floors(copy_s: float, nbytes: int) -> dict[str, float]:
    """Memory-traffic floors from the time of one copy of a tensor of ``nbytes`` bytes.

    A copy moves ``2 * nbytes`` (read and write), so the bandwidth is
    ``2 * nbytes / copy_s``; the forward floor moves 3 tensor sizes, the backward 5.
    """
    bandwidth = 2 * nbytes / copy_s
    return {
        "bandwidth_gbps": bandwidth / 1e9,
        "forward_s": FORWARD_PASSES * nbytes / bandwidth,
        "backward_s": BACKWARD_PASSES * nbytes / bandwidth,
        "forward_backward_s": (FORWARD_PASSES + BACKWARD_PASSES) * nbytes / bandwidth,
    }


def derive_layer(case: dict[str, Any]) -> dict[str, Any]:
    """Ratios and verdicts of one per-layer case from its measured median times."""
    t = case["times_s"]
    floor = floors(t["copy"], case["bytes"])
    latency_fwd, latency_bwd = t["all_reduce.forward"], t["all_reduce.backward"]
    compute_fwd = t["syncbn.forward"] - latency_fwd
    compute = t["syncbn.forward_backward"] - latency_fwd - latency_bwd
    float32 = case["dtype"] == "float32"
    contiguous = case["memory_format"] == "contiguous"
    bn_limit = (
        TARGETS["compute_vs_batchnorm_float32_contiguous"]
        if float32 and contiguous
        else TARGETS["compute_vs_batchnorm"]
    )
    floor_limit = TARGETS["compute_vs_traffic_floor_float32"] if float32 else None
    vs_bn = compute / t["batchnorm.forward_backward"]
    vs_floor = compute / floor["forward_backward_s"]
    speedup = t["reference.forward_backward"] / t["syncbn.forward_backward"]
    row = {
        "shape": case["shape"],
        "dtype": case["dtype"],
        "memory_format": case["memory_format"],
        "batchnorm_s": t["batchnorm.forward_backward"],
        "syncbn_s": t["syncbn.forward_backward"],
        "reference_s": t["reference.forward_backward"],
        "latency_s": latency_fwd + latency_bwd,
        "syncbn_compute_s": compute,
        "traffic_floor_s": floor["forward_backward_s"],
        "bandwidth_gbps": floor["bandwidth_gbps"],
        "compute_vs_batchnorm": vs_bn,
        "compute_vs_batchnorm_limit": bn_limit,
        "compute_vs_batchnorm_verdict": verdict(vs_bn, bn_limit),
        "compute_vs_floor": vs_floor,
        "compute_vs_floor_limit": floor_limit,
        "compute_vs_floor_verdict": verdict(vs_floor, floor_limit),
        "speedup_vs_reference": speedup,
        "speedup_vs_reference_verdict": verdict(
            speedup, TARGETS["speedup_vs_reference"], at_least=True
        ),
        "forward": {
            "batchnorm_s": t["batchnorm.forward"],
            "syncbn_s": t["syncbn.forward"],
            "reference_s": t["reference.forward"],
            "latency_s": latency_fwd,
            "syncbn_compute_s": compute_fwd,
            "traffic_floor_s": floor["forward_s"],
            "compute_vs_batchnorm": compute_fwd / t["batchnorm.forward"],
            "compute_vs_floor": compute_fwd / floor["forward_s"],
            "speedup_vs_reference": t["reference.forward"] / t["syncbn.forward"],
        },
        "layer_order_check_s": t["syncbn.forward_backward"]
        - t["syncbn_unchecked.forward_backward"],
        "layer_order_check_cpu_s": (
            case["cpu_s"]["syncbn.forward_backward"]
            - case["cpu_s"]["syncbn_unchecked.forward_backward"]
            if case.get("cpu_s")
            else None
        ),
        "noise_iqr_s": case.get("iqr_s", {}).get("syncbn.forward_backward"),
    }
    if "torch_syncbn.forward_backward" in t:
        row["torch_syncbn_s"] = t["torch_syncbn.forward_backward"]
        row["speedup_vs_torch_syncbn"] = t["torch_syncbn.forward_backward"] / row["syncbn_s"]
    phases = {
        name.split(":", 1)[1]: value for name, value in t.items() if name.startswith("syncbn:")
    }
    if phases:
        row["phases_s"] = phases
        row["rest_s"] = compute - sum(phases.values())
    if case.get("cpu_s"):
        c = case["cpu_s"]
        cpu_compute = (
            c["syncbn.forward_backward"] - c["all_reduce.forward"] - c["all_reduce.backward"]
        )
        cpu_phases = sum(v for name, v in c.items() if name.startswith("syncbn:"))
        row["cpu"] = {
            "batchnorm_s": c["batchnorm.forward_backward"],
            "syncbn_s": c["syncbn.forward_backward"],
            "reference_s": c["reference.forward_backward"],
            "collectives_s": c["all_reduce.forward"] + c["all_reduce.backward"],
            "syncbn_compute_s": cpu_compute,
            "compute_vs_batchnorm": cpu_compute / c["batchnorm.forward_backward"],
            "reference_vs_syncbn": c["reference.forward_backward"] / c["syncbn.forward_backward"],
            "phases_s": cpu_phases if phases else None,
            "rest_s": cpu_compute - cpu_phases if phases else None,
        }
    if case.get("best_s"):
        best = derive_layer({**case, "times_s": case["best_s"], "best_s": None, "cpu_s": None})
        row["best"] = {
            key: best[key]
            for key in (
                "batchnorm_s",
                "syncbn_s",
                "latency_s",
                "syncbn_compute_s",
                "compute_vs_batchnorm",
                "compute_vs_floor",
                "speedup_vs_reference",
            )
        }
    return row


def derive_model(model: dict[str, Any]) -> dict[str, Any]:
    """Whole-model overheads of SyncBatchNorm over BatchNorm against the latency floor."""
    t = model["times_s"]
    floor = sum(t[f"all_reduce.{nbytes}"] for nbytes in model["syncbn_collective_bytes"])
    limit = TARGETS["model_overhead_vs_latency_floor"]
    row: dict[str, Any] = {"batchnorm_step_s": t["batchnorm"], "latency_floor_s": floor}
    cpu = model.get("cpu_s") or {}
    row["batchnorm_cpu_s"] = cpu.get("batchnorm")
    for variant in ("syncbn", "syncbn_own_group"):
        if variant not in t:
            continue
        overhead = t[variant] - t["batchnorm"]
        row[variant] = {
            "step_s": t[variant],
            "cpu_s": cpu.get(variant),
            "overhead_s": overhead,
            "overhead_vs_floor": overhead / floor,
            "verdict": verdict(overhead / floor, limit),
        }
    return row


def _phase_summary(entries: list[list[Any]]) -> tuple[int, int]:
    return len(entries), sum(int(nbytes) for _name, nbytes in entries)


def collective_summary(
    by_world_size: dict[str, list[list[dict[str, Any]]]],
) -> list[dict[str, Any]]:
    """Collectives and bytes per layer call, per world size; ``identical`` over ranks and sizes.

    Args:
        by_world_size: for each world size (as a string), every rank's rows from
            ``collectives_rank``.
    """
    table: dict[tuple[str, ...], dict[str, Any]] = {}
    for world_size, ranks in sorted(by_world_size.items(), key=lambda item: int(item[0])):
        for rank_rows in ranks:
            for row in rank_rows:
                key = (
                    "x".join(map(str, row["shape"])),
                    row["dtype"],
                    row["memory_format"],
                    row["layer"],
                )
                entry = table.setdefault(
                    key,
                    {
                        "shape": row["shape"],
                        "dtype": row["dtype"],
                        "memory_format": row["memory_format"],
                        "layer": row["layer"],
                        "per_world_size": {},
                    },
                )
                counts = _phase_summary(row["forward"]) + _phase_summary(row["backward"])
                entry["per_world_size"].setdefault(world_size, []).append(counts)
    result = []
    for entry in table.values():
        seen = {counts for per_rank in entry["per_world_size"].values() for counts in per_rank}
        first = next(iter(entry["per_world_size"].values()))[0]
        entry["collectives_forward"], entry["bytes_forward"] = first[0], first[1]
        entry["collectives_backward"], entry["bytes_backward"] = first[2], first[3]
        entry["identical"] = len(seen) == 1
        result.append(entry)
    return result


def derive(results: dict[str, Any]) -> dict[str, Any]:
    """Everything ``results.md`` reports, derived from the raw measurements."""
    derived: dict[str, Any] = {}
    targets = []
    if "layers" in results:
        rows = [derive_layer(case) for case in results["layers"]["cases"]]
        derived["layers"] = rows

        def worst(
            key: str, selected: Iterable[dict[str, Any]], limit: float, at_least: bool = False
        ) -> None:
            values = [(row[key], row) for row in selected]
            if not values:
                return
            value, row = (min if at_least else max)(values, key=lambda item: item[0])
            misses = sum(verdict(v, limit, at_least) == "MISS" for v, _ in values)
            targets.append(
                {
                    "target": key,
                    "limit": limit,
                    "at_least": at_least,
                    "worst": value,
                    "worst_case": _case_label(row),
                    "misses": misses,
                    "cases": len(values),
                    "verdict": "PASS" if misses == 0 else "MISS",
                }
            )

        f32 = [row for row in rows if row["dtype"] == "float32"]
        f32_contiguous = [row for row in f32 if row["memory_format"] == "contiguous"]
        worst("compute_vs_batchnorm", rows, TARGETS["compute_vs_batchnorm"])
        worst(
            "compute_vs_batchnorm",
            f32_contiguous,
            TARGETS["compute_vs_batchnorm_float32_contiguous"],
        )
        worst("compute_vs_floor", f32, TARGETS["compute_vs_traffic_floor_float32"])
        worst("speedup_vs_reference", rows, TARGETS["speedup_vs_reference"], at_least=True)
    if "model" in results:
        derived["model"] = derive_model(results["model"])
        entry = derived["model"]["syncbn"]
        targets.append(
            {
                "target": "model_overhead_vs_latency_floor",
                "limit": TARGETS["model_overhead_vs_latency_floor"],
                "at_least": False,
                "worst": entry["overhead_vs_floor"],
                "worst_case": "SmallResNet step, SyncBN on the default group",
                "misses": int(entry["verdict"] == "MISS"),
                "cases": 1,
                "verdict": entry["verdict"],
            }
        )
    if "collectives" in results:
        summary = collective_summary(results["collectives"])
        derived["collectives"] = summary
        syncbn_rows = [row for row in summary if row["layer"] == "syncbn"]
        misses = sum(not row["identical"] for row in syncbn_rows)
        targets.append(
            {
                "target": "syncbn_bytes_identical_over_world_sizes",
                "limit": None,
                "at_least": False,
                "worst": None,
                "worst_case": "",
                "misses": misses,
                "cases": len(syncbn_rows),
                "verdict": "PASS" if misses == 0 else "MISS",
            }
        )
    if "memory" in results:
        memory = []
        for case in results["memory"]["cases"]:
            saved_ok = case["syncbn"]["saved_bytes"] <= case["batchnorm"]["saved_bytes"]
            memory.append({**case, "saved_verdict": "PASS" if saved_ok else "MISS"})
        derived["memory"] = memory
        misses = sum(row["saved_verdict"] == "MISS" for row in memory)
        targets.append(
            {
                "target": "saved_bytes_not_more_than_batchnorm",
                "limit": None,
                "at_least": False,
                "worst": None,
                "worst_case": "",
                "misses": misses,
                "cases": len(memory),
                "verdict": "PASS" if misses == 0 else "MISS",
            }
        )
    derived["targets"] = targets
    return derived


def categorize(ops: list[dict[str, Any]]) -> dict[str, float]:
    """Self time per iteration (us) summed into :data:`CATEGORIES`."""
    totals: dict[str, float] = {}
    for op in ops:
        name = op["name"]
        category = next(
            (label for label, keys in CATEGORIES if any(k in name for k in keys)), OTHER
        )
        totals[category] = totals.get(category, 0.0) + op["self_us"]
    return totals


# --------------------------------------------------------------------------- markdown


def _case_label(row: dict[str, Any]) -> str:
    shape = "x".join(map(str, row["shape"]))
    fmt = "CL" if row["memory_format"] == "channels_last" else "contig"
    return f"{shape} {row['dtype']} {fmt}"


def _ms(seconds: float | None, digits: int = 3) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.0f}"


def _ratio(value: float | None, verdict_text: str | None = None) -> str:
    if value is None:
        return ""
    text = f"{value:.2f}x"
    return f"{text} {verdict_text}" if verdict_text and verdict_text != "n/a" else text


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _describe_target(target: dict[str, Any]) -> str:
    names = {
        "compute_vs_batchnorm": "SyncBN compute / BatchNorm, forward+backward",
        "compute_vs_floor": "SyncBN compute / memory-traffic floor, forward+backward, float32",
        "speedup_vs_reference": "reference SyncBN time / SyncBN time, forward+backward",
        "model_overhead_vs_latency_floor": "whole-model SyncBN overhead / collective-latency floor",
        "syncbn_bytes_identical_over_world_sizes": "bytes per collective identical, world 2/3/4",
        "saved_bytes_not_more_than_batchnorm": "bytes saved for backward <= BatchNorm's",
    }
    text = names.get(target["target"], target["target"])
    if target["target"] == "compute_vs_batchnorm":
        scope = "float32 contiguous" if target["limit"] < 1.0 else "all cases"
        text += f" ({scope})"
    return text


def _limit_text(target: dict[str, Any]) -> str:
    if target["limit"] is None:
        return "yes"
    return f"{'>=' if target['at_least'] else '<='} {target['limit']:g}x"


def render_markdown(results: dict[str, Any], derived: dict[str, Any]) -> str:
    """The whole ``results.md`` text."""
    machine = results["machine"]
    settings = results["settings"]
    out = [
        "# syncbn benchmark results",
        "",
        f"Generated by `{results['command']}` on {machine['date']} in "
        f"{results['wall_s']:.0f} s. Raw numbers: `results.json` (same directory).",
        "",
        f"- Machine: {machine['cpu']}, {machine['cpu_count']} cores, "
        f"{machine['memory_gib']} GiB, {machine['platform']}"
        + (f", GPU {machine['cuda']}" if machine.get("cuda") else ""),
        f"- Software: Python {machine['python']}, torch {machine['torch']}, "
        f"syncbn {machine['syncbn']}"
        + (f" (git {results['git']})" if results.get("git") else "")
        + (f", imported from `{results['syncbn_path']}`" if results.get("syncbn_path") else ""),
        f"- Ranks: {settings['world_size']} {settings['backend']} ranks on {settings['device']}, "
        "spawned by torch.multiprocessing, `file://` rendezvous, "
        "`torch.set_num_threads(1)` per rank",
        f"- Timing: every measurement runs on all ranks together; per case all variants are "
        f"interleaved, {settings['repeats']} timed blocks each of at least "
        f"{settings['min_block_time'] * 1e3:g} ms (same call count on every rank, barrier "
        f"before each block, {settings['warmup']} warm-up calls, GC off); a variant's time is "
        "the maximum over ranks of each rank's median per-call time",
        f"- Load average (1/5/15 min) at start {machine.get('load_average')}, at end "
        f"{results.get('load_average_end')}"
        + (
            " — **the machine was shared and busy during this run: treat the numbers as "
            "noisy and rerun on a quiet machine before drawing fine conclusions**"
            if _busy(machine, results)
            else ""
        ),
        "",
        "Definitions: *collectives* = median latency of all_reduces of the float64 payloads "
        "that SyncBatchNorm sends (counted in the same run: see 'Collectives per layer call'), "
        "measured alone in the same run; "
        "*SyncBN compute* = SyncBatchNorm time minus that latency; *traffic floor* = bytes "
        "that must move (forward: read x twice, write y; backward: read x and dy twice, write "
        "dx; 8 tensor sizes in all) divided by the bandwidth of copying a tensor of the same "
        "size, dtype and layout in the same run; *reference* = the straightforward SyncBN of "
        "`reference_syncbn.py` (autograd through an all_reduce of sum and sum of squares). "
        "Times are per layer call on one rank's local batch of the given shape.",
        "",
    ]
    out += _targets_section(derived)
    if "layers" in derived:
        out += _layers_section(results, derived)
    if "model" in derived:
        out += _model_section(results, derived)
    if "collectives" in derived:
        out += _collectives_section(derived)
    if "memory" in derived:
        out += _memory_section(derived)
    if "profiles" in results or "blocks" in results or "layers" in derived:
        out += _profile_section(results, derived)
    out += _misses_section(results, derived)
    return "\n".join(out) + "\n"


def _busy(machine: dict[str, Any], results: dict[str, Any]) -> bool:
    loads = [machine.get("load_average"), results.get("load_average_end")]
    cores = machine.get("cpu_count") or 1
    # the benchmark itself keeps `world_size` cores busy; more than that is someone else
    own = results["settings"]["world_size"]
    return any(
        load is not None and load[0] > own + 0.5 and load[0] > 0.75 * cores for load in loads
    )


def _targets_section(derived: dict[str, Any]) -> list[str]:
    rows = []
    for target in derived["targets"]:
        worst = (
            "" if target["worst"] is None else f"{target['worst']:.2f}x ({target['worst_case']})"
        )
        rows.append(
            [
                _describe_target(target),
                _limit_text(target),
                worst,
                f"{target['cases'] - target['misses']}/{target['cases']}",
                f"**{target['verdict']}**",
            ]
        )
    return [
        "## Targets",
        "",
        *_table(["target", "limit", "worst case", "cases passing", "verdict"], rows),
        "",
    ]


def _layers_section(results: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    out = ["## Per layer: forward+backward", ""]
    note = results["layers"].get("torch_syncbn")
    if note:
        out += [f"torch.nn.SyncBatchNorm: {note}.", ""]
    header = [
        "shape",
        "format",
        "BatchNorm ms",
        "SyncBN ms",
        "collectives ms",
        "SyncBN compute ms",
        "reference ms",
        "traffic floor ms",
        "compute / BN",
        "compute / floor",
        "vs reference",
    ]
    has_torch = any("torch_syncbn_s" in row for row in derived["layers"])
    if has_torch:
        header += ["torch SyncBN ms", "vs torch SyncBN"]
    for dtype in ("float32", "bfloat16"):
        rows = [row for row in derived["layers"] if row["dtype"] == dtype]
        if not rows:
            continue
        out += [f"### {dtype}" + (" input, float32 parameters" if dtype != "float32" else ""), ""]
        lines = []
        for row in rows:
            line = [
                "x".join(map(str, row["shape"])),
                "channels_last" if row["memory_format"] == "channels_last" else "contiguous",
                _ms(row["batchnorm_s"]),
                _ms(row["syncbn_s"]),
                _ms(row["latency_s"]),
                _ms(row["syncbn_compute_s"]),
                _ms(row["reference_s"]),
                _ms(row["traffic_floor_s"]),
                _ratio(row["compute_vs_batchnorm"], row["compute_vs_batchnorm_verdict"])
                + f" (<= {row['compute_vs_batchnorm_limit']:g})",
                _ratio(row["compute_vs_floor"], row["compute_vs_floor_verdict"]),
                _ratio(row["speedup_vs_reference"], row["speedup_vs_reference_verdict"]),
            ]
            if has_torch:
                line += [_ms(row.get("torch_syncbn_s")), _ratio(row.get("speedup_vs_torch_syncbn"))]
            lines.append(line)
        out += [*_table(header, lines), ""]
    out += [
        "## Per layer: forward only",
        "",
        *_table(
            [
                "case",
                "BatchNorm ms",
                "SyncBN ms",
                "collective ms",
                "SyncBN compute ms",
                "reference ms",
                "traffic floor ms",
                "compute / BN",
                "compute / floor",
                "vs reference",
            ],
            [
                [
                    _case_label(row),
                    _ms(row["forward"]["batchnorm_s"]),
                    _ms(row["forward"]["syncbn_s"]),
                    _ms(row["forward"]["latency_s"]),
                    _ms(row["forward"]["syncbn_compute_s"]),
                    _ms(row["forward"]["reference_s"]),
                    _ms(row["forward"]["traffic_floor_s"]),
                    _ratio(row["forward"]["compute_vs_batchnorm"]),
                    _ratio(row["forward"]["compute_vs_floor"]),
                    _ratio(row["forward"]["speedup_vs_reference"]),
                ]
                for row in derived["layers"]
            ],
        ),
        "",
        "## Floors and the layer-order check",
        "",
        "Copy bandwidth (both ranks copying at once), collective latency, and the cost of "
        "`check_layer_order` (SyncBN forward+backward with `check_layer_order=True` minus "
        "`False`: on CPU the check is a small host read of the all-reduced header and a "
        "comparison; negative values are noise), in wall-clock time and in main-thread CPU "
        "time (which waiting does not disturb). Noise = interquartile range of SyncBN's "
        "forward+backward blocks.",
        "",
        *_table(
            [
                "case",
                "copy GB/s",
                "all_reduce fwd+bwd us",
                "layer-order check us",
                "layer-order check CPU us",
                "noise (IQR) us",
            ],
            [
                [
                    _case_label(row),
                    f"{row['bandwidth_gbps']:.1f}",
                    _us(row["latency_s"]),
                    _us(row["layer_order_check_s"])
                    + (" (within noise)" if _within_noise(row) else ""),
                    _us(row["layer_order_check_cpu_s"]),
                    _us(row["noise_iqr_s"]),
                ]
                for row in derived["layers"]
            ],
        ),
        "",
    ]
    best_rows = [row for row in derived["layers"] if "best" in row]
    if best_rows:
        out += [
            "## Per layer: ratios from the fastest blocks",
            "",
            "The same forward+backward ratios computed from each variant's fastest timed block "
            "instead of its median (maximum over ranks of each rank's fastest block): closer to "
            "what a quiet machine shows when the run was disturbed by other load. The verdicts "
            "above use the medians.",
            "",
            *_table(
                [
                    "case",
                    "BatchNorm ms",
                    "SyncBN ms",
                    "collectives ms",
                    "SyncBN compute ms",
                    "compute / BN",
                    "compute / floor",
                    "vs reference",
                ],
                [
                    [
                        _case_label(row),
                        _ms(row["best"]["batchnorm_s"]),
                        _ms(row["best"]["syncbn_s"]),
                        _ms(row["best"]["latency_s"]),
                        _ms(row["best"]["syncbn_compute_s"]),
                        _ratio(row["best"]["compute_vs_batchnorm"]),
                        _ratio(row["best"]["compute_vs_floor"]),
                        _ratio(row["best"]["speedup_vs_reference"]),
                    ]
                    for row in best_rows
                ],
            ),
            "",
        ]
    cpu_rows = [row for row in derived["layers"] if "cpu" in row]
    if cpu_rows:
        out += [
            "## Per layer: main-thread CPU time",
            "",
            "CPU time of each rank's calling thread per forward+backward (`time.thread_time`, "
            "median, maximum over ranks): the work the layer itself does, without waiting for "
            "the other rank, for the collectives (gloo waits without spinning) or for a CPU "
            "taken by other processes, so it is the view least disturbed by a busy machine. "
            "*SyncBN compute* subtracts the CPU time of issuing its collectives alone; "
            "*steps* = its large-tensor steps (next section), *rest* = compute minus steps: "
            "the fixed per-call cost of small ops, packing, Python and autograd.",
            "",
            *_table(
                [
                    "case",
                    "BatchNorm ms",
                    "SyncBN ms",
                    "collectives ms",
                    "SyncBN compute ms",
                    "compute / BN",
                    "steps ms",
                    "rest ms",
                    "reference ms",
                    "reference / SyncBN",
                ],
                [
                    [
                        _case_label(row),
                        _ms(row["cpu"]["batchnorm_s"]),
                        _ms(row["cpu"]["syncbn_s"]),
                        _ms(row["cpu"]["collectives_s"]),
                        _ms(row["cpu"]["syncbn_compute_s"]),
                        _ratio(row["cpu"]["compute_vs_batchnorm"]),
                        _ms(row["cpu"]["phases_s"]),
                        _ms(row["cpu"]["rest_s"]),
                        _ms(row["cpu"]["reference_s"]),
                        _ratio(row["cpu"]["reference_vs_syncbn"]),
                    ]
                    for row in cpu_rows
                ],
            ),
            "",
        ]
    return out


def _within_noise(row: dict[str, Any]) -> bool:
    noise = row.get("noise_iqr_s")
    return noise is not None and abs(row["layer_order_check_s"]) <= noise


def _model_section(results: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    model = results["model"]
    row = derived["model"]
    lines = [
        [
            "BatchNorm",
            _ms(row["batchnorm_step_s"], 2),
            _ms(row.get("batchnorm_cpu_s"), 2),
            "",
            "",
            "",
        ],
    ]
    labels = {
        "syncbn": "SyncBatchNorm (default group)",
        "syncbn_own_group": "SyncBatchNorm (own process group)",
    }
    for variant, label in labels.items():
        if variant in row:
            entry = row[variant]
            lines.append(
                [
                    label,
                    _ms(entry["step_s"], 2),
                    _ms(entry.get("cpu_s"), 2),
                    _ms(entry["overhead_s"], 2),
                    _ms(row["latency_floor_s"], 2),
                    _ratio(entry["overhead_vs_floor"], entry["verdict"]),
                ]
            )
    return [
        "## Whole model: training step under DDP",
        "",
        f"{model['model']}, {model['bn_layers']} BatchNorm layers (channels "
        f"{model['bn_channels']}), input {model['input']} per rank, SGD with momentum, "
        f"DistributedDataParallel without per-step buffer broadcast ({model['ddp']}), "
        f"{results['settings']['world_size']} ranks. SyncBN issues "
        f"{model['syncbn_collectives_per_step']} collectives per step. "
        "Latency floor = sum over those collectives of the measured latency of an all_reduce "
        "of the same size (= calls x 2 x latency). 'Own process group' gives the "
        "SyncBN layers a separate group from DDP's, so their all_reduces do not queue behind "
        "DDP's gradient buckets.",
        "",
        *_table(
            [
                "model",
                "step ms",
                "main-thread CPU ms",
                "overhead ms",
                "latency floor ms",
                "overhead / floor",
            ],
            lines,
        ),
        "",
    ]


def _collectives_section(derived: dict[str, Any]) -> list[str]:
    rows = []
    for entry in derived["collectives"]:
        per_size = "; ".join(
            f"{size}: " + ", ".join(f"{c[0]}+{c[2]} / {c[1]}+{c[3]} B" for c in sorted(set(ranks)))
            for size, ranks in entry["per_world_size"].items()
        )
        rows.append(
            [
                _case_label(entry),
                entry["layer"],
                str(entry["collectives_forward"]),
                str(entry["bytes_forward"]),
                str(entry["collectives_backward"]),
                str(entry["bytes_backward"]),
                per_size,
                "yes" if entry["identical"] else "**no**",
            ]
        )
    return [
        "## Collectives per layer call",
        "",
        "Counted on every rank by wrapping the torch.distributed collectives; bytes = what one "
        "rank sends into each collective. Per world size: collectives forward+backward / bytes "
        "forward+backward, over all ranks (one entry when all ranks agree).",
        "",
        *_table(
            [
                "case",
                "layer",
                "fwd collectives",
                "fwd bytes",
                "bwd collectives",
                "bwd bytes",
                "world size: counts / bytes",
                "identical",
            ],
            rows,
        ),
        "",
    ]


def _memory_section(derived: dict[str, Any]) -> list[str]:
    rows = []
    for case in derived["memory"]:

        def kib(value: int | None) -> str:
            return "" if value is None else f"{value / 1024:.0f}"

        rows.append(
            [
                _case_label(case),
                kib(case["input_bytes"]),
                kib(case["batchnorm"]["saved_bytes"]),
                kib(case["syncbn"]["saved_bytes"]),
                kib(case["reference"]["saved_bytes"]),
                case["saved_verdict"],
                kib(case["batchnorm"]["peak_bytes"]),
                kib(case["syncbn"]["peak_bytes"]),
                kib(case["reference"]["peak_bytes"]),
            ]
        )
    return [
        "## Memory of one forward+backward",
        "",
        "Saved = distinct storages autograd keeps for backward "
        "(torch.autograd.graph.saved_tensors_hooks), including the input itself. Peak = "
        "highest live bytes allocated during forward+backward above what was live before "
        "(torch.profiler memory events on CPU; the CUDA allocator's peak on GPU). KiB.",
        "",
        *_table(
            [
                "case",
                "input",
                "saved BN",
                "saved SyncBN",
                "saved reference",
                "SyncBN <= BN",
                "peak BN",
                "peak SyncBN",
                "peak reference",
            ],
            rows,
        ),
        "",
    ]


def _profile_section(results: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    out = ["## Where SyncBatchNorm's time goes", ""]
    out += _phases_table(derived)
    if "profiles" in results:
        profiles = results["profiles"]
        out += [
            f"torch.profiler (CPU self time per forward+backward call on rank 0, mean of "
            f"{profiles['iterations']} calls; the profiler adds a few us per op, so totals "
            "exceed the timed medians), summed by category. *aten calls* = operator calls "
            "per layer call, nested ones included (each costs a few us of dispatch on CPU, "
            "whatever the tensor size). `collectives` includes the wait "
            "for the other rank. `BN kernels` = BatchNorm's own native_batch_norm + "
            "native_batch_norm_backward self time for the same case.",
            "",
        ]
        labels = [label for label, _ in CATEGORIES] + [OTHER]
        rows = []
        for case in profiles["cases"]:
            sync = case["profiles"]["syncbn"]
            categories = categorize(sync["ops"])
            bn_ops = case["profiles"]["batchnorm"]["ops"]
            bn_kernels = sum(op["self_us"] for op in bn_ops if "native_batch_norm" in op["name"])
            rows.append(
                [
                    _case_label(case),
                    f"{_aten_calls(bn_ops):g}",
                    f"{_aten_calls(sync['ops']):g}",
                    f"{case['profiles']['batchnorm']['total_self_us']:.0f}",
                    f"{bn_kernels:.0f}",
                    f"{sync['total_self_us']:.0f}",
                    *[f"{categories.get(label, 0.0):.0f}" for label in labels],
                ]
            )
        out += [
            *_table(
                [
                    "case",
                    "BN aten calls",
                    "SyncBN aten calls",
                    "BN total us",
                    "BN kernels us",
                    "SyncBN total us",
                    *labels,
                ],
                rows,
            ),
            "",
            "Top SyncBN ops per case (self us per layer call, and calls per layer call):",
            "",
        ]
        for case in profiles["cases"]:
            top = case["profiles"]["syncbn"]["ops"][:8]
            ops = ", ".join(f"{op['name']} {op['self_us']:.0f} ({op['calls']:g})" for op in top)
            out.append(f"- {_case_label(case)}: {ops}")
        out.append("")
    if "blocks" in results and results["blocks"]["cases"]:
        cases = results["blocks"]["cases"]
        names = list(cases[0]["times_s"])
        out += [
            "Candidate building blocks, timed alone on the same inputs (median us per call, "
            "rank-local, both ranks running them at once): what a SyncBatchNorm composed of "
            "these ops could cost. `sum` accumulates in float32, `sum_float64` in float64; "
            "`bn_backward_sums_only` is eval-mode `native_batch_norm_backward` returning only "
            "sum(dy) and sum(dy*xhat).",
            "",
            *_table(
                ["case", *names],
                [
                    [_case_label(case), *[_us(case["times_s"][name]) for name in names]]
                    for case in cases
                ],
            ),
            "",
        ]
    return out


def _aten_calls(ops: list[dict[str, Any]]) -> float:
    return sum(op["calls"] for op in ops if op["name"].startswith("aten::"))


#: SyncBatchNorm's large-tensor steps, as timed by suite._syncbn_phases.
PHASES = ("local_sums", "normalize", "backward_sums", "input_grad")


def _phases_table(derived: dict[str, Any]) -> list[str]:
    rows = [row for row in derived.get("layers", []) if "phases_s" in row]
    if not rows:
        return []
    return [
        "SyncBatchNorm's own large-tensor steps, timed alone without collectives in the same "
        "interleaved measurement as the per-layer table: forward statistics "
        "(`syncbn._stats.local_sums`), eval-mode `batch_norm` normalization, backward "
        "reductions (`_stats.backward_sums`) and input gradient (`_stats.input_grad`). "
        "*rest* = SyncBN compute minus these steps: small per-channel ops, packing, the "
        "header read, Python and autograd overhead, and any wait for the other rank beyond "
        "the collectives' own latency. us (medians).",
        "",
        *_table(
            [
                "case",
                *PHASES,
                "steps total",
                "rest",
                "SyncBN compute",
                "BatchNorm fwd+bwd",
                "largest part",
            ],
            [
                [
                    _case_label(row),
                    *[_us(row["phases_s"].get(name)) for name in PHASES],
                    _us(sum(row["phases_s"].values())),
                    _us(row["rest_s"]),
                    _us(row["syncbn_compute_s"]),
                    _us(row["batchnorm_s"]),
                    _largest_part(row),
                ]
                for row in rows
            ],
        ),
        "",
    ]


def _largest_part(row: dict[str, Any]) -> str:
    parts = {**row["phases_s"], "rest": row["rest_s"]}
    name, value = max(parts.items(), key=lambda item: item[1])
    return (
        f"{name} ({value / row['syncbn_compute_s']:.0%})" if row["syncbn_compute_s"] > 0 else name
    )


def _misses_section(results: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    out = ["## Misses", ""]
    lines = []
    for row in derived.get("layers", []):
        missed = []
        if row["compute_vs_batchnorm_verdict"] == "MISS":
            factor = miss_factor(row["compute_vs_batchnorm"], row["compute_vs_batchnorm_limit"])
            missed.append(
                f"compute/BN {row['compute_vs_batchnorm']:.2f}x vs <= "
                f"{row['compute_vs_batchnorm_limit']:g}x ({factor:.2f}x over)"
            )
        if row["compute_vs_floor_verdict"] == "MISS":
            factor = miss_factor(row["compute_vs_floor"], row["compute_vs_floor_limit"])
            missed.append(
                f"compute/floor {row['compute_vs_floor']:.2f}x vs <= "
                f"{row['compute_vs_floor_limit']:g}x ({factor:.2f}x over)"
            )
        if row["speedup_vs_reference_verdict"] == "MISS":
            factor = miss_factor(
                row["speedup_vs_reference"], TARGETS["speedup_vs_reference"], at_least=True
            )
            missed.append(
                f"speed-up over reference {row['speedup_vs_reference']:.2f}x vs >= "
                f"{TARGETS['speedup_vs_reference']:g}x ({factor:.2f}x short)"
            )
        if not missed:
            continue
        evidence = ""
        if "phases_s" in row:
            evidence = f"; largest part of SyncBN compute: {_largest_part(row)}"
        lines.append(f"- {_case_label(row)}: " + "; ".join(missed) + evidence)
    model = derived.get("model", {}).get("syncbn")
    if model and model["verdict"] == "MISS":
        lines.append(
            f"- whole model: SyncBN overhead {model['overhead_vs_floor']:.2f}x the latency floor "
            f"vs <= {TARGETS['model_overhead_vs_latency_floor']:g}x "
            f"({miss_factor(model['overhead_vs_floor'], 1.5):.2f}x over)"
        )
    out += lines or ["None: every target is met in this run."]
    out += ["", *_next_steps(results, derived)]
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _next_steps(results: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """Closing note: what this run's numbers say to do next (facts quoted from the run)."""
    out = ["## Closing note: what the numbers point to", ""]
    rows = [row for row in derived.get("layers", []) if "phases_s" in row]
    blocks = {
        _case_label(case): case["times_s"] for case in results.get("blocks", {}).get("cases", [])
    }
    notes = []
    if rows:
        shares = {
            name: _median(
                [row["phases_s"].get(name, 0.0) / row["syncbn_compute_s"] for row in rows]
            )
            for name in PHASES
        }
        shares["rest"] = _median([row["rest_s"] / row["syncbn_compute_s"] for row in rows])
        ranked = sorted(shares.items(), key=lambda item: item[1], reverse=True)
        notes.append(
            "Median share of SyncBN compute over all cases: "
            + ", ".join(f"{name} {share:.0%}" for name, share in ranked)
            + "."
        )
    for row in rows:
        block = blocks.get(_case_label(row))
        if block is None or row["memory_format"] != "contiguous" or row["dtype"] != "float32":
            continue
        moments = row["phases_s"].get("local_sums")
        one_pass = block.get("sum", 0.0) + block.get("sum_of_squares", 0.0)
        if moments and one_pass:
            notes.append(
                f"{_case_label(row)}: local_sums takes {_us(moments)} us where a float32 "
                f"`sum` plus `sum_of_squares` take {_us(one_pass)} us and `sum_float64` alone "
                f"{_us(block.get('sum_float64'))} us; the input gradient takes "
                f"{_us(row['phases_s'].get('input_grad')) or '(not measured)'} us where an "
                f"eval-mode `batch_norm` (one read, one write) takes "
                f"{_us(block.get('batch_norm_eval_forward'))} us; "
                f"BatchNorm's training forward kernel alone takes "
                f"{_us(block.get('batch_norm_train_forward'))} us."
            )
            break
    cpu_rest = [row["cpu"]["rest_s"] for row in rows if row.get("cpu", {}).get("rest_s")]
    if cpu_rest:
        notes.append(
            f"Fixed per-call cost (main-thread CPU of SyncBN forward+backward minus its "
            f"large-tensor steps and collectives): median {_us(_median(cpu_rest))} us over the "
            f"cases, from {_us(min(cpu_rest))} to {_us(max(cpu_rest))} us."
        )
    small = [row for row in rows if _numel(row["shape"]) <= 32768]
    for row in small:
        cpu = row.get("cpu", {})
        notes.append(
            f"{_case_label(row)} (a small layer): BatchNorm takes {_us(row['batchnorm_s'])} us "
            f"({_us(cpu.get('batchnorm_s'))} us CPU), SyncBN's large-tensor steps "
            f"{_us(sum(row['phases_s'].values()))} us, and SyncBN's compute "
            f"{_us(row['syncbn_compute_s'])} us ({_us(cpu.get('syncbn_compute_s'))} us CPU): "
            "the fixed per-call cost decides small layers."
        )
    model = derived.get("model")
    if model and "syncbn_own_group" in model:
        notes.append(
            "Whole model: SyncBN overhead per step "
            f"{_ms(model['syncbn']['overhead_s'], 2)} ms on the default group, "
            f"{_ms(model['syncbn_own_group']['overhead_s'], 2)} ms on its own group, against a "
            f"collective-latency floor of {_ms(model['latency_floor_s'], 2)} ms."
        )
    if _busy(results["machine"], results):
        notes.append(
            "This run shared the machine with other work (see the load average above): the "
            "collective latencies and 'rest' include scheduling delays of the two ranks, so "
            "rerun `python benchmarks/run.py` on a quiet machine before judging the targets."
        )
    return [*out, *[f"- {note}" for note in notes], ""]


def _numel(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
