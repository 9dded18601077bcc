"""Schedules as pure functions of the step, checked against the spec's tables and boundary values."""
import math

import pytest

import train_gpt as tg

HP = tg.Hyperparameters()
NS = HP.num_scheduled_iterations


def test_totals():
    assert HP.num_iterations == 1765
    assert HP.split_step == 1151
    assert tg.train_tokens_needed(HP) == 467_927_040 


@pytest.mark.parametrize("step,bs", [(0, 131072), (574, 131072), (575, 262144), (1149, 262144), (1150, 393216),
                                     (1724, 393216), (1725, 393216), (1764, 393216)])
def test_batch_size(step, bs):
    assert tg.global_batch_size(step, NS, HP.train_bs_schedule) == bs


@pytest.mark.parametrize("step,ws", [(0, (1, 3)), (574, (1, 3)), (575, (3, 7)), (1149, (3, 7)), (1150, (5, 11)),
                                     (1724, (5, 11)), (1725, (6, 13)), (1764, (6, 13))])
def test_windows(step, ws):
    assert tg.window_sizes(step, NS, HP.ws_long_schedule, HP.ws_long_extension) == ws


@pytest.mark.parametrize("step,lr", [(0, 1.0), (575, 1.0), (576, 1.52), (862, 1.52), (863, 1.5191768),
                                     (1150, 1.0466667), (1151, 1.1847768), (1724, 0.1018899), (1725, 0.1),
                                     (1726, 0.1), (1764, 0.1)])
def test_lr(step, lr):
    got = tg.lr_factor(step, NS, HP.lr_peaks, HP.lr_min, HP.cooldown_frac)
    assert got == pytest.approx(lr, abs=5e-8)


@pytest.mark.parametrize("step,mu", [(0, 0.85), (150, 0.90), (299, 0.85 + 0.1 * 299 / 300), (300, 0.95),
                                     (1715, 0.95), (1724, 0.932), (1764, 0.852)])
def test_momentum(step, mu):
    got = tg.muon_momentum(step, HP.num_iterations, HP.momentum_min, HP.momentum_max,
                           HP.momentum_warmup_steps, HP.momentum_cooldown_steps)
    assert got == pytest.approx(mu, abs=1e-12)


def test_mtp_weights():
    w = lambda s: tg.mtp_weights(s, NS, HP.mtp_weights_start)
    assert w(0) == (1.0, 0.5, 0.25)
    assert w(574)[2] == pytest.approx(0.000434783, abs=1e-9)
    assert w(575) == (1.0, 0.5)                       # 575/1725 is the double nearest 1/3: 3x rounds to 1
    assert w(1149)[1] == pytest.approx(0.000869565, abs=1e-9)
    assert w(1150) == (1.0,) and w(1764) == (1.0,)


def test_schedule_at_parity_and_fields():
    s = tg.schedule_at(1151, HP)
    assert s.do_adam and not tg.schedule_at(1150, HP).do_adam
    assert (s.ws_short, s.ws_long, s.global_batch) == (5, 11, 393216)


def test_warmup_steps_cover_every_transition_and_the_split():
    assert tg.warmup_steps(HP) == [0, 1, 2, 574, 575, 576, 1149, 1150, 1151, 1724, 1725, 1726]
    tiny = tg.parse_args(["--preset=tiny"])
    steps = tg.warmup_steps(tiny)
    ws = [tg.schedule_at(s, tiny).ws_long for s in range(tiny.num_iterations)]
    for t in range(1, tiny.num_iterations):
        if ws[t] != ws[t - 1]:
            assert {t - 1, t, t + 1} <= set(steps)
    assert tiny.split_step in steps and all(0 <= s < tiny.num_iterations for s in steps)


def test_attn_scale_after_yarn_matches_spec():
    # the schedule's window changes drive YaRN: scale *= 1 + 0.2 ln(b/a) at 3->7->11->13
    scale, prev = 0.1, 3
    expected = [0.11694596, 0.12751752, 0.13177799]
    for new, want in zip((7, 11, 13), expected):
        scale *= 1 + 0.2 * math.log(new / prev)
        prev = new
        assert scale == pytest.approx(want, abs=1e-8)
