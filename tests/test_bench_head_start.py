"""bench/head_start.py: the GPU sleep comes before the step, is sized by the clock, and only on CUDA."""
import sys
from types import SimpleNamespace

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import head_start  # noqa: E402


def test_the_sleep_is_queued_before_the_step_at_the_clocks_cycles_per_ms():
    events = []

    def train_step(self, sched, message):
        events.append(("step", sched, message))
        return "loss"

    step = head_start.with_head_start(train_step, 40.0, lambda n: events.append(("sleep", n)),
                                      lambda device: 1_980_000 if device.index == 3 else 0)
    trainer = SimpleNamespace(device=SimpleNamespace(type="cuda", index=3))
    assert step(trainer, "sched", "message") == "loss"
    assert events == [("sleep", 79_200_000), ("step", "sched", "message")]


def test_no_sleep_off_cuda_or_at_zero():
    sleeps = []

    def train_step(self, sched, message):
        return sched

    for device_type, ms in (("cpu", 40.0), ("cuda", 0.0)):
        step = head_start.with_head_start(train_step, ms, sleeps.append, lambda device: 1_000_000)
        assert step(SimpleNamespace(device=SimpleNamespace(type=device_type, index=0)), 7, None) == 7
    assert sleeps == []
