"""Past one node: 8 and 16 processes cut the batch into as many slices and match one process that accumulates them
(the same math), a rank started with other options or other code is refused at start, and the first failure is named
to the ranks it stopped."""
import shutil

import pytest
import torch
import torch.distributed as dist

import harness
import train_gpt as tg
from _shards import ROOT, make_dataset, run_gloo, run_trainer

# A narrower tiny model (16 processes share the 2-core CI machine), float64, six steps across the stage changes, the
# untie and the extension; the tiny preset's --batch_slices=2 is below both world sizes, so the slices follow them.
NARROW = ["--preset=tiny", "--model_dim=64", "--head_dim=16", "--mlp_hidden=256", "--dtype=float64",
          "--num_scheduled_iterations=3", "--num_extension_iterations=3", "--val_loss_every=0", "--seed=0",
          "--save_checkpoint=true"]


def test_slices_follow_a_world_size_past_the_batch_slices():
    hp = tg.parse_args(["--preset=tiny"])
    assert tg.slices_for(hp, 1) is hp and tg.slices_for(hp, 2) is hp       # at most --batch_slices: accumulate
    assert tg.slices_for(hp, 16).batch_slices == 16 and tg.slices_for(hp, 3) is hp
    record = tg.Hyperparameters()
    for world in (16, 32, 64):
        hp = tg.slices_for(record, world)
        tg.validate_hyperparameters(hp, world)        # batches, banks and shards all divide
        model = tg.build_model(hp, torch.device("meta"), "sdpa")
        for label in model.bank_matrix_shapes:
            rows, cols = model.bank_matrix_shapes[label]
            assert getattr(model, label).numel() // (rows * cols) % world == 0, (world, label)
    with pytest.raises(harness.ConfigError, match="world size 12 neither divides --batch_slices=8 nor is a multiple"):
        tg.validate_hyperparameters(tg.Hyperparameters(), 12)


def test_padding_for_more_gpus_draws_the_same_initial_weights():
    """The banks' extra padding past 8 GPUs is zero, so every real weight starts as on 8 GPUs."""
    hp = tg.parse_args(["--preset=tiny", "--dtype=float32"])
    weights = {}
    for world in (1, 16, 64):
        torch.manual_seed(0)
        weights[world] = dict(tg.build_model(tg.slices_for(hp, world), torch.device("cpu"), "sdpa").named_parameters())
    for world in (16, 64):
        for name, w in weights[1].items():
            other = weights[world][name]
            assert torch.equal(other[:w.shape[0]], w), (world, name)
            assert not other[w.shape[0]:].any(), (world, name)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world_size", [8, 16])
def test_many_processes_match_one_process_with_their_slices_in_float64(tmp_path, world_size):
    """W processes (more than the preset's --batch_slices=2) against one process with --batch_slices=W: the same
    tokens and math, so the float64 weights agree to rounding (the reduction order differs, as at 2 and 4)."""
    train, val = make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000)
    common = [*NARROW, f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp_path}/logs"]
    one = run_trainer([*common, f"--batch_slices={world_size}", "--run_id=one"], tmp_path, timeout=1500)
    assert one.returncode == 0, one.stderr[-3000:]
    for p in run_gloo([*common, "--run_id=many"], world_size, tmp_path, timeout=1500):
        assert p.returncode == 0, p.stderr[-3000:]
    log = (tmp_path / "logs" / "many.txt").read_text()
    assert f"note: {world_size} processes, more than --batch_slices=2: each takes one slice" in log
    steps = tg.parse_args(common).num_iterations
    one_state = torch.load(tmp_path / "logs" / "one" / f"state_step{steps:06d}.pt", weights_only=True)
    for rank in (0, world_size - 1):
        many = torch.load(tmp_path / "logs" / "many" / f"state_step{steps:06d}_rank{rank}.pt", weights_only=True)
        assert many["hyperparameters"]["batch_slices"] == world_size
        for name, w1 in one_state["model"].items():
            rel = ((w1 - many["model"][name]).norm() / w1.norm().clamp_min(1e-300)).item()
            assert rel <= 1e-8, (name, rank, rel)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_with_other_options_or_code_is_refused_at_start(tmp_path):
    train, val = make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000)
    common = [*NARROW, f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp_path}/logs"]
    edited = tmp_path / "node2"
    edited.mkdir()
    for name in ("train_gpt.py", "harness.py", "triton_kernels.py", "compile_split.py"):
        shutil.copy(ROOT / name, edited / name)
    with open(edited / "train_gpt.py", "a") as f:
        f.write("# this node's copy was edited\n")
    for rank_args, scripts, words in (({1: ["--adam_lr=0.01"]}, None, "rank 1 was started with other options than "
                                       "rank 0: --adam_lr=0.01 (rank 0: 0.008)"),
                                      (None, {1: edited / "train_gpt.py"}, "rank 1 runs other code than rank 0")):
        results = run_gloo([*common, "--run_id=mixed"], 2, tmp_path, rank_args=rank_args, scripts=scripts)
        assert [p.returncode for p in results] == [2, 2], [p.stderr[-2000:] for p in results]
        errors = [line for p in results for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in results[0].stderr, errors
        assert not (tmp_path / "logs" / "mixed.txt").exists()


def test_a_rank_stopped_by_another_names_the_first_failure():
    """Each rank reports how it ended in the store; the first own failure is named, with its host, by the ranks it
    stopped (tests/test_node_failures.py has the rest: silent ranks, signals, a store that is gone)."""
    import socket
    store = dist.HashStore()
    assert harness.share_failure(store, 2, 4, harness.EXIT_PEER, "gloo: connection closed")[:2] == (
        harness.EXIT_PEER, "gloo: connection closed")
    assert harness.share_failure(store, 1, 4, harness.EXIT_DATA, "training data ran out")[:2] == (
        harness.EXIT_DATA, "training data ran out")
    assert harness.share_failure(store, 3, 4, harness.EXIT_CONFIG, "later")[:2] == (harness.EXIT_CONFIG, "later")
    assert harness.share_failure(store, 0, 4, harness.EXIT_PEER, "gloo: connection closed", wait=True)[:2] == (
        harness.EXIT_PEER, f"gloo: connection closed. The first failure: rank 1 ({socket.gethostname()}): training "
        "data ran out")
