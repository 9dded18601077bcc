"""Schedules as pure functions of the step, checked against the record's boundary values and formulas."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import harness
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
    assert tg.global_batch_size(step, NS, HP.stages) == bs


@pytest.mark.parametrize("step,ws", [(0, (1, 3)), (574, (1, 3)), (575, (3, 7)), (1149, (3, 7)), (1150, (5, 11)),
                                     (1724, (5, 11)), (1725, (6, 13)), (1764, (6, 13))])
def test_windows(step, ws):
    assert tg.window_sizes(step, NS, HP.stages, HP.ws_long_extension) == ws


@pytest.mark.parametrize("step,lr", [(0, 1.0), (575, 1.0), (576, 1.52), (862, 1.52), (863, 1.5191768),
                                     (1150, 1.0466667), (1151, 1.1847768), (1724, 0.1018899), (1725, 0.1),
                                     (1726, 0.1), (1764, 0.1)])
def test_lr(step, lr):
    got = tg.lr_factor(step, NS, HP.stages, HP.lr_min, HP.cooldown_frac)
    assert got == pytest.approx(lr, abs=5e-8)


# The record's schedule as it writes it: three parallel triples and hard-coded thirds. The stage table must give
# exactly these numbers (==, not approx) at every step, for any schedule length.
def record_schedule(step, ns, ext_ws=13, lr_min=0.1, cooldown_frac=0.5):
    bs_schedule, lr_peaks, ws_schedule, mtp_start = (131072, 262144, 393216), (1.0, 1.52, 1.73), (3, 7, 11), \
        (1.0, 0.5, 0.25)
    third = min(int(3 * (step / ns)), 2)
    ws_long = ext_ws if step >= ns else ws_schedule[third]
    x = step / ns
    if step > ns:
        lr = lr_min
    else:
        peak = lr_peaks[2] if x > 2 / 3 else lr_peaks[1] if x > 1 / 3 else lr_peaks[0]
        w = (1 - x) / cooldown_frac
        lr = peak * w + lr_min * (1 - w) if x >= 1 - cooldown_frac else peak
    if x < 1 / 3:
        mtp = (mtp_start[0], mtp_start[1], mtp_start[2] * (1 - 3 * x))
    elif x < 2 / 3:
        mtp = (mtp_start[0], mtp_start[1] * (2 - 3 * x))
    else:
        mtp = (mtp_start[0],)
    return bs_schedule[third], (ws_long // 2, ws_long), lr, mtp


def test_stage_table_is_the_records_schedule_exactly():
    for ns in [3, 4, 5, 7, 9, 60, 100, 999, 1725, 1726, 2000]:
        hp = tg.Hyperparameters(num_scheduled_iterations=ns)
        for step in range(ns + 45):
            s = tg.schedule_at(step, hp)
            assert (s.global_batch, (s.ws_short, s.ws_long), s.lr_factor, s.mtp_weights) == \
                record_schedule(step, ns), (ns, step)


def test_a_four_stage_table():
    stages = (tg.Stage(64, 1.0, 2, (1.0, 0.5)), tg.Stage(128, 2.0, 4, (1.0, 0.5)), tg.Stage(192, 3.0, 6, (1.0,)),
              tg.Stage(256, 4.0, 8, (1.0, 0.25)))
    got = [(tg.global_batch_size(s, 8, stages), tg.window_sizes(s, 8, stages, 10)[1],
            tg.lr_factor(s, 8, stages, 0.0, 0.01), tg.mtp_weights(s, 8, stages)) for s in range(10)]
    assert [g[0] for g in got] == [64, 64, 128, 128, 192, 192, 256, 256, 256, 256]
    assert [g[1] for g in got] == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert [g[2] for g in got[:8]] == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0]    # one step later at exact starts
    assert [g[3] for g in got[:4]] == [(1.0, 0.5), (1.0, 0.25), (1.0, 0.5), (1.0, 0.25)]
    assert got[7][3] == (1.0, 0.125) and got[9][3] == (1.0, 0.0)     # the last stage fades too, to 0 at its end


@pytest.mark.parametrize("step,mu", [(0, 0.85), (150, 0.90), (299, 0.85 + 0.1 * 299 / 300), (300, 0.95),
                                     (1715, 0.95), (1724, 0.932), (1764, 0.852)])
def test_momentum(step, mu):
    got = tg.muon_momentum(step, HP.num_iterations, HP.momentum_min, HP.momentum_max,
                           HP.momentum_warmup_steps, HP.momentum_cooldown_steps)
    assert got == pytest.approx(mu, abs=1e-12)


def test_mtp_weights():
    w = lambda s: tg.mtp_weights(s, NS, HP.stages)
    assert w(0) == (1.0, 0.5, 0.25)
    assert w(574)[2] == pytest.approx(0.000434783, abs=1e-9)
    assert w(575) == (1.0, 0.5)                       # 575/1725 is the double nearest 1/3: 3x rounds to 1
    assert w(1149)[1] == pytest.approx(0.000869565, abs=1e-9)
    assert w(1150) == (1.0,) and w(1764) == (1.0,)


def test_the_step_hands_the_model_each_mtp_weight_rounded_once_to_float32():
    """The model sees fp32(w) of every schedule weight, as torch.tensor(w, dtype=float32) makes it (one rounding
    from the double), at every step of the default schedule."""
    host = SimpleNamespace(device=torch.device("cpu"))      # all that Trainer.mtp_weights reads
    for step in range(HP.num_iterations):
        sched = tg.schedule_at(step, HP)
        got = tg.Trainer.mtp_weights(host, sched)
        want = torch.tensor(sched.mtp_weights, dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, want), step


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


def test_attn_scale_after_yarn_matches_the_record():
    # the schedule's window changes drive YaRN: scale *= 1 + 0.2 ln(b/a) at 3->7->11->13
    scale, prev = 0.1, 3
    expected = [0.11694596, 0.12751752, 0.13177799]
    for new, want in zip((7, 11, 13), expected):
        scale *= 1 + 0.2 * math.log(new / prev)
        prev = new
        assert scale == pytest.approx(want, abs=1e-8)


# ---- the plan in closed form (issue 56): nothing before training walks the steps ------------------------------------

def _walked_variant_starts(hp):
    """The step walk variant_starts replaced, kept as the reference."""
    shapes = [(sc.ws_short, sc.ws_long, sc.global_batch, len(sc.mtp_weights))
              for sc in (tg.schedule_at(s, hp) for s in range(hp.num_iterations))]
    return [0] + [s for s in range(1, hp.num_iterations) if shapes[s] != shapes[s - 1]]


class _YarnRecorder:
    """All of the model that replay_yarn touches: the calls it makes, in order."""
    def __init__(self):
        self.calls = []

    def reset_rotary(self):
        self.calls.append("reset")

    def apply_yarn(self, old, new):
        self.calls.append((old, new))


def _walked_yarn(hp, steps_done):
    calls, ws_long = ["reset"], tg.schedule_at(0, hp).ws_long
    for step in range(min(steps_done, hp.num_iterations)):
        new = tg.schedule_at(step, hp).ws_long
        if new != ws_long:
            calls.append((ws_long, new))
            ws_long = new
    return calls, ws_long


def _random_hp(rng):
    n = int(rng.integers(1, 6))
    stages = tuple(tg.Stage(int(rng.integers(1, 5)) * 256, float(rng.uniform(0.5, 2)), int(rng.integers(1, 6)),
                            tuple([1.0] + [0.5] * int(rng.integers(0, 3)))) for _ in range(n))
    return tg.parse_args(["--preset=tiny", f"--num_scheduled_iterations={int(rng.integers(n, 120))}",
                          f"--num_extension_iterations={int(rng.integers(0, 12))}",
                          f"--ws_long_extension={int(rng.integers(1, 6))}", f"--stages={harness.show(stages)}"])


def _plans():
    rng = np.random.default_rng(56)
    return [HP, tg.parse_args(["--preset=tiny"]), *(_random_hp(rng) for _ in range(40)),
            tg.parse_args(["--num_scheduled_iterations=3"]), tg.parse_args(["--num_scheduled_iterations=7"])]


def test_the_closed_form_plan_equals_the_step_walk():
    """Token counts, compiled variants, warmup steps and the YaRN replay, computed per stage, are exactly what
    walking every step gave: the default and tiny presets and random small stage tables."""
    for hp in _plans():
        total = hp.num_iterations
        batches = [tg.schedule_at(s, hp).global_batch for s in range(total)]
        segments = tg.batch_segments(total, hp.num_scheduled_iterations, hp.stages)
        assert [tg.tokens_before(d, segments) for d in range(total + 1)] == [0, *np.cumsum(batches).tolist()]
        assert tg.train_tokens_needed(hp) == sum(batches)
        assert tg.variant_starts(hp) == _walked_variant_starts(hp), hp.stages
        for done in sorted({0, 1, total // 2, hp.num_scheduled_iterations, total - 1, total, total + 5}):
            model = _YarnRecorder()
            ws_long = tg.replay_yarn(model, hp, done)
            assert (model.calls, ws_long) == _walked_yarn(hp, done), (hp.stages, done)


def test_a_billion_steps_is_planned_without_walking_them(monkeypatch):
    """10^9 scheduled steps: the token count, the variants, the warmup steps and the YaRN replay each look at a
    handful of steps (the stage boundaries). The budget on stage_index (which every per-step schedule function calls)
    is the hang guard: a per-step walk stops at once with an error instead of running for hours."""
    calls = {"n": 0}
    stage_index = tg.stage_index

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1000:
            raise AssertionError("the plan walks the steps")
        return stage_index(*args, **kwargs)
    monkeypatch.setattr(tg, "stage_index", counted)
    hp = tg.parse_args(["--num_scheduled_iterations=1000000000"])
    assert tg.train_tokens_needed(hp) == (333_333_334 * 131072 + 333_333_333 * 262144
                                          + (333_333_333 + 40) * 393216)
    assert tg.variant_starts(hp) == [0, 333_333_334, 666_666_667, 1_000_000_000]
    assert 1_000_000_001 in tg.warmup_steps(hp)
    model = _YarnRecorder()
    assert tg.replay_yarn(model, hp, hp.num_iterations) == 13 and model.calls == ["reset", (3, 7), (7, 11), (11, 13)]
    assert calls["n"] < 1000
