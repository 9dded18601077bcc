"""A newcomer's first CPU run: the tiny preset trains in float32 where the CPU emulates bf16 (and says so in one
line), long untimed phases show progress, and the ETA counts the validations still to come."""
import dataclasses
import re

import pytest

import checks
import harness
import train_gpt as tg
from _shards import make_dataset, run_trainer

WITH_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\n"
WITH_AVX512_BF16 = "flags\t\t: fpu avx512f avx512_bf16\n"
WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\nbugs\t\t: amx_bf16_in_a_bug_line\n"


def test_the_cpu_probe_reads_the_bf16_instruction_flags(monkeypatch):
    monkeypatch.delenv("NANOGPT_CPU_BF16", raising=False)
    assert checks.cpu_runs_bf16_natively(WITH_AMX) and checks.cpu_runs_bf16_natively(WITH_AVX512_BF16)
    assert not checks.cpu_runs_bf16_natively(WITHOUT)          # only the flags line counts
    assert not checks.cpu_runs_bf16_natively("")
    monkeypatch.setenv("NANOGPT_CPU_BF16", "emulated")
    assert not checks.cpu_runs_bf16_natively(WITH_AMX)
    monkeypatch.setenv("NANOGPT_CPU_BF16", "native")
    assert checks.cpu_runs_bf16_natively(WITHOUT)


@pytest.mark.parametrize("probe, device, want", [("emulated", "cpu", "float32"), ("native", "cpu", "bfloat16"),
                                                 ("emulated", "cuda", "bfloat16"), ("emulated", "meta", "bfloat16")])
def test_auto_dtype_is_float32_only_on_a_cpu_that_emulates_bf16(monkeypatch, probe, device, want):
    monkeypatch.setenv("NANOGPT_CPU_BF16", probe)
    tiny = tg.parse_args(["--preset=tiny"])
    assert tiny.dtype == "auto" and tg.Hyperparameters().dtype == "bfloat16"     # the record's runs bf16
    hp = tg.resolve_dtype(tiny, device)
    assert hp.dtype == want and dataclasses.replace(hp, dtype="auto") == tiny
    note = tg.dtype_note(tiny, hp)
    assert len(note) == (want == "float32") and all("--dtype=auto trains in float32" in n for n in note)
    if note:                                    # the note names what decided: here the override
        assert f"NANOGPT_CPU_BF16={probe} is set" in note[0] and "this CPU has no" not in note[0], note
    explicit = tg.parse_args(["--preset=tiny", "--dtype=bfloat16"])             # an explicit dtype stays
    assert tg.resolve_dtype(explicit, device).dtype == "bfloat16" and tg.dtype_note(explicit, explicit) == []


def test_without_the_override_the_dtype_note_names_the_cpus_missing_instructions(monkeypatch):
    monkeypatch.delenv("NANOGPT_CPU_BF16", raising=False)
    tiny = tg.parse_args(["--preset=tiny"])
    note = tg.dtype_note(tiny, dataclasses.replace(tiny, dtype="float32"))
    assert len(note) == 1 and "this CPU has no bf16 instructions" in note[0] and "NANOGPT_CPU_BF16" not in note[0]


def test_a_tiny_cpu_run_on_emulated_bf16_trains_in_float32_and_says_so_once(tmp_path):
    train, val = make_dataset(tmp_path / "data", train_tokens=60_000)
    args = ["--preset=tiny", f"--train_files={train}", f"--val_files={val}", "--seed=0", f"--log_dir={tmp_path}",
            "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--val_loss_every=0", "--run_id=cpu"]
    result = run_trainer(args, tmp_path, env={"NANOGPT_CPU_BF16": "emulated"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert len([line for line in out.splitlines() if "--dtype=auto trains in float32" in line]) == 1, out
    assert re.search(r"^world_size:1 .* dtype:float32 ", out, re.M), out
    log = (tmp_path / "cpu.txt").read_text()
    assert "  dtype = 'float32'" in log                       # the run's options: a resume keeps float32
    assert "  dtype = 'auto'" not in log


def test_validations_left_counts_what_validates_at_will_run():
    for total, every in ((1480, 250), (66, 20), (12, 4), (64, 20), (10, 0), (5, 1), (7, 10)):
        for done in range(total + 1):
            assert tg.validations_left(done, total, every) == sum(
                tg.validates_at(s, total, every) for s in range(done, total + 1)), (total, every, done)


def test_the_eta_counts_the_validations_still_to_come():
    plain = harness.progress_note(10, 100, 5000, 1_000_000, 20_000_000)
    assert plain == "  10% 200,000 tok/s ETA 1m35s"
    assert harness.progress_note(10, 100, 5000, 1_000_000, 20_000_000, untimed_left_s=60) == \
        "  10% 200,000 tok/s ETA 2m35s"
    assert harness.duration(3725) == "1h02m" and harness.duration(59.6) == "1m00s"


def test_a_long_phase_ticks_on_the_console_of_rank_0_only(capsys):
    progress = harness.Progress(0, "validation", 4, every_s=0.0)
    for done in range(1, 5):
        progress.tick(done)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" after ")[0] for line in lines] == [f"  validation: {d}/4" for d in (1, 2, 3)]
    assert all(line.endswith(" left") for line in lines)
    quiet = harness.Progress(1, "validation", 4, every_s=0.0)        # another rank
    quiet.tick(1)
    waits = harness.Progress(0, "validation", 4, every_s=3600.0)     # a phase shorter than every_s
    waits.tick(1)
    assert capsys.readouterr().out == ""


def test_help_names_every_exit_code_the_trainer_uses():
    text = harness.help_text(tg.Hyperparameters(), tg.PRESETS)
    exits = " ".join(line for line in text.splitlines() if "exit codes" in line or line.startswith("129 "))
    codes = [v for k, v in vars(harness).items() if k.startswith("EXIT_") and isinstance(v, int)]
    assert len(codes) >= 6
    for code in codes:
        assert re.search(rf"(?<![0-9]){code} [a-z]", exits), (code, exits)
