"""Every bad input ends in a clear message and exit status, early, never a hang or a bare traceback."""
import numpy as np
import pytest

from _shards import BOS, make_dataset, run_trainer, structured_docs, write_shard

SHORT = ["--preset=tiny", "--num_scheduled_iterations=6", "--num_extension_iterations=0", "--warmup=false",
         "--val_loss_every=0", "--seed=0"]


def data_args(train, val):
    return [f"--train_files={train}", f"--val_files={val}"]


def tokens_trained(args):
    import train_gpt as tg
    return tg.train_tokens_needed(tg.parse_args(args))


def assert_clean_failure(proc, code, *needles):
    err = proc.stderr + proc.stdout
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in err, err[-3000:]


@pytest.mark.timeout(900)
def test_missing_data_names_the_download(tmp_path):
    p = run_trainer([*SHORT, f"--train_files={tmp_path}/nope/*.bin", f"--val_files={tmp_path}/nope/v*.bin"], tmp_path)
    assert_clean_failure(p, 1, "cached_fineweb10B.py")


@pytest.mark.timeout(900)
def test_short_val_shard(tmp_path):
    train, _ = make_dataset(tmp_path, train_tokens=300_000, val_tokens=20_000)
    write_shard(tmp_path / "fineweb_val_000000.bin", structured_docs(3_000, 1))     # < 4096 + look-ahead
    p = run_trainer([*SHORT, *data_args(train, tmp_path / "fineweb_val_*.bin")], tmp_path)
    assert_clean_failure(p, 1, "--val_tokens", "fineweb_val_000000.bin")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,needle", [("magic", "magic"), ("version", "version"), ("truncated", "truncated")])
def test_corrupt_train_shard(tmp_path, kind, needle):
    train, val = make_dataset(tmp_path, train_tokens=300_000, val_tokens=20_000, n_train_shards=2)
    bad = tmp_path / "fineweb_train_000002.bin"
    toks = structured_docs(150_000, 7)
    if kind == "magic":
        write_shard(bad, toks, magic=1234)
    elif kind == "version":
        write_shard(bad, toks, version=7)
    else:
        write_shard(bad, toks, claimed=len(toks) + 1000)
    p = run_trainer([*SHORT, *data_args(train, val)], tmp_path)
    assert_clean_failure(p, 1, "fineweb_train_000002.bin")
    assert needle in (p.stderr + p.stdout).lower()


@pytest.mark.timeout(900)
def test_too_little_training_data_for_the_schedule(tmp_path):
    train, val = make_dataset(tmp_path, train_tokens=tokens_trained(SHORT) * 9 // 10, val_tokens=20_000)
    p = run_trainer([*SHORT, *data_args(train, val)], tmp_path)
    assert_clean_failure(p, 1, "cached_fineweb10B.py", "--num_scheduled_iterations")


@pytest.mark.timeout(900)
def test_training_data_running_out_mid_run(tmp_path):
    # enough tokens to pass the preflight (>= the trained tokens) but not the ~1.4x the loader reads
    train, val = make_dataset(tmp_path, train_tokens=tokens_trained(SHORT) + 100, val_tokens=20_000)
    p = run_trainer([*SHORT, *data_args(train, val)], tmp_path)
    assert_clean_failure(p, 1, "ran out")


@pytest.mark.timeout(900)
def test_short_documents_overflow_cu_seqlens_is_caught_early(tmp_path):
    # documents of 3 tokens: a 512-token micro-batch holds ~170 segments but cu_seqlens has room for 127
    d = tmp_path
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 300, size=300_000)
    toks[::3] = BOS
    write_shard(d / "fineweb_train_000001.bin", toks)
    write_shard(d / "fineweb_val_000000.bin", structured_docs(20_000, 1))
    p = run_trainer([*SHORT, *data_args(d / "fineweb_train_*.bin", d / "fineweb_val_*.bin")], tmp_path)
    assert p.returncode in (1, 2), p.stderr[-3000:]
    assert "--tokens_per_doc_bound" in p.stderr + p.stdout and "Traceback" not in p.stderr


@pytest.mark.timeout(900)
def test_world_size_that_does_not_divide_8(tmp_path):
    train, val = make_dataset(tmp_path, train_tokens=300_000, val_tokens=20_000)
    p = run_trainer(["--num_scheduled_iterations=6", *data_args(train, val)], tmp_path,
                    env={"WORLD_SIZE": "3", "RANK": "0"})
    assert_clean_failure(p, 2, "world size 3 neither divides --batch_slices=8 nor is a multiple of it")


@pytest.mark.timeout(900)
def test_nan_loss_stops_at_the_step_and_saves_last_good_state(tmp_path):
    train, val = make_dataset(tmp_path, train_tokens=300_000, val_tokens=20_000)
    p = run_trainer([*SHORT, *data_args(train, val), "--muon_lr=1e38", "--adam_lr=1e38", "--nonfinite_check_every=1",
                     "--save_checkpoint=true", "--run_id=nan"], tmp_path)
    assert_clean_failure(p, 3, "NaN or infinite at step")
    ckpts = list((tmp_path / "logs" / "nan").glob("state_step*.pt"))
    assert ckpts, "the last good state was not saved"
    import torch
    state = torch.load(ckpts[0], weights_only=False)
    assert all(torch.isfinite(v.float()).all() for v in state["model"].values())
