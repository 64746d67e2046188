"""``geofm bench fed-benefit``'s results as people read them: a table per setting, budget and protocol, and the claims.

Everything here reads the results JSON alone, so ``geofm bench report`` prints the same text from a
committed file as the run did (:func:`markdown`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import markdown_table

FRAMEWORK_TITLES = {"dino": "DINO: "}
"""What leads a framework's table title (SimMIM's, the first framework, has none)."""


def arm_row(arm: dict[str, Any]) -> dict[str, Any]:
    """One arm's table row: its pretraining seeds, mean and std over them, each seed's mean, traffic."""
    return {
        "setting": arm["setting"],
        "budget": arm["budget"],
        "protocol": arm["protocol"],
        "arm": arm["arm"],
        "pretraining seeds": len(arm["pretrain_seeds"]),
        "test mIoU": f"{arm['mean']:.3f}",
        "std": f"{arm['std']:.3f}",
        "per pretraining seed": " ".join(f"{v:.3f}" for v in arm["per_pretrain_seed"]),
        "MiB up": f"{arm['uplink_bytes'] / 2**20:.1f}",
        "MiB down": f"{arm['downlink_bytes'] / 2**20:.1f}",
        "client s": f"{arm['client_seconds']:.0f}",
    }


def claim_line(claim: dict[str, Any], alpha: float, where: bool = True) -> str:
    """One claim and its verdict with the test's figures (``where``: led by its setting, budget and protocol)."""
    lead = f"- {claim['setting']}, budget {claim['budget']}, {claim['protocol']}: " if where else "- "
    seeds = f"{claim['n']} pretraining seed{'s' if claim['n'] != 1 else ''}"
    if claim["holds"] is None:
        return f"{lead}{claim['claim']}: not tested ({claim['test']}, {seeds})"
    margin = "" if claim["margin"] is None else f", margin +-{claim['margin']:.3f}"
    low, high = claim["ci"]
    verdict = "holds" if claim["holds"] else "does not hold"
    return (
        f"{lead}{claim['claim']}: **{verdict}** ({claim['test']}, {seeds}: {claim['estimate']:+.3f}{margin}, "
        f"{1 - 2 * alpha:.0%} CI [{low:+.3f}, {high:+.3f}], p {claim['p']:.3g})"
    )


def _group(row: dict[str, Any]) -> tuple[str, int, str, str]:
    """The table a results row (arm or claim) stands in: setting, budget, protocol, framework (files
    written before the DINO framework hold SimMIM's alone)."""
    return row["setting"], row["budget"], row["protocol"], row.get("framework", "simmim")


def markdown(results: dict[str, Any]) -> str:
    """The arms' tables, one per setting, budget, protocol and framework (DINO's after SimMIM's), each
    followed by its claims."""
    blocks = []
    for group in dict.fromkeys(_group(a) for a in results["arms"]):
        setting, budget, protocol, framework = group
        arms = [a for a in results["arms"] if _group(a) == group]
        rows = [{k: v for k, v in arm_row(a).items() if k not in ("setting", "budget", "protocol")} for a in arms]
        lead = FRAMEWORK_TITLES.get(framework, "")
        lines = [f"**{lead}{setting}, budget {budget}, {protocol} backbone**", "", markdown_table(rows), ""]
        lines += [claim_line(c, results["alpha"], where=False) for c in results["claims"] if _group(c) == group]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
