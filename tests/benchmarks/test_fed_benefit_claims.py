"""The claims of ``geofm bench fed-benefit``: TOST and one-sided paired t-tests on pretraining seeds."""

from __future__ import annotations

import pytest
from scipy import stats

from benchmarks.fed_benefit_claims import above, claims, differences, tost


def test_tost_on_three_differences_matches_two_one_sided_t_tests() -> None:
    diffs = [0.01, -0.005, 0.004]  # mean 0.003, sd sqrt(114e-6 / 2) = 0.00755, se 0.00436, df 2
    result = tost(diffs, margin=0.02, alpha=0.05)
    # t against -0.02: 0.023 / 0.00436 = 5.277, p 0.0170; against +0.02: -0.017 / 0.00436 = -3.900, p 0.0299
    assert result["p"] == pytest.approx(0.02994892593206863)
    assert result["p"] == pytest.approx(stats.ttest_1samp(diffs, 0.02, alternative="less").pvalue)
    assert result["estimate"] == pytest.approx(0.003) and result["n"] == 3 and result["margin"] == 0.02
    # the 90% interval: 0.003 +- t(0.95, 2) 2.920 x 0.00436 = [-0.00973, 0.01573], inside +-0.02
    assert result["ci"] == pytest.approx([0.003 - 2.919986 * 0.0043589, 0.003 + 2.919986 * 0.0043589], rel=1e-4)
    assert result["holds"] is True and result["test"] == "paired TOST"
    assert tost(diffs, margin=0.01, alpha=0.05)["holds"] is False, "the interval reaches past +-0.01"


def test_a_one_sided_paired_t_test_and_its_interval() -> None:
    diffs = [0.03, 0.05, 0.04, 0.06]  # mean 0.045, se 0.006455, t 6.971, df 3
    result = above(diffs, alpha=0.05)
    assert result["p"] == pytest.approx(0.0030284243979541966)
    assert result["ci"] == pytest.approx([0.02980910434906508, 0.06019089565093491])
    assert result["holds"] is True and result["margin"] is None
    weak = above([0.01, -0.005, 0.004])  # t 0.688, p 0.281
    assert weak["p"] == pytest.approx(0.2812025127531581) and weak["holds"] is False
    assert above([0.02])["holds"] is None and above([0.02])["p"] is None, "one seed: nothing to test"


def _arm(seeds: list[int], scores: list[float]) -> dict:
    return {"pretrain_seeds": seeds, "per_pretrain_seed": scores, "mean": sum(scores) / len(scores)}


def test_arms_pair_by_pretraining_seed_and_an_unpretrained_arm_by_its_one_score() -> None:
    arm = _arm([0, 1, 2], [0.70, 0.72, 0.68])
    assert differences(arm, _arm([1, 2], [0.71, 0.70])) == pytest.approx([0.01, -0.02]), "seeds both ran"
    assert differences(arm, _arm([], [0.60])) == pytest.approx([0.10, 0.12, 0.08]), "random: one score"


def test_the_claims_of_the_arms_that_ran() -> None:
    arms = {
        "random": _arm([], [0.50]),
        "released": _arm([], [0.60]),
        "alone:s2": _arm([0, 1, 2], [0.60, 0.61, 0.59]),
        "central": _arm([0, 1, 2], [0.70, 0.72, 0.68]),
        "fedsense": _arm([0, 1, 2], [0.701, 0.719, 0.681]),
        "fedsense_continual": _arm([0, 1, 2], [0.74, 0.75, 0.73]),
        "fedsense_no_scg": _arm([0], [0.69]),
    }
    found = {c["claim"]: c for c in claims(arms, margin=0.02, alpha=0.05)}
    equivalent = found["fedsense as good as central (within 2%)"]
    assert equivalent["margin"] == pytest.approx(0.02 * 0.70) and equivalent["holds"] is True
    assert found["fedsense above alone:s2"]["holds"] is True
    assert found["fedsense_continual above released"]["holds"] is True
    assert found["fedsense_continual above fedsense"]["holds"] is True
    assert (
        found["fedsense above fedsense_no_scg"]["n"] == 1 and found["fedsense above fedsense_no_scg"]["holds"] is None
    )
    assert "released above random" not in found, "no pretraining seeds: nothing to pair"
    assert not any("fedavg" in claim for claim in found), "an arm that did not run makes no claim"
    assert set(next(iter(found.values()))) == {"claim", "test", "n", "estimate", "margin", "ci", "p", "holds"}


def test_the_dino_claims_are_fedsenses_table_1() -> None:
    arms = {
        "random": _arm([], [0.50]),
        "central": _arm([0, 1, 2], [0.70, 0.72, 0.68]),
        "dino:central": _arm([0, 1, 2], [0.70, 0.72, 0.68]),
        "dino:fedavg": _arm([0, 1, 2], [0.60, 0.62, 0.61]),
        "dino:fedema": _arm([0, 1, 2], [0.65, 0.66, 0.64]),
        "dino:fedmkd": _arm([0, 1, 2], [0.59, 0.60, 0.62]),
        "dino:fedsense": _arm([0, 1, 2], [0.701, 0.719, 0.681]),
    }
    found = {c["claim"]: c for c in claims(arms, margin=0.02, alpha=0.05)}
    assert found["dino:fedsense as good as dino:central (within 2%)"]["holds"] is True
    assert found["dino:fedema above dino:fedavg"]["holds"] is True
    assert found["dino:fedmkd above dino:fedavg"]["holds"] is False
    assert found["dino:fedsense above dino:fedavg"]["holds"] is True
    assert {"dino:fedsense above dino:fedema", "dino:fedsense above dino:fedmkd"} <= set(found)
    assert "dino:fedsense above dino:ldawa" not in found, "L-DAWA did not run"
    assert found["dino:fedsense above random"]["n"] == 3
    assert "dino:fedsense above central" not in found, "no claim across frameworks"
