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


# ---- record 84's schedule, transcribed apart from the code under test ---------------------------------------------

RECORD_STAGES = (   # lr peak, global batch, long window, L_max, MTP start, MTP end; the extension row last
    (1.0, 131072, 3, 896, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0)),
    (1.52, 262144, 7, 2048, (1.0, 0.5), (1.0, 0.0)),
    (1.73, 393216, 11, 2048, (1.0,), (1.0,)),
    (1.0, 393216, 13, 2048, (1.0,), (1.0,)),
)


def record_schedule(step, ns=1380, ne=10):
    """The record's stages, lr cooldown, momentum warmup and cooldown and MTP weights, written out: (stage 1..4,
    batch, L_max, (short, long), lr, mu) and the MTP weights, all doubles. Stage 4 is the extension."""
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
    peak, batch, ws_long, cap, a, b = RECORD_STAGES[k]
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
    return k + 1, batch, cap, (ws_long // 2, ws_long), lr, mu, mtp


def test_totals():
    assert HP.num_iterations == 1390
    assert HP.untie_step == 921                                        # the last stage's first step, odd: 920 | 1
    assert tg.stage_starts(NS, 3) == [0, 460, 920]
    assert tg.train_tokens_needed(HP) == 365_690_880                   # 460, 460, 470 steps of 128, 256, 384 Ki tokens


def test_every_step_is_the_transcribed_schedule():
    """Steps 0..1390: stage, batch, L_max, windows, lr and mu (double, ==), mu as fp32, and the MTP weights the model
    gets (fp32), against record_schedule."""
    host = SimpleNamespace(device=torch.device("cpu"))      # all that Trainer.mtp_weights reads
    for step in range(HP.num_iterations + 1):
        stage, batch, cap, ws, lr, mu, mtp = record_schedule(step)
        s = tg.schedule_at(step, HP)
        assert tg.stage_index(step, NS, 3) == min(stage, 3) - 1, step
        assert (s.global_batch, s.max_doc_len, (s.ws_short, s.ws_long)) == (batch, cap, ws), step
        assert s.lr_factor == lr and s.momentum == mu, step
        assert np.float32(s.momentum) == np.float32(mu), step
        got = tg.Trainer.mtp_weights(host, s)
        assert got.dtype == torch.float32 and got.tolist() == [float(np.float32(w)) for w in mtp], step


@pytest.mark.parametrize("ns", [3, 4, 5, 7, 9, 60, 100, 999, 1725, 2000])
def test_other_lengths_follow_the_same_formulas(ns):
    hp = tg.Hyperparameters(num_scheduled_iterations=ns)
    for step in range(hp.num_iterations + 1):
        _, batch, cap, ws, lr, mu, mtp = record_schedule(step, ns)
        s = tg.schedule_at(step, hp)
        assert (s.global_batch, s.max_doc_len, (s.ws_short, s.ws_long), s.lr_factor, s.momentum, s.mtp_weights) == \
            (batch, cap, ws, lr, mu, mtp), (ns, step)


# The record's schedule at its boundary steps, worked out by hand: step, stage, batch, L_max, windows, lr_sched,
# mu (double), mu (fp32), MTP weights (fp32)
BOUNDARY_STEPS = [
    (0, 1, 131072, 896, (1, 3), 1.0, 0.85, 0.8500000238418579, [1, 0.5, 0.25]),
    (1, 1, 131072, 896, (1, 3), 1.0, 0.8503333333333333, 0.8503333330154419, [1, 0.5, 0.249456524848938]),
    (299, 1, 131072, 896, (1, 3), 1.0, 0.9496666666666667, 0.9496666789054871, [1, 0.5, 0.08749999850988388]),
    (459, 1, 131072, 896, (1, 3), 1.0, 0.95, 0.949999988079071, [1, 0.5, 0.0005434782360680401]),
    (460, 2, 262144, 2048, (3, 7), 1.52, 0.95, 0.949999988079071, [1, 0.5]),
    (552, 2, 262144, 2048, (3, 7), 1.52, 0.95, 0.949999988079071, [1, 0.4000000059604645]),
    (553, 2, 262144, 2048, (3, 7), 1.5183454106280194, 0.95, 0.949999988079071, [1, 0.39891305565834045]),
    (919, 2, 262144, 2048, (3, 7), 0.9127657004830918, 0.95, 0.949999988079071, [1, 0.0010869564721360803]),
    (920, 3, 393216, 2048, (5, 11), 1.027777777777778, 0.95, 0.949999988079071, [1]),
    (921, 3, 393216, 2048, (5, 11), 1.0258695652173913, 0.95, 0.949999988079071, [1]),
    (1200, 3, 393216, 2048, (5, 11), 0.49347826086956514, 0.95, 0.949999988079071, [1]),
    (1340, 3, 393216, 2048, (5, 11), 0.22632850241545893, 0.95, 0.949999988079071, [1]),
    (1341, 3, 393216, 2048, (5, 11), 0.22442028985507245, 0.948, 0.9480000138282776, [1]),
    (1379, 3, 393216, 2048, (5, 11), 0.15190821256038647, 0.872, 0.871999979019165, [1]),
    (1380, 4, 393216, 2048, (6, 13), 0.15, 0.87, 0.8700000047683716, [1]),
    (1389, 4, 393216, 2048, (6, 13), 0.15, 0.852, 0.8519999980926514, [1]),
]


@pytest.mark.parametrize("row", BOUNDARY_STEPS, ids=lambda r: f"step{r[0]}")
def test_schedule_at_the_boundary_steps(row):
    step, stage, batch, cap, ws, lr, mu, mu32, mtp32 = row
    s = tg.schedule_at(step, HP)
    assert min(stage, 3) - 1 == tg.stage_index(step, NS, 3)
    assert (s.global_batch, s.max_doc_len, (s.ws_short, s.ws_long)) == (batch, cap, ws)
    assert s.lr_factor == lr and s.momentum == mu and float(np.float32(s.momentum)) == mu32
    assert [float(np.float32(w)) for w in s.mtp_weights] == mtp32


@pytest.mark.parametrize("step,lr", [(552, 1.52), (553, 1.5183454106280194), (919, 0.9127657004830918),
                                     (920, 1.027777777777778), (921, 1.0258695652173913), (1200, 0.49347826086956514),
                                     (1379, 0.15190821256038647), (1380, 0.15), (1389, 0.15), (551, 1.52),
                                     (460, 1.52), (459, 1.0), (0, 1.0)])
def test_lr_factor_examples(step, lr):
    assert tg.lr_factor(step, NS, HP.stages, HP.lr_min, HP.cooldown_frac) == lr     # bit-exact doubles


@pytest.mark.parametrize("step,mu", [(0, 0.85), (1, 0.8503333333333333), (299, 0.9496666666666667), (300, 0.95),
                                     (1340, 0.95), (1341, 0.948), (1379, 0.872), (1380, 0.87), (1389, 0.852)])
def test_momentum_examples(step, mu):
    got = tg.muon_momentum(step, HP.num_iterations, HP.momentum_min, HP.momentum_max,
                           HP.momentum_warmup_steps, HP.momentum_cooldown_steps)
    assert got == mu                                                                 # bit-exact doubles


def test_mtp_weight_examples():
    w32 = lambda s: [float(np.float32(w)) for w in tg.mtp_weights(s, NS, HP.stages)]
    assert w32(1)[2] == 0.249456524848938 and w32(459)[2] == 0.0005434782360680401
    assert w32(461)[1] == float(np.float32(0.5 + (0.0 - 0.5) * (1 / 460)))
    assert w32(919)[1] == 0.0010869564721360803
    assert all(w > 0 for s in range(HP.num_iterations) for w in w32(s))      # no weight is ever exactly 0
    assert len(w32(459)) == 3 and len(w32(460)) == 2 and len(w32(920)) == 1  # the length changes with the batch


def test_stage_boundaries_are_the_rounded_running_sums():
    """round(ns * (1/3 + 1/3)) with the double sum, not ns * 2 // 3 or ceil: they differ where ns/3 has a
    fraction."""
    assert tg.stage_starts(1000, 3) == [0, 333, 667] and tg.stage_starts(1001, 3) == [0, 334, 667]
    assert tg.stage_starts(1725, 3) == [0, 575, 1150] and tg.stage_starts(10, 4) == [0, 2, 5, 8]
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


def test_mtp_weights_are_a_plus_b_minus_a_times_t():
    """The record's form a + (b - a) t, not a (1 - t) + b t (the same doubles for the record's weights, not for
    these): a stage of 7 steps from 0.3 to 0.7, then 0.1 to 0.9."""
    stages = (tg.Stage(64, 1.0, 2, (1.0, 0.3), (1.0, 0.7), 32), tg.Stage(64, 1.0, 2, (0.1,), (0.9,), 32))
    want = [(1.0, 0.3 + (0.7 - 0.3) * (s / 7)) for s in range(7)] + [(0.1 + (0.9 - 0.1) * ((s - 7) / 7),)
                                                                    for s in range(7, 14)] + [(0.9,)]
    assert [tg.mtp_weights(s, 14, stages) for s in range(15)] == want
    assert any(w[-1] != (0.3 * (1 - s / 7) + 0.7 * (s / 7)) for s, w in enumerate(want[:7]))


def test_schedule_at_parity_and_fields():
    s = tg.schedule_at(921, HP)
    assert s.do_adam and not tg.schedule_at(920, HP).do_adam
    assert (s.ws_short, s.ws_long, s.global_batch, s.max_doc_len) == (5, 11, 393216, 2048)


def test_seven_validations():
    assert [s for s in range(HP.num_iterations + 1) if tg.validates_at(s, HP.num_iterations, HP.val_loss_every)] == \
        [0, 250, 500, 750, 1000, 1250, 1390]                           # every 250 steps, and the last
    assert [s for s in range(11) if tg.validates_at(s, 10, 0)] == [10]


def _shape(hp, step):
    sc = tg.schedule_at(step, hp)
    return sc.ws_short, sc.ws_long, sc.global_batch, sc.max_doc_len, len(sc.mtp_weights)


def test_warmup_steps_cover_every_variant_and_the_split():
    assert tg.variant_starts(HP) == [0, 460, 920, 1380]
    assert tg.warmup_steps(HP) == [0, 1, 2, 459, 460, 461, 919, 920, 921, 1379, 1380, 1381]
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


def test_the_loader_hears_of_the_batch_and_cap_at_460_and_920_only():
    """Trainer.advance_schedule over the whole run from the reset state: messages (global batch, L_max, A) at the
    stage starts, none at 1380 (the extension keeps the last stage's batch and cap)."""
    host = SimpleNamespace(model=_YarnRecorder(), ws_long=3, global_batch=131072, max_doc_len=896, grad_accum=8)
    sent = {}
    for step in range(HP.num_iterations):
        if (msg := tg.Trainer.advance_schedule(host, tg.schedule_at(step, HP))) is not None:
            sent[step] = msg
    assert sent == {460: (262144, 2048, 8), 920: (393216, 2048, 8)}
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
                                          + (333_333_333 + 10) * 393216)
    assert tg.variant_starts(hp) == [0, 333_333_333, 666_666_667, 1_000_000_000]
    assert 1_000_000_001 in tg.warmup_steps(hp)
    model = _YarnRecorder()
    assert tg.replay_yarn(model, hp, hp.num_iterations) == 13 and model.calls == ["reset", (3, 7), (7, 11), (11, 13)]
    assert calls["n"] < 1000
