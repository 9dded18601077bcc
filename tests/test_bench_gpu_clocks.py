"""bench/gpu_clocks.py: per-GPU clock and power from an nvidia-smi log, counting only samples under load."""
import sys

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_clocks  # noqa: E402


def test_each_gpu_gets_its_loaded_samples_summarised(tmp_path, capsys):
    log = tmp_path / "clocks.csv"
    log.write_text("0, 1980, 120.5, 40, 0x0000000000000000\n"      # idle: not counted
                   "1, 1500, 690.0, 60, 0x0000000000000004\n"
                   "0, 1600, 695.0, 55, 0x0000000000000004\n"
                   "0, 1700, 650.0, 57, 0x0000000000000000\n"
                   "1, [N/A], 690.0, 61, 0x0\n"                      # unparsable: skipped
                   "0, 1650, 700.0, 56, 0x0000000000000008\n"
                   "1, 1520, 680.0, 62, 0x0000000000000004\n"
                   "0, 16")                                          # cut off by the kill
    assert gpu_clocks.main([str(log)]) == 0
    gpu0, gpu1 = capsys.readouterr().out.splitlines()
    assert gpu0 == ("gpu0: 3 samples at 300 W or more: SM clock median 1650 MHz, mean 1650; power median 695 W; "
                    "power-capped in 67%; up to 57 C")
    assert gpu1 == ("gpu1: 2 samples at 300 W or more: SM clock median 1510 MHz, mean 1510; power median 685 W; "
                    "power-capped in 100%; up to 62 C")
    assert gpu_clocks.main([str(log), "--min_watts=2000"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "gpu0: no sample at 2000 W or more (of 4)"


def test_a_missing_or_empty_log_is_one_error_line(tmp_path, capsys):
    assert gpu_clocks.main([str(tmp_path / "none.csv")]) == 1
    (tmp_path / "empty.csv").write_text("index, clocks.sm [MHz]\n")
    assert gpu_clocks.main([str(tmp_path / "empty.csv")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
