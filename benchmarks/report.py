"""Pure helpers of the benchmark suite: floors, ratios, verdicts and the tables of results.md.

Nothing here runs a benchmark; everything takes the raw numbers that ``suite.py``
measured (a JSON-like dict) and derives what ``results.md`` publishes: the targets,
the per-layer times and their main-thread CPU view, the whole model, the collectives,
the memory, and the misses. The other raw numbers (profiles, building blocks, forward
only, fastest blocks) stay in ``results.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "TARGETS",
    "collective_summary",
    "derive",
    "derive_layer",
    "derive_model",
    "describe_target",
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

#: Bytes that must move, in units of the input's size: forward reads x twice (statistics,
#: normalization) and writes y; backward reads x and dy twice (reductions, input gradient)
#: and writes dx.
FORWARD_PASSES = 3
BACKWARD_PASSES = 5

_TARGET_NAMES = {
    "compute_vs_batchnorm": "SyncBN compute / BatchNorm, forward+backward",
    "compute_vs_floor": "SyncBN compute / memory-traffic floor, forward+backward, float32",
    "speedup_vs_reference": "reference SyncBN time / SyncBN time, forward+backward",
    "model_overhead_vs_latency_floor": "whole-model SyncBN overhead / collective-latency floor",
    "syncbn_bytes_identical_over_world_sizes": "bytes per collective identical, world 2/3/4",
    "saved_bytes_not_more_than_batchnorm": "bytes saved for backward <= BatchNorm's",
}


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
    latency = t["all_reduce.forward"] + t["all_reduce.backward"]
    compute = t["syncbn.forward_backward"] - latency
    float32 = case["dtype"] == "float32"
    if float32 and case["memory_format"] == "contiguous":
        bn_limit = TARGETS["compute_vs_batchnorm_float32_contiguous"]
    else:
        bn_limit = TARGETS["compute_vs_batchnorm"]
    floor_limit = TARGETS["compute_vs_traffic_floor_float32"] if float32 else None
    vs_bn = compute / t["batchnorm.forward_backward"]
    vs_floor = compute / floor["forward_backward_s"]
    speedup = t["reference.forward_backward"] / t["syncbn.forward_backward"]
    row: dict[str, Any] = {
        "shape": case["shape"],
        "dtype": case["dtype"],
        "memory_format": case["memory_format"],
        "batchnorm_s": t["batchnorm.forward_backward"],
        "syncbn_s": t["syncbn.forward_backward"],
        "reference_s": t["reference.forward_backward"],
        "latency_s": latency,
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
    }
    if "torch_syncbn.forward_backward" in t:
        row["torch_syncbn_s"] = t["torch_syncbn.forward_backward"]
        row["speedup_vs_torch_syncbn"] = t["torch_syncbn.forward_backward"] / row["syncbn_s"]
    c = case.get("cpu_s")
    if c:
        cpu_compute = (
            c["syncbn.forward_backward"] - c["all_reduce.forward"] - c["all_reduce.backward"]
        )
        row["cpu"] = {
            "batchnorm_s": c["batchnorm.forward_backward"],
            "syncbn_s": c["syncbn.forward_backward"],
            "reference_s": c["reference.forward_backward"],
            "collectives_s": c["all_reduce.forward"] + c["all_reduce.backward"],
            "syncbn_compute_s": cpu_compute,
            "compute_vs_batchnorm": cpu_compute / c["batchnorm.forward_backward"],
            "reference_vs_syncbn": c["reference.forward_backward"] / c["syncbn.forward_backward"],
        }
    return row


def derive_model(model: dict[str, Any]) -> dict[str, Any]:
    """Whole-model overheads of SyncBatchNorm over BatchNorm against the latency floor."""
    t = model["times_s"]
    floor = sum(t[f"all_reduce.{nbytes}"] for nbytes in model["syncbn_collective_bytes"])
    cpu = model.get("cpu_s") or {}
    row: dict[str, Any] = {
        "batchnorm_step_s": t["batchnorm"],
        "batchnorm_cpu_s": cpu.get("batchnorm"),
        "latency_floor_s": floor,
    }
    for variant in ("syncbn", "syncbn_own_group"):
        if variant in t:
            overhead = t[variant] - t["batchnorm"]
            row[variant] = {
                "step_s": t[variant],
                "cpu_s": cpu.get(variant),
                "overhead_s": overhead,
                "overhead_vs_floor": overhead / floor,
                "verdict": verdict(overhead / floor, TARGETS["model_overhead_vs_latency_floor"]),
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
        for row in (row for rank_rows in ranks for row in rank_rows):
            fields = {key: row[key] for key in ("shape", "dtype", "memory_format", "layer")}
            key = (_case_label(row), row["layer"])
            entry = table.setdefault(key, {**fields, "per_world_size": {}})
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


def _target(
    name: str,
    misses: int,
    cases: int,
    limit: float | None = None,
    worst: tuple[float, str] | None = None,
    at_least: bool = False,
) -> dict[str, Any]:
    return {
        "target": name,
        "limit": limit,
        "at_least": at_least,
        "worst": None if worst is None else worst[0],
        "worst_case": "" if worst is None else worst[1],
        "misses": misses,
        "cases": cases,
        "verdict": "PASS" if misses == 0 else "MISS",
    }


def _worst_target(
    key: str, rows: Sequence[dict[str, Any]], limit: float, at_least: bool = False
) -> dict[str, Any]:
    """The target ``key <= limit`` (or ``>=``) over ``rows``: its worst case and misses."""
    value, row = (min if at_least else max)(
        ((row[key], row) for row in rows), key=lambda item: item[0]
    )
    misses = sum(verdict(row[key], limit, at_least) == "MISS" for row in rows)
    return _target(key, misses, len(rows), limit, (value, _case_label(row)), at_least)


def derive(results: dict[str, Any]) -> dict[str, Any]:
    """Everything ``results.md`` reports, derived from the raw measurements."""
    derived: dict[str, Any] = {}
    targets = []
    if "layers" in results:
        rows = [derive_layer(case) for case in results["layers"]["cases"]]
        derived["layers"] = rows
        f32 = [row for row in rows if row["dtype"] == "float32"]
        f32_contiguous = [row for row in f32 if row["memory_format"] == "contiguous"]
        for key, selected, limit, at_least in (
            ("compute_vs_batchnorm", rows, TARGETS["compute_vs_batchnorm"], False),
            (
                "compute_vs_batchnorm",
                f32_contiguous,
                TARGETS["compute_vs_batchnorm_float32_contiguous"],
                False,
            ),
            ("compute_vs_floor", f32, TARGETS["compute_vs_traffic_floor_float32"], False),
            ("speedup_vs_reference", rows, TARGETS["speedup_vs_reference"], True),
        ):
            if selected:
                targets.append(_worst_target(key, selected, limit, at_least))
    if "model" in results:
        derived["model"] = derive_model(results["model"])
        entry = derived["model"]["syncbn"]
        worst = (entry["overhead_vs_floor"], "SmallResNet step, SyncBN on the default group")
        limit = TARGETS["model_overhead_vs_latency_floor"]
        misses = int(entry["verdict"] == "MISS")
        targets.append(_target("model_overhead_vs_latency_floor", misses, 1, limit, worst))
    if "collectives" in results:
        summary = collective_summary(results["collectives"])
        derived["collectives"] = summary
        syncbn_rows = [row for row in summary if row["layer"] == "syncbn"]
        misses = sum(not row["identical"] for row in syncbn_rows)
        targets.append(_target("syncbn_bytes_identical_over_world_sizes", misses, len(syncbn_rows)))
    if "memory" in results:
        memory = []
        for case in results["memory"]["cases"]:
            saved_ok = case["syncbn"]["saved_bytes"] <= case["batchnorm"]["saved_bytes"]
            memory.append({**case, "saved_verdict": "PASS" if saved_ok else "MISS"})
        derived["memory"] = memory
        misses = sum(row["saved_verdict"] == "MISS" for row in memory)
        targets.append(_target("saved_bytes_not_more_than_batchnorm", misses, len(memory)))
    derived["targets"] = targets
    return derived


# --------------------------------------------------------------------------- markdown


def describe_target(target: dict[str, Any]) -> str:
    """A target's name as ``results.md`` and ``run.py`` print it."""
    text = _TARGET_NAMES.get(target["target"], target["target"])
    if target["target"] == "compute_vs_batchnorm":
        text += " (float32 contiguous)" if target["limit"] < 1.0 else " (all cases)"
    return text


def _case_label(row: dict[str, Any]) -> str:
    shape = "x".join(map(str, row["shape"]))
    fmt = "CL" if row["memory_format"] == "channels_last" else "contig"
    return f"{shape} {row['dtype']} {fmt}"


def _ms(seconds: float | None, digits: int = 3) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def _ratio(value: float | None, verdict_text: str | None = None) -> str:
    if value is None:
        return ""
    text = f"{value:.2f}x"
    return f"{text} {verdict_text}" if verdict_text and verdict_text != "n/a" else text


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


#: A column of a table: its header and how a row gives its cell.
Column = tuple[str, Callable[[dict[str, Any]], str]]


def _columns(columns: Sequence[Column], rows: Iterable[dict[str, Any]]) -> list[str]:
    return _table(
        [name for name, _ in columns], ([cell(row) for _, cell in columns] for row in rows)
    )


def render_markdown(results: dict[str, Any], derived: dict[str, Any]) -> str:
    """The whole ``results.md`` text."""
    machine = results["machine"]
    settings = results["settings"]
    busy = _busy(machine, results)
    out = [
        "# syncbn benchmark results",
        "",
        f"Generated by `{results['command']}` on {machine['date']} in "
        f"{results['wall_s']:.0f} s. Raw numbers, also of the sections not tabulated here "
        "(profiles, building blocks, forward only, fastest blocks): `results.json` (same "
        "directory).",
        "",
        f"- Machine: {machine['cpu']}, {machine['cpu_count']} cores, "
        f"{machine['memory_gib']} GiB, {machine['platform']}"
        + (f", GPU {machine['cuda']}" if machine.get("cuda") else ""),
        f"- Software: Python {machine['python']}, torch {machine['torch']}, "
        f"syncbn {machine['syncbn']}"
        + (f" (git {results['git']})" if results.get("git") else "")
        + (f", imported from `{results['syncbn_path']}`" if results.get("syncbn_path") else ""),
        f"- Ranks: {settings['world_size']} {settings['backend']} ranks on {settings['device']}, "
        "spawned processes, `file://` rendezvous, `torch.set_num_threads(1)` per rank",
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
            if busy
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
        "## Targets",
        "",
        *_columns(
            [
                ("target", describe_target),
                ("limit", _limit_text),
                ("worst case", _worst_text),
                ("cases passing", lambda t: f"{t['cases'] - t['misses']}/{t['cases']}"),
                ("verdict", lambda t: f"**{t['verdict']}**"),
            ],
            derived["targets"],
        ),
        "",
    ]
    if "layers" in derived:
        out += _layers_section(results["layers"].get("torch_syncbn"), derived["layers"])
    if "model" in derived:
        out += _model_section(results, derived["model"])
    if "collectives" in derived:
        out += _collectives_section(derived["collectives"])
    if "memory" in derived:
        out += _memory_section(derived["memory"])
    out += _misses_section(derived)
    return "\n".join(out) + "\n"


def _limit_text(target: dict[str, Any]) -> str:
    if target["limit"] is None:
        return "yes"
    return f"{'>=' if target['at_least'] else '<='} {target['limit']:g}x"


def _worst_text(target: dict[str, Any]) -> str:
    return "" if target["worst"] is None else f"{target['worst']:.2f}x ({target['worst_case']})"


def _busy(machine: dict[str, Any], results: dict[str, Any]) -> bool:
    loads = [machine.get("load_average"), results.get("load_average_end")]
    cores = machine.get("cpu_count") or 1
    # the benchmark itself keeps `world_size` cores busy; more than that is someone else
    own = results["settings"]["world_size"]
    return any(
        load is not None and load[0] > own + 0.5 and load[0] > 0.75 * cores for load in loads
    )


def _layers_section(torch_note: str | None, rows: list[dict[str, Any]]) -> list[str]:
    out = ["## Per layer: forward+backward", ""]
    if torch_note:
        out += [f"torch.nn.SyncBatchNorm: {torch_note}.", ""]
    columns: list[Column] = [
        ("shape", lambda row: "x".join(map(str, row["shape"]))),
        ("format", lambda row: row["memory_format"]),
        ("BatchNorm ms", lambda row: _ms(row["batchnorm_s"])),
        ("SyncBN ms", lambda row: _ms(row["syncbn_s"])),
        ("collectives ms", lambda row: _ms(row["latency_s"])),
        ("SyncBN compute ms", lambda row: _ms(row["syncbn_compute_s"])),
        ("reference ms", lambda row: _ms(row["reference_s"])),
        ("traffic floor ms", lambda row: _ms(row["traffic_floor_s"])),
        (
            "compute / BN",
            lambda row: (
                _ratio(row["compute_vs_batchnorm"], row["compute_vs_batchnorm_verdict"])
                + f" (<= {row['compute_vs_batchnorm_limit']:g})"
            ),
        ),
        (
            "compute / floor",
            lambda row: _ratio(row["compute_vs_floor"], row["compute_vs_floor_verdict"]),
        ),
        (
            "vs reference",
            lambda row: _ratio(row["speedup_vs_reference"], row["speedup_vs_reference_verdict"]),
        ),
    ]
    if any("torch_syncbn_s" in row for row in rows):
        columns += [
            ("torch SyncBN ms", lambda row: _ms(row.get("torch_syncbn_s"))),
            ("vs torch SyncBN", lambda row: _ratio(row.get("speedup_vs_torch_syncbn"))),
        ]
    for dtype in ("float32", "bfloat16"):
        selected = [row for row in rows if row["dtype"] == dtype]
        if selected:
            title = f"### {dtype}" + (" input, float32 parameters" if dtype != "float32" else "")
            out += [title, "", *_columns(columns, selected), ""]
    cpu_rows = [row for row in rows if "cpu" in row]
    if cpu_rows:
        out += [
            "## Per layer: main-thread CPU time",
            "",
            "CPU time of each rank's calling thread per forward+backward (`time.thread_time`, "
            "median, maximum over ranks): the work the layer itself does, without waiting for "
            "the other rank, for the collectives (gloo waits without spinning) or for a CPU "
            "taken by other processes, so it is the view least disturbed by a busy machine. "
            "*SyncBN compute* subtracts the CPU time of issuing its collectives alone.",
            "",
            *_columns(
                [
                    ("case", _case_label),
                    ("BatchNorm ms", lambda row: _ms(row["cpu"]["batchnorm_s"])),
                    ("SyncBN ms", lambda row: _ms(row["cpu"]["syncbn_s"])),
                    ("collectives ms", lambda row: _ms(row["cpu"]["collectives_s"])),
                    ("SyncBN compute ms", lambda row: _ms(row["cpu"]["syncbn_compute_s"])),
                    ("compute / BN", lambda row: _ratio(row["cpu"]["compute_vs_batchnorm"])),
                    ("reference ms", lambda row: _ms(row["cpu"]["reference_s"])),
                    ("reference / SyncBN", lambda row: _ratio(row["cpu"]["reference_vs_syncbn"])),
                ],
                cpu_rows,
            ),
            "",
        ]
    return out


def _model_section(results: dict[str, Any], row: dict[str, Any]) -> list[str]:
    model = results["model"]
    lines = [["BatchNorm", _ms(row["batchnorm_step_s"], 2), _ms(row["batchnorm_cpu_s"], 2)]]
    lines[0] += ["", "", ""]
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
                    _ms(entry["cpu_s"], 2),
                    _ms(entry["overhead_s"], 2),
                    _ms(row["latency_floor_s"], 2),
                    _ratio(entry["overhead_vs_floor"], entry["verdict"]),
                ]
            )
    header = ["model", "step ms", "main-thread CPU ms", "overhead ms", "latency floor ms"]
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
        *_table([*header, "overhead / floor"], lines),
        "",
    ]


def _per_world_size(entry: dict[str, Any]) -> str:
    return "; ".join(
        f"{size}: " + ", ".join(f"{c[0]}+{c[2]} / {c[1]}+{c[3]} B" for c in sorted(set(ranks)))
        for size, ranks in entry["per_world_size"].items()
    )


def _collectives_section(summary: list[dict[str, Any]]) -> list[str]:
    return [
        "## Collectives per layer call",
        "",
        "Counted on every rank by wrapping the torch.distributed collectives; bytes = what one "
        "rank sends into each collective. Per world size: collectives forward+backward / bytes "
        "forward+backward, over all ranks (one entry when all ranks agree).",
        "",
        *_columns(
            [
                ("case", _case_label),
                ("layer", lambda entry: entry["layer"]),
                ("fwd collectives", lambda entry: str(entry["collectives_forward"])),
                ("fwd bytes", lambda entry: str(entry["bytes_forward"])),
                ("bwd collectives", lambda entry: str(entry["collectives_backward"])),
                ("bwd bytes", lambda entry: str(entry["bytes_backward"])),
                ("world size: counts / bytes", _per_world_size),
                ("identical", lambda entry: "yes" if entry["identical"] else "**no**"),
            ],
            summary,
        ),
        "",
    ]


def _kib(value: int | None) -> str:
    return "" if value is None else f"{value / 1024:.0f}"


def _bytes_cell(layer: str, key: str) -> Callable[[dict[str, Any]], str]:
    return lambda case: _kib(case[layer][key])


def _memory_section(memory: list[dict[str, Any]]) -> list[str]:
    columns: list[Column] = [
        ("case", _case_label),
        ("input", lambda case: _kib(case["input_bytes"])),
    ]
    for kind in ("saved", "peak"):
        for layer, name in (("batchnorm", "BN"), ("syncbn", "SyncBN"), ("reference", "reference")):
            columns.append((f"{kind} {name}", _bytes_cell(layer, f"{kind}_bytes")))
        if kind == "saved":
            columns.append(("SyncBN <= BN", lambda case: case["saved_verdict"]))
    return [
        "## Memory of one forward+backward",
        "",
        "Saved = distinct storages autograd keeps for backward "
        "(torch.autograd.graph.saved_tensors_hooks), including the input itself. Peak = "
        "highest live bytes allocated during forward+backward above what was live before "
        "(torch.profiler memory events on CPU; the CUDA allocator's peak on GPU). KiB.",
        "",
        *_columns(columns, memory),
        "",
    ]


def _misses_section(derived: dict[str, Any]) -> list[str]:
    lines = []
    for row in derived.get("layers", []):
        missed = []
        for key, label, at_least in (
            ("compute_vs_batchnorm", "compute/BN", False),
            ("compute_vs_floor", "compute/floor", False),
            ("speedup_vs_reference", "speed-up over reference", True),
        ):
            if row[f"{key}_verdict"] == "MISS":
                limit = row.get(f"{key}_limit", TARGETS.get(key))
                factor = miss_factor(row[key], limit, at_least)
                sign, word = (">=", "short") if at_least else ("<=", "over")
                missed.append(
                    f"{label} {row[key]:.2f}x vs {sign} {limit:g}x ({factor:.2f}x {word})"
                )
        if missed:
            lines.append(f"- {_case_label(row)}: " + "; ".join(missed))
    model = derived.get("model", {}).get("syncbn")
    if model and model["verdict"] == "MISS":
        limit = TARGETS["model_overhead_vs_latency_floor"]
        lines.append(
            f"- whole model: SyncBN overhead {model['overhead_vs_floor']:.2f}x the latency floor "
            f"vs <= {limit:g}x ({miss_factor(model['overhead_vs_floor'], limit):.2f}x over)"
        )
    return ["## Misses", "", *(lines or ["None: every target is met in this run."]), ""]
