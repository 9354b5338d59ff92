"""Workload: trace tokens and request lengths from a trace, arrival processes, length mixtures."""
import numpy as np
import pytest
from simkit import mini_model, write_trace

from moeplace.foundation.errors import InputError
from moeplace.sim.config import LengthMix, WorkloadConfig
from moeplace.sim.workload import RequestSource, arrival_times, load_trace_tokens, sample_lengths
from moeplace.traces.format import TraceWriter


def test_trace_tokens_group_requests_in_order_with_lengths(tmp_path):
    m = mini_model()
    path = write_trace(tmp_path / "t", m, num_requests=3, prompt=5, output=2)
    tt = load_trace_tokens(path)
    assert tt.expert_ids.shape == (21, 3, 4) and tt.expert_ids.dtype == np.uint16
    assert tt.request_ids.tolist() == [1000, 1001, 1002]
    assert tt.prompt_len.tolist() == [5, 5, 5] and tt.output_len.tolist() == [2, 2, 2]
    assert tt.req_offset.tolist() == [0, 7, 14, 21]
    assert tt.expert_counts().sum() == 21 * 3 * 4
    # whole requests only under a token budget
    assert load_trace_tokens(path, max_tokens=15).num_requests == 2
    src = RequestSource(tt, None, np.random.default_rng(0))
    reqs = [src.make(0.0) for _ in range(4)]
    assert [q.id for q in reqs] == [0, 1, 2, 3]
    assert [q.row_base for q in reqs] == [0, 7, 14, 0]  # templates cycle in trace order
    assert (reqs[1].prompt_len, reqs[1].output_len) == (5, 2)


def test_trace_with_a_missing_layer_row_is_refused(tmp_path):
    m = mini_model()
    with TraceWriter(tmp_path / "bad", m, {"kind": "synthetic"}) as w:
        w.write(request_id=np.array([1, 1, 1, 2, 2]), position=np.array([0, 0, 0, 0, 0]),
                phase=np.zeros(5), step=np.zeros(5), layer=np.array([1, 2, 3, 1, 2]),
                expert_ids=np.tile(np.arange(4, dtype=np.uint16), (5, 1)))
    with pytest.raises(InputError, match=r"row 3: field 'layer': token \(request 2, position 0, step 0\) has rows "
                                         "in 2 of the 3 MoE layers the trace holds"):
        load_trace_tokens(tmp_path / "bad")


def test_poisson_and_gamma_rates_and_burstiness():
    rng = np.random.default_rng(1)
    t = arrival_times(WorkloadConfig(arrival="poisson", rate=50.0), 200.0, rng)
    assert len(t) == pytest.approx(50 * 200, rel=0.05) and np.all(np.diff(t) >= 0) and t[-1] < 200
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    g = np.diff(arrival_times(WorkloadConfig(arrival="gamma", rate=50.0, burstiness=3.0), 400.0, rng))
    assert 1 / g.mean() == pytest.approx(50, rel=0.1)
    assert g.std() / g.mean() == pytest.approx(3.0, rel=0.15)


def test_ramp_rate_grows_linearly():
    t = arrival_times(WorkloadConfig(arrival="ramp", rate=10.0, rate_end=90.0), 100.0, np.random.default_rng(2))
    assert len(t) == pytest.approx(5000, rel=0.05)  # (10 + 90) / 2 x 100 s
    first, last = np.sum(t < 10), np.sum(t >= 90)
    assert first == pytest.approx(10 * 14, rel=0.25)  # mean rate over [0, 10): 14/s
    assert last == pytest.approx(10 * 86, rel=0.1)  # over [90, 100): 86/s


def test_length_mixture_with_a_long_context_tail():
    mix = LengthMix(components=((8192, 0.7), (131072, 0.25), (1 << 20, 0.05)), sigma=0.0, output_mean=256)
    prompt, output = sample_lengths(mix, np.random.default_rng(3), 20000)
    assert set(np.unique(prompt)) == {8192, 131072, 1 << 20}
    assert np.mean(prompt == (1 << 20)) == pytest.approx(0.05, abs=0.01)
    assert np.mean(output) == pytest.approx(256, rel=0.05)
    capped = sample_lengths(LengthMix(components=((1 << 20, 1.0),), sigma=1.0), np.random.default_rng(4), 1000)[0]
    assert capped.max() <= 1 << 20


def test_represented_long_requests_keep_their_true_lengths(tmp_path):
    """A synthetic trace may represent a long prompt by evenly spaced positions and a long output by its
    first tokens: lengths come from the positions, and routing maps positions onto the rows held."""
    m = mini_model()
    L = m.num_moe_layers
    pos = np.array([0, 25, 50, 75, 100, 101])  # prompt of 100 held by 4 rows, output 2 rows (of 2)
    phase = np.array([0, 0, 0, 0, 1, 1])
    with TraceWriter(tmp_path / "t", m, {"kind": "synthetic"}) as w:
        w.write(request_id=np.full(6 * L, 5), position=np.repeat(pos, L), phase=np.repeat(phase, L),
                step=np.repeat(np.arange(6), L), layer=np.tile(np.array(m.moe_layers), 6),
                expert_ids=(np.repeat(np.arange(6), L)[:, None] + np.arange(4) * 4) % m.num_experts)
    tt = load_trace_tokens(tmp_path / "t")
    assert (tt.prompt_len[0], tt.output_len[0], tt.prefill_rows[0]) == (100, 2, 4)
    q = RequestSource(tt, None, np.random.default_rng(0)).make(0.0)
    assert (q.prompt_len, q.output_len, q.n_pre, q.n_dec) == (100, 2, 4, 2)
    from moeplace.sim.workload import decode_row, token_rows
    assert token_rows(q, 0, 100)[[0, 24, 25, 99]].tolist() == [0, 0, 1, 3]
    assert [decode_row(q, p) for p in (100, 101, 102)] == [4, 5, 4]  # outputs cycle over the rows held
    assert token_rows(q, 99, 3).tolist() == [3, 4, 5]


def test_context_mix_lengths_leave_room_for_one_output_token():
    """place simulate and place sweep build their prompt lengths with one rule (LengthMix.context_mix)."""
    lm = LengthMix.context_mix(((1 << 20, 1.0),), 64, 1 << 20)
    assert (lm.components, lm.output_mean, lm.max_len) == (((1 << 20, 1.0),), 64, (1 << 20) - 1)
    assert LengthMix.context_mix(((4096, 1.0),), 8, 8192).max_len == 8191
    assert LengthMix.cap_for(None) == (1 << 20) - 1
