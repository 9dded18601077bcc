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


# ---- record 89's schedule, transcribed apart from the code under test ---------------------------------------------

RECORD_STAGES = (   # lr peak, global batch, long window, L_max, MTP start, MTP end, prefix weight start, end; the
                    # extension row last
    (1.0, 131072, 3, 896, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25),
    (1.52, 262144, 7, 2048, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0),
    (1.73, 393216, 11, 2048, (1.0,), (1.0,), 0.0, 0.0),
    (1.0, 393216, 13, 2048, (1.0,), (1.0,), 0.0, 0.0),
)


def record_schedule(step, ns=1270, ne=15):
    """The record's stages, lr cooldown, momentum warmup and cooldown, MTP and prefix-token weights, written out:
    (stage 1..4, batch, L_max, (short, long), lr, mu, the MTP weights, w_p), all doubles. Stage 4 is the extension."""
    ends, c = [0], 0.0
    for _ in range(3):
        c += 1 / 3
        ends.append(round(ns * c))
    ends.append(ns + ne)
    k = next((k for k in range(4) if step < ends[k + 1]), None)
    if k is None:                                          # past the last step: the extension with t = 1
        k, t = 3, 1.0
    else:
        t = (step - ends[k]) / (ends[k + 1] - ends[k])
    peak, batch, ws_long, cap, a, b, pa, pb = RECORD_STAGES[k]
    cd = int(ns * (1 - 0.6))
    if step < cd:
        lr = peak
    else:
        u = min(1, (step - cd) / (ns - cd))
        lr = peak * (1 - u) + 0.15 * u
    n_tot = ns + ne
    if step < 300:
        mu = 0.85 + (step / 300) * (0.95 - 0.85)
    elif step > n_tot - 50:
        mu = 0.95 - ((step - (n_tot - 50)) / 50) * (0.95 - 0.85)
    else:
        mu = 0.95
    mtp = tuple(ak + (bk - ak) * t for ak, bk in zip(a, b))
    return k + 1, batch, cap, (ws_long // 2, ws_long), lr, mu, mtp, pa + (pb - pa) * t


def test_totals():
    assert HP.num_iterations == 1285
    assert HP.untie_step == 847                                        # the last stage's first step, odd: 847 | 1
    assert tg.stage_starts(NS, 3) == [0, 423, 847]
    assert tg.train_tokens_needed(HP) == 338_821_120                   # 423, 424, 438 steps of 128, 256, 384 Ki tokens


def test_every_step_is_the_transcribed_schedule():
    """Steps 0..1285: stage, batch, L_max, windows, lr and mu (double, ==), mu as fp32, and the MTP weights and the
    prefix-token weight the model gets (fp32), against record_schedule."""
    host = SimpleNamespace(device=torch.device("cpu"))      # all that Trainer.mtp_weights / prefix_weight read
    for step in range(HP.num_iterations + 1):
        stage, batch, cap, ws, lr, mu, mtp, w_p = record_schedule(step)
        s = tg.schedule_at(step, HP)
        assert tg.stage_index(step, NS, 3) == min(stage, 3) - 1, step
        assert (s.global_batch, s.max_doc_len, (s.ws_short, s.ws_long)) == (batch, cap, ws), step
        assert s.lr_factor == lr and s.momentum == mu and s.prefix_weight == w_p, step
        assert np.float32(s.momentum) == np.float32(mu), step
        got = tg.Trainer.mtp_weights(host, s)
        assert got.dtype == torch.float32 and got.tolist() == [float(np.float32(w)) for w in mtp], step
        got = tg.Trainer.prefix_weight(host, s)
        assert got.dtype == torch.float32 and got.shape == (1,) and got.item() == float(np.float32(w_p)), step


@pytest.mark.parametrize("ns", [3, 4, 5, 7, 9, 60, 100, 999, 1725, 2000])
def test_other_lengths_follow_the_same_formulas(ns):
    hp = tg.Hyperparameters(num_scheduled_iterations=ns)
    for step in range(hp.num_iterations + 1):
        _, batch, cap, ws, lr, mu, mtp, w_p = record_schedule(step, ns)
        s = tg.schedule_at(step, hp)
        assert (s.global_batch, s.max_doc_len, (s.ws_short, s.ws_long), s.lr_factor, s.momentum, s.mtp_weights,
                s.prefix_weight) == (batch, cap, ws, lr, mu, mtp, w_p), (ns, step)


# The record's schedule at its boundary steps, worked out apart from the code (the specification's table): step,
# stage, batch, L_max, windows, lr_sched, mu (double), mu (fp32), MTP weights (fp32), prefix weight w_p (fp32)
BOUNDARY_STEPS = [
    (0, 1, 131072, 896, (1, 3), 1.0, 0.85, 0.8500000238418579, [1, 0.5, 0.25], 0.25),
    (1, 1, 131072, 896, (1, 3), 1.0, 0.8503333333333333, 0.8503333330154419, [1, 0.5, 0.24940899014472961], 0.25),
    (299, 1, 131072, 896, (1, 3), 1.0, 0.9496666666666667, 0.9496666789054871, [1, 0.5, 0.07328604906797409], 0.25),
    (422, 1, 131072, 896, (1, 3), 1.0, 0.95, 0.949999988079071, [1, 0.5, 0.0005910165491513908], 0.25),
    (423, 2, 262144, 2048, (3, 7), 1.52, 0.95, 0.949999988079071, [1, 0.5], 0.25),
    (424, 2, 262144, 2048, (3, 7), 1.52, 0.95, 0.949999988079071, [1, 0.4988207519054413], 0.24941037595272064),
    (508, 2, 262144, 2048, (3, 7), 1.52, 0.95, 0.949999988079071, [1, 0.39976415038108826], 0.19988207519054413),
    (509, 2, 262144, 2048, (3, 7), 1.518202099737533, 0.95, 0.949999988079071, [1, 0.39858490228652954],
     0.19929245114326477),
    (846, 2, 262144, 2048, (3, 7), 0.9123097112860894, 0.95, 0.949999988079071, [1, 0.001179245300590992],
     0.000589622650295496),
    (847, 3, 393216, 2048, (5, 11), 1.0270866141732282, 0.95, 0.949999988079071, [1], 0.0),
    (1000, 3, 393216, 2048, (5, 11), 0.7098425196850394, 0.95, 0.949999988079071, [1], 0.0),
    (1236, 3, 393216, 2048, (5, 11), 0.22049868766404193, 0.948, 0.9480000138282776, [1], 0.0),
    (1269, 3, 393216, 2048, (5, 11), 0.15207349081364835, 0.882, 0.8820000290870667, [1], 0.0),
    (1270, 4, 393216, 2048, (6, 13), 0.15, 0.88, 0.8799999952316284, [1], 0.0),
    (1284, 4, 393216, 2048, (6, 13), 0.15, 0.852, 0.8519999980926514, [1], 0.0),
]


@pytest.mark.parametrize("row", BOUNDARY_STEPS, ids=lambda r: f"step{r[0]}")
def test_schedule_at_the_boundary_steps(row):
    step, stage, batch, cap, ws, lr, mu, mu32, mtp32, w_p32 = row
    s = tg.schedule_at(step, HP)
    assert min(stage, 3) - 1 == tg.stage_index(step, NS, 3)
    assert (s.global_batch, s.max_doc_len, (s.ws_short, s.ws_long)) == (batch, cap, ws)
    assert s.lr_factor == lr and s.momentum == mu and float(np.float32(s.momentum)) == mu32
    assert [float(np.float32(w)) for w in s.mtp_weights] == mtp32
    assert float(np.float32(s.prefix_weight)) == w_p32


@pytest.mark.parametrize("step,lr", [(508, 1.52), (509, 1.518202099737533), (846, 0.9123097112860894),
                                     (847, 1.0270866141732282), (1000, 0.7098425196850394),
                                     (1269, 0.15207349081364835), (1270, 0.15), (1284, 0.15), (507, 1.52),
                                     (423, 1.52), (422, 1.0), (0, 1.0)])
def test_lr_factor_examples(step, lr):
    assert tg.lr_factor(step, NS, HP.stages, HP.lr_min, HP.cooldown_frac) == lr     # bit-exact doubles


@pytest.mark.parametrize("step,mu", [(0, 0.85), (1, 0.8503333333333333), (299, 0.9496666666666667), (300, 0.95),
                                     (1235, 0.95), (1236, 0.948), (1269, 0.882), (1270, 0.88), (1284, 0.852)])
def test_momentum_examples(step, mu):
    got = tg.muon_momentum(step, HP.num_iterations, HP.momentum_min, HP.momentum_max,
                           HP.momentum_warmup_steps, HP.momentum_cooldown_steps)
    assert got == mu                                                                 # bit-exact doubles


def test_mtp_weight_examples():
    w32 = lambda s: [float(np.float32(w)) for w in tg.mtp_weights(s, NS, HP.stages)]
    assert w32(1)[2] == 0.24940899014472961 and w32(422)[2] == 0.0005910165491513908
    assert w32(424)[1] == float(np.float32(0.5 + (0.0 - 0.5) * (1 / 424)))
    assert w32(846)[1] == 0.001179245300590992
    assert all(w > 0 for s in range(HP.num_iterations) for w in w32(s))      # no weight is ever exactly 0
    assert len(w32(422)) == 3 and len(w32(423)) == 2 and len(w32(847)) == 1  # the length changes with the batch


def test_prefix_weight_examples():
    """w_p = a + (b - a) t per stage, like the MTP weights (upstream record 88): 0.25 through stage 1, 0.25 (1 - (s -
    423)/424) over stage 2 (never 0 there), 0 from 847 on and in the extension; the fp32 value the loss gets."""
    w = lambda s: tg.prefix_weight(s, NS, HP.stages)                               # noqa: E731
    assert {w(s) for s in range(423)} == {0.25}
    assert [w(s) for s in range(423, 847)] == [0.25 + (0.0 - 0.25) * ((s - 423) / 424) for s in range(423, 847)]
    assert all(w(s) > 0 for s in range(847)) and {w(s) for s in range(847, HP.num_iterations + 2)} == {0.0}
    assert float(np.float32(w(424))) == 0.24941037595272064 and float(np.float32(w(846))) == 0.000589622650295496
    # the record's form a + (b - a) t, not a (1 - t) + b t: different doubles on this stage
    stages = (tg.Stage(64, 1.0, 2, (1.0,), (1.0,), 32, 0.3, 0.7), tg.Stage(64, 1.0, 2, (1.0,), (1.0,), 32, 0.1, 0.9))
    want = [0.3 + (0.7 - 0.3) * (s / 7) for s in range(7)] + [0.1 + (0.9 - 0.1) * ((s - 7) / 7) for s in range(7, 14)]
    assert [tg.prefix_weight(s, 14, stages) for s in range(15)] == want + [0.9]
    assert any(a != 0.3 * (1 - s / 7) + 0.7 * (s / 7) for s, a in enumerate(want[:7]))


def test_stage_boundaries_are_the_rounded_running_sums():
    """round(ns * (1/3 + 1/3)) with the double sum, not ns * 2 // 3 or ceil: they differ where ns/3 has a
    fraction."""
    assert tg.stage_starts(1000, 3) == [0, 333, 667] and tg.stage_starts(1001, 3) == [0, 334, 667]
    assert tg.stage_starts(1725, 3) == [0, 575, 1150] and tg.stage_starts(10, 4) == [0, 2, 5, 8]
    assert tg.stage_starts(1270, 3) == [0, 423, 847]                  # 1270/3 = 423.33, 2540/3 = 846.67
    assert [tg.stage_index(s, 1440, 3) for s in (0, 479, 480, 959, 960, 1439, 1440, 5000)] == [0, 0, 1, 1, 2, 2, 2, 2]


def test_a_four_stage_table():
    stages = (tg.Stage(64, 1.0, 2, (1.0, 0.5), (1.0, 0.5), 32), tg.Stage(128, 2.0, 4, (1.0, 0.5), (1.0, 0.0), 64),
              tg.Stage(192, 3.0, 6, (1.0,), (1.0,), 64), tg.Stage(256, 4.0, 8, (1.0, 0.25), (1.0, 0.75), 128))
    got = [(tg.global_batch_size(s, 8, stages), tg.window_sizes(s, 8, stages, 10)[1],
            tg.lr_factor(s, 8, stages, 0.0, 0.01), tg.mtp_weights(s, 8, stages), tg.doc_len_cap(s, 8, stages))
           for s in range(10)]
    assert [g[0] for g in got] == [64, 64, 128, 128, 192, 192, 256, 256, 256, 256]
    assert [g[1] for g in got] == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert [g[2] for g in got[:8]] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]     # the peak moves with the batch
    assert [g[3] for g in got[:4]] == [(1.0, 0.5), (1.0, 0.5), (1.0, 0.5), (1.0, 0.25)]
    assert got[7][3] == (1.0, 0.5) and got[9][3] == (1.0, 0.75)     # the last stage moves too; then its end values
    assert [g[4] for g in got] == [32, 32, 64, 64, 64, 64, 128, 128, 128, 128]
    # a row without prefix weights has none (0): the loss of record 84
    assert {tg.prefix_weight(s, 8, stages) for s in range(10)} == {0.0}


def test_mtp_weights_are_a_plus_b_minus_a_times_t():
    """The record's form a + (b - a) t, not a (1 - t) + b t (the same doubles for the record's weights, not for
    these): a stage of 7 steps from 0.3 to 0.7, then 0.1 to 0.9."""
    stages = (tg.Stage(64, 1.0, 2, (1.0, 0.3), (1.0, 0.7), 32), tg.Stage(64, 1.0, 2, (0.1,), (0.9,), 32))
    want = [(1.0, 0.3 + (0.7 - 0.3) * (s / 7)) for s in range(7)] + [(0.1 + (0.9 - 0.1) * ((s - 7) / 7),)
                                                                    for s in range(7, 14)] + [(0.9,)]
    assert [tg.mtp_weights(s, 14, stages) for s in range(15)] == want
    assert any(w[-1] != (0.3 * (1 - s / 7) + 0.7 * (s / 7)) for s, w in enumerate(want[:7]))


def test_schedule_at_parity_and_fields():
    s = tg.schedule_at(847, HP)
    assert s.do_adam and not tg.schedule_at(846, HP).do_adam
    assert (s.ws_short, s.ws_long, s.global_batch, s.max_doc_len, s.prefix_weight) == (5, 11, 393216, 2048, 0.0)


def test_seven_validations():
    assert [s for s in range(HP.num_iterations + 1) if tg.validates_at(s, HP.num_iterations, HP.val_loss_every)] == \
        [0, 250, 500, 750, 1000, 1250, 1285]                           # every 250 steps, and the last
    assert [s for s in range(11) if tg.validates_at(s, 10, 0)] == [10]


def _shape(hp, step):
    sc = tg.schedule_at(step, hp)
    return sc.ws_short, sc.ws_long, sc.global_batch, sc.max_doc_len, len(sc.mtp_weights)


def test_warmup_steps_cover_every_variant_and_the_split():
    """Our warmup: 0, 1, 2, both sides of every variant change and the split step (847 = the stage-3 start). The
    record warms up {0, 1} and t-2..t+1 of each stage start instead ([0, 1, 421, ..., 1271]); both reset every state
    afterwards, so the choice changes no number. The prefix weight is a tensor input: no variant of its own."""
    assert tg.variant_starts(HP) == [0, 423, 847, 1270]
    assert tg.warmup_steps(HP) == [0, 1, 2, 422, 423, 424, 846, 847, 848, 1269, 1270, 1271]
    for hp in (HP, tg.parse_args(["--preset=tiny"]),
               tg.parse_args(["--preset=tiny", "--stages=512:1:3:1:1:64,512:1:3:1:1:128,768:1:3:1:1:128"])):
        steps = tg.warmup_steps(hp)
        shapes = {_shape(hp, s) for s in range(hp.num_iterations)}
        assert shapes == {_shape(hp, s) for s in steps}                # every compiled variant runs in the warmup
        assert hp.untie_step in steps and all(0 <= s < hp.num_iterations for s in steps)
    cap_only = tg.parse_args(["--preset=tiny", "--stages=512:1:3:1:1:64,512:1:3:1:1:128,768:1:3:1:1:128"])
    assert tg.variant_starts(cap_only) == [0, 20, 40, 60]               # a new document cap is a new variant


# ---- the trainer's side: loader messages and the doc cap across a resume -------------------------------------

class _YarnRecorder:
    """All of the model that replay_yarn touches: the calls it makes, in order."""
    def __init__(self):
        self.calls = []

    def reset_rotary(self):
        self.calls.append("reset")

    def apply_yarn(self, old, new):
        self.calls.append((old, new))


def test_the_loader_hears_of_the_batch_and_cap_at_423_and_847_only():
    """Trainer.advance_schedule over the whole run from the reset state: messages (global batch, L_max, A) at the
    stage starts, none at 1270 (the extension keeps the last stage's batch and cap)."""
    host = SimpleNamespace(model=_YarnRecorder(), ws_long=3, global_batch=131072, max_doc_len=896, grad_accum=8)
    sent = {}
    for step in range(HP.num_iterations):
        if (msg := tg.Trainer.advance_schedule(host, tg.schedule_at(step, HP))) is not None:
            sent[step] = msg
    assert sent == {423: (262144, 2048, 8), 847: (393216, 2048, 8)}
    assert host.model.calls == [(3, 7), (7, 11), (11, 13)]
    # a cap that changes alone is sent too
    hp = tg.parse_args(["--preset=tiny", "--stages=512:1:3:1:1:64,512:1:3:1:1:128,768:1:3:1:1:128"])
    host = SimpleNamespace(model=_YarnRecorder(), ws_long=3, global_batch=512, max_doc_len=64, grad_accum=2)
    sent = {s: m for s in range(hp.num_iterations)
            if (m := tg.Trainer.advance_schedule(host, tg.schedule_at(s, hp))) is not None}
    assert sent == {20: (512, 128, 2), 40: (768, 128, 2)}


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
    shapes = [_shape(hp, s) for s in range(hp.num_iterations)]
    return [0] + [s for s in range(1, hp.num_iterations) if shapes[s] != shapes[s - 1]]


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
    def stage():
        k = int(rng.integers(0, 3))
        return tg.Stage(int(rng.integers(1, 5)) * 256, float(rng.uniform(0.5, 2)), int(rng.integers(1, 6)),
                        (1.0,) + (0.5,) * k, (1.0,) + (0.25,) * k, int(rng.choice([64, 128, 256])))
    stages = tuple(stage() for _ in range(n))
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
    assert tg.train_tokens_needed(hp) == (333_333_333 * 131072 + 333_333_334 * 262144
                                          + (333_333_333 + 15) * 393216)
    assert tg.variant_starts(hp) == [0, 333_333_333, 666_666_667, 1_000_000_000]
    assert 1_000_000_001 in tg.warmup_steps(hp)
    model = _YarnRecorder()
    assert tg.replay_yarn(model, hp, hp.num_iterations) == 13 and model.calls == ["reset", (3, 7), (7, 11), (11, 13)]
    assert calls["n"] < 1000
