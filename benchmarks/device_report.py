"""The device check's report: the step table with MFU, the loader against the step, the tests marked cuda, its
targets and notes (:func:`report_of`), and the Markdown summary of a result (:func:`markdown`)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    Report,
    Target,
    markdown_table,
)
from benchmarks.pretrain_step import GFM_V100_IMAGES_PER_S, MFU_TARGET


def report_of(results: dict[str, Any]) -> Report:
    """Rows, targets and notes of the results so far."""
    card, steps = results["card"], results["steps"]
    rows = [
        {
            "variant": variant,
            "card": card,
            "status": r["status"],
            "images/s": r.get("images_per_s"),
            "ms/step": r["step_s"]["median"] * 1000 if "step_s" in r else None,
            "TFLOP/s": r.get("achieved_tflops"),
            "MFU": r.get("mfu"),
            "peak MiB": r.get("peak_mib"),
            "first step s": (r.get("warmup_s") or [None])[0],
            "steps": r["step_s"]["n"] if "step_s" in r else 0,
        }
        for variant, r in steps.items()
    ]
    targets, notes = [], []
    geofm = [(v, r) for v, r in steps.items() if v.startswith("geofm") and r.get("images_per_s")]
    if geofm:
        variant, best = max(geofm, key=lambda item: item[1]["images_per_s"])
        targets.append(Target(f"{card}: bf16 step MFU ({variant})", best.get("mfu"), ">=", MFU_TARGET))
    peak = results["peak_tflops"]
    notes.append(
        f"card: {card}; MFU against a bf16 dense peak of {peak:g} TFLOP/s"
        if peak
        else f"card: {card}; no bf16 peak known"
    )
    for faster, slower in (("geofm_bf16", "plain_bf16"), ("geofm_bf16_compiled", "geofm_bf16")):
        a, b = steps.get(faster, {}).get("images_per_s"), steps.get(slower, {}).get("images_per_s")
        if a and b:
            notes.append(f"{faster} over {slower}: {a / b:.2f}x images/s")
    notes.append(f"GFM reports about {GFM_V100_IMAGES_PER_S:g} images/s per V100 for Swin-B at 192 px")
    loader = results.get("loader")
    if loader is not None:
        most = max(loader.get("workers") or [{}], key=lambda r: r.get("workers", -1))
        if "over_step" in most:
            targets.append(
                Target(f"{card}: loader chips/s over the step's images/s", most["over_step"], ">=", 1.0, "x")
            )
        notes.append(f"loader: {loader['status']}{': ' + loader['reason'] if 'reason' in loader else ''}")
    tests = results.get("tests")
    if tests is not None:
        ran = "passed" in tests or "failed" in tests or "skipped" in tests
        failed = tests.get("failed", 0) + tests.get("error", 0) + tests.get("errors", 0) if ran else None
        targets.append(Target(f"{card}: tests marked cuda failed", failed, "<=", 0))
    if "seconds" in results:
        targets.append(Target("device check seconds", results["seconds"], "<=", 480, " s"))
    notes.append(
        "each step variant runs alone in its own process from identical weights, its batch on the device "
        "(no loading); peak MiB: allocated on a GPU, resident on a CPU"
    )
    return Report(results, targets, rows, notes)


def markdown(record: dict[str, Any], report: Report) -> str:
    """The Markdown summary of a result: what ran where, the step table, the loader, the tests, targets, notes."""
    results, env = record["results"], record["results"].get("environment", {})
    software = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda", "cudnn", "timm") if env.get(k))
    lines = [
        f"# geofm device check: {results['card']}",
        "",
        f"`{record['command']}` on {record['created']}, {record['seconds']:.0f} s; {software}.",
        f"Config `{results['config']}`; bf16 dense peak for MFU: {results['peak_tflops'] or '-'} TFLOP/s.",
        "",
        "## GFM training step in bf16",
        "",
        markdown_table(report.rows),
    ]
    loader = results.get("loader")
    if loader is not None:
        lines += ["", "## Chip-store loader", "", f"Status: {loader['status']}. {loader.get('reason', '')}".rstrip()]
        rows = [{"card": results["card"], **row} for row in loader.get("workers", [])]
        lines += ["", markdown_table(rows)] if rows else []
    tests = results.get("tests")
    if tests is not None:
        counts = ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "skipped", "errors", "error") if k in tests)
        lines += [
            "",
            "## Tests marked cuda",
            "",
            f"{tests['status']}: {counts or 'no summary'} ({', '.join(tests.get('files', []))}).",
        ]
    lines += [
        "",
        "## Targets",
        "",
        markdown_table({k: t[k] for k in ("name", "value", "goal", "met")} for t in record["targets"]),
    ]
    lines += ["", "## Notes", "", *(f"- {note}" for note in report.notes)]
    return "\n".join(lines) + "\n"
