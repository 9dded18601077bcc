"""The preflight memory estimate: every parameter and optimizer buffer counted as the run allocates it, and a size no
machine holds refused before anything is allocated, naming the option and the largest value that fits."""
import dataclasses
import re

import pytest
import torch

import checks
import train_gpt as tg
from _shards import make_dataset, run_trainer

GIB = 2**30


def _tiny(*args):
    return tg.resolve_dtype(tg.parse_args(["--preset=tiny", *args]), "cpu")


def _total(hp, world_size=1):
    return sum(tg.memory_parts(hp, world_size).values())


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_parameter_and_optimizer_buffer_is_counted_as_allocated(world_size):
    """The estimate's part for each parameter is its weight and gradient plus the buffers the optimizer allocates for
    it, byte for byte as a real model and optimizer on the CPU hold them (this rank's slice when sharded)."""
    hp = _tiny()
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    opt = tg.build_optimizer(hp, model, world_size - 1, world_size)
    parts = tg.memory_parts(hp, world_size)
    params = dict(model.named_parameters())
    assert set(params) <= set(parts)
    for label, p in params.items():
        held = 2 * p.numel() * p.element_size() + sum(b.numel() * b.element_size()
                                                      for b in opt.buffers[label].values())
        assert parts[label] == held, label
    assert {"activations", "logits"} <= set(parts) and min(parts.values()) > 0


def test_a_table_too_large_is_refused_naming_its_option_and_the_largest_value_that_fits():
    hp = _tiny("--bigram_vocab_size=10000000000")
    capacity = 2 * _total(_tiny())
    with pytest.raises(tg.ConfigError) as e:
        checks.check_memory(hp, lambda h: tg.memory_parts(h, 1), capacity, "per process")
    msg = str(e.value)
    assert "bigram_embed" in msg
    fix = msg.rpartition(":")[2]
    named = re.findall(r"--(\w+)=(\d+) to at most (\d+)", fix)
    assert [name for name, _, _ in named] == ["bigram_vocab_size"], msg   # the others alone cannot make it fit
    fit = int(named[0][2])   # in steps of 1024, the largest power of two dividing the value asked (at most 1024)
    assert fit % 1024 == 0
    assert _total(dataclasses.replace(hp, bigram_vocab_size=fit)) <= capacity
    assert _total(dataclasses.replace(hp, bigram_vocab_size=fit + 1024)) > capacity


def test_a_vocabulary_too_large_names_vocab_size():
    hp = _tiny("--vocab_size=2000000000")
    capacity = 4 * _total(_tiny())
    with pytest.raises(tg.ConfigError) as e:
        checks.check_memory(hp, lambda h: tg.memory_parts(h, 1), capacity, "per process")
    named = re.findall(r"--(\w+)=\d+ to at most (\d+)", str(e.value))
    assert "vocab_size" in [name for name, _ in named] and "bigram_vocab_size" not in [n for n, _ in named]
    fit = int(dict(named)["vocab_size"])
    tg.validate_hyperparameters(dataclasses.replace(hp, vocab_size=fit), 1)   # a value the options' checks take
    assert _total(dataclasses.replace(hp, vocab_size=fit)) <= capacity < _total(dataclasses.replace(hp,
                                                                                                vocab_size=fit + 1024))


def test_batches_too_large_name_the_stages_when_no_size_option_alone_fits():
    hp = _tiny()
    big = tuple(dataclasses.replace(st, batch=st.batch * 2**16) for st in hp.stages)
    hp = dataclasses.replace(hp, stages=big)
    parts = tg.memory_parts(hp, 1)
    capacity = sum(parts.values()) - parts["activations"] // 2
    with pytest.raises(tg.ConfigError, match=r"lower the batches in --stages"):
        checks.check_memory(hp, lambda h: tg.memory_parts(h, 1), capacity, "per process")


def test_a_size_that_fits_gives_the_estimate_note():
    hp = _tiny()
    note = checks.check_memory(hp, lambda h: tg.memory_parts(h, 1), 2 * _total(hp), "per process")
    assert note == f"memory estimate: about {_total(hp) / GIB:.1f} GiB per process"


def test_host_memory_is_what_meminfo_calls_available():
    meminfo = "MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n"
    assert checks.host_memory_available(meminfo) == 20000000 * 1024
    assert checks.host_memory_available("MemTotal: 5 kB\n") is None


def test_the_trainer_refuses_a_bigram_table_no_host_holds_before_allocating(tmp_path):
    """One error line naming the option, the options exit code, no internal error (the allocator is never asked)."""
    train, val = make_dataset(tmp_path / "data")
    r = run_trainer(["--preset=tiny", "--bigram_vocab_size=10000000000", f"--train_files={train}",
                     f"--val_files={val}"], cwd=tmp_path, timeout=300)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(errors) == 1 and "--bigram_vocab_size=10000000000 to at most" in errors[0], errors
    assert "Traceback" not in r.stderr and "allocate" not in r.stdout + r.stderr
