"""bench/gc_pauses.py: only the collections from the timed loop's start on are counted, by generation."""
import gc
import sys

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gc_pauses  # noqa: E402
import harness  # noqa: E402
import train_gpt  # noqa: E402


def test_counts_collections_after_the_timed_loop_starts(monkeypatch, capsys):
    started = []

    def fake_run(argv):
        assert argv == ["--seed=3"]
        gc.collect(1)                           # setup: not counted
        harness.Bookkeeping.start(None)         # the timed loop starts
        gc.collect(2)
        gc.collect(2)
        gc.collect(0)
        return 7

    monkeypatch.setattr(harness.Bookkeeping, "start", lambda self: started.append(self))
    monkeypatch.setattr(train_gpt, "main", fake_run)
    callbacks, enabled = list(gc.callbacks), gc.isenabled()
    gc.disable()   # only the explicit collections above, none of the automatic ones
    try:
        assert gc_pauses.main(["--seed=3"]) == 7
    finally:
        gc.callbacks[:] = callbacks
        if enabled:
            gc.enable()
    assert started == [None]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gc pauses from the timed loop's start to the end:"
    counts = [int(line.split(": ")[1].split()[0]) for line in lines[1:]]
    assert counts == [1, 0, 2]
