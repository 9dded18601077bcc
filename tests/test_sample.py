"""tools/sample.py: text from a checkpoint, with the trainer's own model code."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt as tg
from _shards import ROOT, run_trainer, write_shard

sys.path.insert(0, str(ROOT / "tools"))
import sample  # noqa: E402

DIGITS = [ord(c) for c in "0123456789"]          # byte-mode ids of the repeated pattern


def pattern_docs(n_tokens, seed):
    """Documents of the digits 0-9 repeated from a random start (byte ids), each after a BOS."""
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_tokens:
        length, start = int(rng.integers(50, 300)), int(rng.integers(10))
        docs.append([tg.BOS_ID] + [DIGITS[(start + i) % 10] for i in range(length)])
        total += length + 1
    return np.concatenate(docs)[:n_tokens].astype(np.uint16)


def run_sampler(args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "sample.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_model_trained_on_a_repeated_pattern_continues_it(tmp_path, capsys):
    write_shard(tmp_path / "p_train_000001.bin", pattern_docs(200_000, seed=1))
    write_shard(tmp_path / "p_val_000000.bin", pattern_docs(20_000, seed=0))
    # 20 float32 steps (no bf16 rounding, which differs between CPU models) with a higher Adam lr learn the pattern
    # (val loss 0.36; with the default lr 1.9 after 24 steps).
    p = run_trainer(["--preset=tiny", "--num_scheduled_iterations=20", "--num_extension_iterations=0",
                     "--val_loss_every=0", "--seed=0", "--warmup=false", "--adam_lr=0.04", "--save_checkpoint",
                     "--dtype=float32",
                     f"--train_files={tmp_path}/p_train_*.bin", f"--val_files={tmp_path}/p_val_*.bin",
                     f"--log_dir={tmp_path}/logs", "--run_id=digits"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = f"--checkpoint={tmp_path}/logs/digits/state_step000020.pt"

    def sample_text(*args):                        # in this process: the model loads in a second, not in six
        assert sample.main([ckpt, "--encoding=bytes", *args]) == 0
        return capsys.readouterr().out

    greedy = sample_text("--prompt=34567", "--temperature=0", "--max_new_tokens=30")
    assert greedy.strip() == "34567" + "8901234567" * 3
    # top_k=1 samples the most likely token too; a fixed seed repeats its samples.
    assert sample_text("--prompt=34567", "--top_k=1", "--max_new_tokens=30") == greedy
    hot = [sample_text("--prompt=1", "--temperature=2", "--top_k=0", "--seed=7", "--num_samples=2",
                       "--max_new_tokens=40") for _ in range(2)]
    assert hot[0] == hot[1] and len(set(hot[0].split("-" * 40))) == 2


def test_padding_after_the_last_token_does_not_change_its_scores():
    torch.manual_seed(0)
    hp = tg.parse_args(["--preset=tiny", "--dtype=float64", "--use_fp8=false"])
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)                  # the zero-initialised banks and gates would hide attention
    model.eval()
    ids = torch.randint(0, 300, (21,), dtype=torch.int32)

    def last_scores(padded):
        inputs = torch.cat([ids, torch.full((padded - 21,), tg.BOS_ID, dtype=torch.int32)])
        cu = torch.tensor([0, 21, padded], dtype=torch.int32)
        return model.logits(inputs, cu, 3, 7, padded)[20]

    a, b = last_scores(32), last_scores(64)
    assert a.dtype == torch.float64 and torch.allclose(a, b, rtol=0, atol=1e-12)
    shorter = model.logits(ids[:20], torch.tensor([0, 20, 20], dtype=torch.int32), 3, 7, 20)[19]
    assert not torch.allclose(a, shorter)         # the scores depend on the tokens before: the comparison can fail


def test_sampler_reports_a_bad_checkpoint_in_one_line(tmp_path):
    (tmp_path / "state_step000001.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "state_step000002.pt").write_bytes(b"")
    torch.save({"weights": torch.ones(2)}, tmp_path / "state_step000003.pt")
    for path in [tmp_path / f"state_step00000{k}.pt" for k in (1, 2, 3)] + [tmp_path / "missing.pt"]:
        p = run_sampler([f"--checkpoint={path}", "--encoding=bytes"], tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert p.stderr.count("error:") == 1 and str(path) in p.stderr, p.stderr
    for temperature in ("-1", "nan", "inf"):
        p = run_sampler([f"--checkpoint={tmp_path}/x.pt", f"--temperature={temperature}"], tmp_path)
        assert p.returncode == 2 and p.stderr.startswith("error:") and "--temperature" in p.stderr



def tiny_state(path, randomise=False, **changes):
    """A state file as the trainer writes one, of a tiny float32 model (untrained, or with random weights so that
    its scores differ), with `changes` to its entries."""
    import dataclasses
    import harness
    hp = tg.parse_args(["--preset=tiny", "--dtype=float32", "--use_fp8=false"])
    torch.manual_seed(0)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    if randomise:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
    state = {"format": harness.CHECKPOINT_FORMAT, "hyperparameters": dataclasses.asdict(hp), "step": 0,
             "model": model.state_dict()}
    for key, change in changes.items():
        state[key] = change(state[key])
    torch.save(state, path)


def test_sampler_reports_a_checkpoint_that_does_not_build_the_model(tmp_path):
    """Readable states that no longer fit this code's model (edited, or of another version): one line, exit 2."""
    cases = {"no_weights": {"model": lambda m: {}}, "step": {"step": lambda s: "x"},
             "heads": {"hyperparameters": lambda hp: {**hp, "num_heads": hp["num_heads"] + 1}}}
    for name, changes in cases.items():
        tiny_state(tmp_path / f"{name}.pt", **changes)
        p = run_sampler([f"--checkpoint={tmp_path}/{name}.pt", "--encoding=bytes", "--max_new_tokens=2"], tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / name}.pt does not build"), p.stderr


def test_sampler_at_a_tiny_temperature_takes_the_best_token(tmp_path, capsys, monkeypatch):
    """scores / 1e-300 overflow; less the best score first, sampling is greedy in the limit, as it should be."""
    tiny_state(tmp_path / "s.pt", randomise=True)
    monkeypatch.setenv("HOME", str(tmp_path))   # --checkpoint=~/s.pt is the home folder's
    texts = []
    for temperature in ("0", "1e-300"):
        assert sample.main(["--checkpoint=~/s.pt", "--encoding=bytes", "--prompt=ab", "--max_new_tokens=4",
                            f"--temperature={temperature}", "--top_k=0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0].strip()) > 2


def test_sampler_refuses_a_seed_torch_cannot_take(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main([f"--checkpoint={tmp_path}/x.pt", f"--seed={2**64}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --seed="), err


OFFLINE = '''
import socket
def _offline(*args, **kwargs):
    raise socket.gaierror(-2, "Name or service not known (offline: simulated by the test)")
socket.getaddrinfo = _offline
socket.create_connection = _offline
socket.socket.connect = _offline
'''


# tiktoken's names for the gpt2 encoding's two files (vocab.bpe, encoder.json) in its cache: the sha1 of each one's
# address (https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/<file>, tiktoken_ext/openai_public.py)
GPT2_CACHE_NAMES = ["6d1cbeee0f20b3d9449abfede4726ed8212e3aee", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"]


def test_sampler_offline_names_the_cache_folder_its_files_and_the_fixes(tmp_path):
    """No network (a sitecustomize refuses every connection) and an empty tiktoken cache: the gpt2 encoding cannot
    load. One error line (exit 1, no traceback) names the cache folder, the two files it lacks, and the fixes: run
    once online, TIKTOKEN_CACHE_DIR, --encoding=bytes."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(OFFLINE)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TIKTOKEN_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    tiny_state(tmp_path / "s.pt")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "sample.py"), f"--checkpoint={tmp_path}/s.pt",
                        "--max_new_tokens=1"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert "Traceback" not in p.stderr and p.stdout == "", p.stderr
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, (p.returncode, p.stderr)
    line = lines[0]
    vocab, encoder = GPT2_CACHE_NAMES
    for words in (f"{cache} lacks {vocab} (vocab.bpe) and {encoder} (encoder.json)",
                  "run this once with the network", "set TIKTOKEN_CACHE_DIR to a folder holding those files",
                  "--encoding=bytes"):
        assert words in line, (words, line)
    assert line.startswith("error: cannot load tiktoken's gpt2 encoding (ConnectionError: "), line


def test_the_offline_error_names_the_files_tiktoken_reads(tmp_path, monkeypatch):
    """The cache names the error gives are the ones the installed tiktoken looks for: it reads GPT2_FILES' addresses
    and keeps each under the sha1 of its address in TIKTOKEN_CACHE_DIR."""
    import hashlib
    import tiktoken
    import tiktoken.load
    import tokenize_docs
    read = []

    def offline(blobpath):
        read.append(blobpath)
        raise ConnectionError("offline")
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        tokenize_docs.get_encoding("gpt2")
    assert read and set(read) <= set(tokenize_docs.GPT2_FILES.values()), read
    assert [hashlib.sha1(url.encode()).hexdigest() for url in tokenize_docs.GPT2_FILES.values()] == GPT2_CACHE_NAMES
    assert str(e.value).startswith("error: cannot load tiktoken's gpt2 encoding (ConnectionError: offline)")
    assert f"{tmp_path} lacks {' (vocab.bpe) and '.join(GPT2_CACHE_NAMES)} (encoder.json)" in str(e.value)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")                       # tiktoken's cache turned off
    with pytest.raises(SystemExit, match="TIKTOKEN_CACHE_DIR is empty, which turns tiktoken's cache off"):
        tokenize_docs.get_encoding("gpt2")


def sealed_tiny_state(folder):
    """A tiny model's state saved as the trainer saves one (harness.Checkpointer: sealed), and its path."""
    import dataclasses
    import harness
    hp = tg.parse_args(["--preset=tiny", "--dtype=float32", "--use_fp8=false", f"--log_dir={folder}"])
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    saver = harness.Checkpointer(hp, "run", 0, 1, {}, lambda line: None, "code")
    whole = {key: 0 for key in harness.STATE_KEYS}
    return saver.save({**whole, "step": 0, "model": model.state_dict()}), dataclasses.asdict(hp)


def test_tools_refuse_a_state_whose_seal_does_not_match_as_the_trainer_does(tmp_path, capsys):
    """One byte changed inside a weight: torch.load still reads it, the trainer's --resume refuses it by its seal,
    and so do tools/sample.py and bench/compare_states.py (one error line naming the file, exit 2)."""
    import harness
    sys.path.insert(0, str(ROOT / "bench"))
    import compare_states
    path, _ = sealed_tiny_state(tmp_path)
    assert sample.load_state(str(path))["step"] == 0                       # whole: read
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)                                    # still a readable zip
    assert "damaged" in harness.inspect_state(path, 0, 0, 1)[1]            # what --resume says
    assert sample.main([f"--checkpoint={path}", "--encoding=bytes", "--max_new_tokens=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: damaged (its sha256 does not match"), err
    assert compare_states.main([str(path), str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: damaged"), err
