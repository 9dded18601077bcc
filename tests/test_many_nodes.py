"""Past one node: 16 processes cut the batch into as many slices and match one process that accumulates them
(the same math), a rank started with other options, code, versions or shards is refused at start, the first failure
is named to the ranks it stopped, and every node's console says where rank 0 and its log are."""
import hashlib
import shutil
import socket

import pytest
import torch
import torch.distributed as dist

import harness
import train_gpt as tg
from _shards import ROOT, copy_trainer, float64_comparable, make_dataset, run_gloo, run_trainer

# A narrower tiny model (16 processes share the 2-core CI machine), float64, six steps across the stage changes, the
# untie and the extension; the tiny preset's --batch_slices=2 is below both world sizes, so the slices follow them.
NARROW = ["--preset=tiny", "--model_dim=64", "--head_dim=16", "--mlp_hidden=256", "--dtype=float64", "--fp8_mlp=true",
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
            if w.dim() == 0:                                    # a scalar (the gates' scale) has no padding
                assert torch.equal(other, w), (world, name)
                continue
            assert torch.equal(other[:w.shape[0]], w), (world, name)
            assert not other[w.shape[0]:].any(), (world, name)


@pytest.mark.slow
@pytest.mark.timeout(1800)
# 16 (two nodes of 8) only: 8 processes would repeat the same path, past --batch_slices, at half the padding, and this
# is the suite's costliest test
@pytest.mark.parametrize("world_size", [16])
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
            w1, ww, bound = float64_comparable(name, w1, many["model"][name], rank, world_size)
            rel = ((w1 - ww).norm() / w1.norm().clamp_min(1e-300)).item()
            assert rel <= bound, (name, rank, rel)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_with_other_options_code_or_shards_is_refused_at_start(tmp_path):
    train, val = make_dataset(tmp_path / "d", train_tokens=200_000, val_tokens=20_000, n_train_shards=2)
    # relative globs, so that a rank started in another folder reads that folder's copy: another node's disk
    common = [*NARROW, "--train_files=d/fineweb_train_*.bin", "--val_files=d/fineweb_val_*.bin",
              f"--log_dir={tmp_path}/logs"]
    edited = tmp_path / "node2"
    edited.mkdir()
    copy_trainer(edited)
    with open(edited / "train_gpt.py", "a") as f:
        f.write("# this node's copy was edited\n")
    (edited / "d").mkdir()
    shutil.copy(tmp_path / "d" / "fineweb_train_000001.bin", edited / "d")    # one of the two train shards
    shutil.copy(tmp_path / "d" / "fineweb_val_000000.bin", edited / "d")
    for how, words, code in (({"rank_args": {1: ["--adam_lr=0.01"]}}, "was started with other options than rank 0: "
                              "--adam_lr=0.01 (rank 0: 0.008)", 2),
                             ({"scripts": {1: edited / "train_gpt.py"}}, "runs other code than rank 0", 2),
                             ({"cwds": {1: edited}}, "lacks fineweb_train_000002.bin, which rank 0 has", 1)):
        results = run_gloo([*common, "--run_id=mixed"], 2, tmp_path, **how)
        assert [p.returncode for p in results] == [code, code], [p.stderr[-2000:] for p in results]
        errors = [line for p in results for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "rank 1 (host " in errors[0] and words in errors[0], errors
        assert "Traceback" not in results[0].stderr
        assert not (tmp_path / "logs" / "mixed.txt").exists()


def _facts(**changes):
    facts = {"host": "a", "code": "c0", "options": {"seed": "0"}, "env": {"torch": "2.13.0", "GPU": "NVIDIA H100"},
             "shards": {"train": [("t1.bin", 1024 + 200, "h1"), ("t2.bin", 1024 + 400, "h2")],
                        "val": [("v.bin", 1024 + 20, "h3")]}}
    for key, value in changes.items():
        facts[key] = value
    return facts


@pytest.mark.parametrize("changes, kind, words", [
    ({"env": {"torch": "2.11.0", "GPU": "NVIDIA H100"}}, harness.ConfigError,
     "rank 2 (host b) has another environment than rank 0: torch 2.11.0 (rank 0: 2.13.0)"),
    ({"env": {"torch": "2.13.0", "GPU": "NVIDIA H200"}}, harness.ConfigError, "GPU NVIDIA H200 (rank 0: NVIDIA H100)"),
    ({"shards": {"train": [("t1.bin", 1224, "h1")], "val": [("v.bin", 1044, "h3")]}}, harness.DataError,
     "rank 2 (host b) lacks t2.bin, which rank 0 has (1 train shards against rank 0's 2)"),
    ({"shards": {"train": [("t1.bin", 1224, "h1"), ("t2.bin", 1424, "h2"), ("t3.bin", 9, "x")],
                 "val": [("v.bin", 1044, "h3")]}}, harness.DataError, "rank 2 (host b) has t3.bin, which rank 0 lacks"),
    ({"shards": {"train": [("t1.bin", 1224, "h1"), ("t2.bin", 2048, "h2")], "val": [("v.bin", 1044, "h3")]}},
     harness.DataError, "rank 2 (host b) has another t2.bin: 2,048 bytes (rank 0: 1,424)"),
    ({"shards": {"train": [("t1.bin", 1224, "h1"), ("t2.bin", 1424, "h2")], "val": [("v.bin", 1044, "zz")]}},
     harness.DataError, "rank 2 (host b) has another v.bin: another header than rank 0's"),
    ({"shards": {"train": "error: no train shards: no file matches", "val": [("v.bin", 1044, "h3")]}},
     harness.DataError, "rank 2 (host b) cannot read its train shards, rank 0 can: no train shards"),
])
def test_the_first_rank_whose_environment_or_shards_differ_is_named_with_what_differs(changes, kind, words):
    every = [_facts(), _facts(host="x"), _facts(host="b", **changes), _facts(host="c", **changes)]
    problem = harness.first_difference(every, "train_gpt.py")
    assert isinstance(problem, kind) and words in str(problem), problem
    assert harness.first_difference(every[:2], "train_gpt.py") is None      # another host name alone is fine


def test_a_data_problem_every_rank_meets_alike_is_left_to_the_data_checks():
    same = {"train": "error: no train shards: no file matches 'd/*.bin'", "val": [("v.bin", 1044, "h3")]}
    assert harness.first_difference([_facts(shards=same), _facts(host="b", shards=same)], "x.py") is None


def test_node_facts_read_every_shards_name_size_and_header(tmp_path):
    train, val = make_dataset(tmp_path / "d", train_tokens=20_000, val_tokens=2_000, n_train_shards=2)
    hp = tg.Hyperparameters(train_files=train, val_files=val)
    facts = harness.node_facts(hp, [ROOT / "train_gpt.py"], torch.device("cpu"))
    assert [x[0] for x in facts["shards"]["train"]] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert facts["shards"]["train"][0][1] == (tmp_path / "d" / "fineweb_train_000001.bin").stat().st_size
    head = (tmp_path / "d" / "fineweb_train_000002.bin").read_bytes()[:1024]
    assert facts["shards"]["train"][1][2] == hashlib.sha256(head).hexdigest()[:16]
    assert facts["env"]["torch"] == torch.__version__ and facts["options"]["train_files"] == repr(train)
    hp = tg.Hyperparameters(train_files=str(tmp_path / "none" / "*.bin"), val_files=val)
    assert harness.node_facts(hp, [], torch.device("cpu"))["shards"]["train"].startswith("error: no train shards")


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


def test_a_node_line_names_its_ranks_and_where_rank_0_and_its_log_are():
    assert harness.node_line("b", 8, 8, 16, "a", "/runs/logs/x.txt") == (
        "node b: ranks 8-15 of 16; rank 0 runs on a (the steps and errors are on its console), its log: "
        "/runs/logs/x.txt")
    assert harness.node_line("a", 0, 8, 16, "a", "/runs/logs/x.txt").startswith(
        "node a: ranks 0-7 of 16; rank 0 runs here (")
    assert harness.node_line("c", 3, 1, 4, "a", "l").startswith("node c: rank 3 of 4; rank 0 runs on a (")
    assert harness.node_line("a", 0, 8, 8, "a", "l") is None            # one node: nothing to tell


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_node_says_where_rank_0_and_its_log_are(tmp_path):
    """Two processes as two nodes of one: rank 0's host and log path come from rank 0 (the run-id broadcast), so the
    other node names the log under rank 0's folder, not its own working folder; rank 0 says it once, also in the
    log. The run trains three steps (a start its checks refuse leaves no log)."""
    run_dir, other_dir = tmp_path / "rank0", tmp_path / "rank1"
    train, val = make_dataset(tmp_path / "d", train_tokens=120_000, val_tokens=20_000)
    args = ["--preset=tiny", f"--train_files={train}", f"--val_files={val}", "--num_scheduled_iterations=3",
            "--num_extension_iterations=0", "--val_loss_every=0", "--log_dir=logs", "--run_id=nodes"]
    run_dir.mkdir()
    other_dir.mkdir()
    results = run_gloo(args, 2, run_dir, timeout=600, per_node=1, cwds={1: other_dir})
    assert [p.returncode for p in results] == [0, 0], [p.stderr[-2000:] for p in results]
    host, log = socket.gethostname(), run_dir / "logs" / "nodes.txt"
    notes = [[line for line in p.stdout.splitlines() if line.startswith("node ")] for p in results]
    assert notes[1] == [f"node {host}: rank 1 of 2; rank 0 runs on {host} (the steps and errors are on its "
                        f"console), its log: {log}"], results[1].stdout
    assert notes[0] == [notes[1][0].replace("rank 1 of 2", "rank 0 of 2").replace(f"runs on {host}", "runs here")]
    assert log.read_text().count(notes[0][0]) == 1

