from __future__ import annotations

import numpy as np
import pytest
import torch

from geofm.errors import CodecError, ConfigError, LayoutMismatchError
from geofm.fl.communication.codec import Codec, decode
from geofm.fl.communication.feedback import ErrorFeedback, FeedbackState

N = 1000


def updates(count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g) for _ in range(count)]


def test_classic_error_feedback_keeps_the_quantisation_error() -> None:
    feedback = ErrorFeedback(Codec(bits=2, bucket_size=100))
    state = FeedbackState()
    d1, d2 = updates(2)
    packet1, report1 = feedback.uplink(d1, state, torch.Generator().manual_seed(0))
    e1 = d1 - decode(packet1)
    torch.testing.assert_close(state.error, e1, rtol=0, atol=0)
    packet2, report2 = feedback.uplink(d2, state)
    torch.testing.assert_close(state.error, d2 + e1 - decode(packet2), rtol=0, atol=1e-6)
    assert (report1.round, report2.round, state.rounds) == (0, 1, 2)
    assert report2.error_norm == pytest.approx(float(state.error.norm()))
    assert report1.packet_bytes == packet1.nbytes
    assert not (report1.guard_reset or report1.periodic_reset or report2.guard_reset or report2.periodic_reset)


def test_alpha_decays_the_old_residual() -> None:
    alpha = 0.7
    feedback = ErrorFeedback(Codec(bits=1, bucket_size=64), alpha=alpha)
    state = FeedbackState()
    d1, d2 = updates(2)
    packet1, _ = feedback.uplink(d1, state)
    e1 = (1 - alpha) * (d1 - decode(packet1))  # alpha * 0 + (1 - alpha) * (G1 - deq(Q1))
    torch.testing.assert_close(state.error, e1)
    packet2, _ = feedback.uplink(d2, state)
    g2 = d2 + e1
    torch.testing.assert_close(state.error, alpha * e1 + (1 - alpha) * (g2 - decode(packet2)))


def test_periodic_reset() -> None:
    codec = Codec(bits=4, stochastic=False)
    feedback = ErrorFeedback(codec, reset_every=2, guard_factor=None)
    state = FeedbackState()
    reports, packets = [], []
    deltas = updates(5)
    for delta in deltas:
        packet, report = feedback.uplink(delta, state)
        reports.append(report)
        packets.append(packet)
    assert [r.periodic_reset for r in reports] == [False, False, True, False, True]
    # A reset round uploads the update alone; the others carry the residual.
    assert torch.equal(packets[2].payload, codec.encode(deltas[2]).payload)
    assert not torch.equal(packets[3].payload, codec.encode(deltas[3]).payload)
    never = ErrorFeedback(codec, reset_every=None)
    state = FeedbackState()
    assert not any(never.uplink(d, state)[1].periodic_reset for d in deltas)


def test_guard_drops_a_runaway_residual() -> None:
    codec = Codec(bits=8, stochastic=False)
    feedback = ErrorFeedback(codec, guard_factor=10.0)
    (delta,) = updates(1)
    state = FeedbackState(error=delta * 10.5, rounds=3)
    packet, report = feedback.uplink(delta, state)
    assert report.guard_reset and not report.periodic_reset
    assert torch.equal(packet.payload, codec.encode(delta).payload), "the dropped residual was still uploaded"
    torch.testing.assert_close(state.error, delta - decode(packet))
    state = FeedbackState(error=delta * 9.5, rounds=3)
    _, report = feedback.uplink(delta, state)
    assert not report.guard_reset, "guard fired below its factor"


def test_state_round_trips_through_arrays() -> None:
    feedback = ErrorFeedback(Codec(bits=2))
    state = FeedbackState()
    for delta in updates(2):
        feedback.uplink(delta, state)
    arrays = state.to_arrays()
    assert arrays["error"].dtype == np.float32 and arrays["rounds"].dtype == np.int64
    again = FeedbackState.from_arrays({k: np.frombuffer(v.tobytes(), v.dtype) for k, v in arrays.items()})
    assert again.rounds == 2 and torch.equal(again.error, state.error)
    fresh = FeedbackState.from_arrays(FeedbackState().to_arrays())
    assert fresh.error is None and fresh.rounds == 0
    with pytest.raises(CodecError, match="round count"):
        FeedbackState.from_arrays({"error": arrays["error"], "rounds": np.array([-1], dtype=np.int64)})
    with pytest.raises(CodecError, match="expected \\['error', 'rounds'\\]"):
        FeedbackState.from_arrays({"error": arrays["error"]})


def test_bad_updates_leave_the_state_alone() -> None:
    feedback = ErrorFeedback(Codec(bits=2))
    state = FeedbackState()
    (delta,) = updates(1)
    feedback.uplink(delta, state)
    before = state.error.clone()
    broken = delta.clone()
    broken[3] = float("inf")
    with pytest.raises(CodecError, match="NaN or Inf"):
        feedback.uplink(broken, state)
    assert state.rounds == 1 and torch.equal(state.error, before)
    with pytest.raises(LayoutMismatchError, match="residual has 1000 values, the update has 999"):
        feedback.uplink(delta[:999], state)


def test_settings_validated() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        ErrorFeedback(Codec(), alpha=1.0)
    with pytest.raises(ConfigError, match="guard_factor"):
        ErrorFeedback(Codec(), guard_factor=0.0)
    with pytest.raises(ConfigError, match="reset_every"):
        ErrorFeedback(Codec(), reset_every=-1)
