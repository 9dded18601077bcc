"""bench/comm_table.py: the ring arithmetic and the time model against values worked out by hand for toy networks and
tables, the collectives each step launches against what NorMuonAndAdam.step reduces, and docs/multi-node.md's table
against the bench's output with the shipped times file."""
import contextlib
import io
import json
import sys
from collections import Counter

import pytest
import torch

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import comm_table as ct  # noqa: E402
import model_step  # noqa: E402
import train_gpt as tg  # noqa: E402

# Round numbers so every expected value below is exact: 8 GPUs a node, 8 NICs of 100 Gb/s (800 Gb/s a node),
# NVLink 1000 Gb/s, 10 us a hop between nodes and 1 us on NVLink.
TOY = ct.Network(gpus_per_node=8, nics_per_node=8, nic_gbps=100.0, nvlink_gbps=1000.0, hop_latency_us=10.0,
                 nvlink_hop_latency_us=1.0)


def test_a_ring_over_two_nodes_sends_one_eighth_of_each_gpus_bytes_through_the_nics():
    # 16 GPUs: each sends 15/16 of the tensor; 2 of the ring's 16 edges leave a node, so per GPU 1/8 of that.
    assert ct.ring_bytes("reduce_scatter", 1600, 16) == 1500
    assert ct.ring_bytes("all_gather", 1600, 16) == 1500
    assert ct.ring_bytes("all_reduce", 1600, 16) == 3000
    assert ct.nic_bytes_per_gpu("reduce_scatter", 1600, 16, 8) == 1500 / 8
    assert ct.nic_bytes_per_gpu("all_reduce", 1600, 64, 8) == 2 * 1600 * 63 / 64 / 8
    # 15 hops one after another, 1 between the two nodes; an all-reduce twice that.
    assert ct.ring_hops("reduce_scatter", 16, 8) == (15, 1)
    assert ct.ring_hops("all_reduce", 16, 8) == (30, 2)
    assert ct.ring_hops("all_gather", 64, 8) == (63, 7)


def test_a_collective_is_its_hops_latency_plus_its_bytes_over_the_slower_link():
    # 16e6 bytes over 16 GPUs: 15e6 bytes = 1.2e8 bits sent per GPU; NVLink 0.12 ms, the node's NICs
    # (800 Gb/s for what each GPU sends) 0.15 ms, the slower; latency 1 hop x 10 us + 14 x 1 us.
    bw, lat = ct.collective_ms("reduce_scatter", 16e6, 16, TOY)
    assert bw == pytest.approx(0.15)
    assert lat == pytest.approx(0.024)
    bw, lat = ct.collective_ms("all_reduce", 16e6, 16, TOY)
    assert (bw, lat) == (pytest.approx(0.30), pytest.approx(0.048))


def test_one_node_uses_nvlink_only():
    # 8 GPUs: nothing through the NICs, so neither their speed nor the network hop latency matters.
    slow_nics = ct.Network(**{**TOY.__dict__, "nic_gbps": 1e-6, "hop_latency_us": 1e6})
    for net in (TOY, slow_nics):
        bw, lat = ct.collective_ms("reduce_scatter", 8e6, 8, net)
        assert bw == pytest.approx(7e6 * 8 / 1e12 * 1e3)        # 7/8 of 8e6 bytes at 1000 Gb/s
        assert lat == pytest.approx(7 * 1.0 / 1e3)                # 7 NVLink hops
        assert ct.nic_bytes_per_gpu("reduce_scatter", 8e6, 8, net.gpus_per_node) == 0


def test_micro_batch_times_interpolate_in_tokens_and_keep_the_host_time_outside_the_measured_sizes():
    times = {1000: (10.0, 4.0), 3000: (30.0, 8.0)}
    assert ct.micro_batch_ms(times, 2000) == (pytest.approx(20.0), pytest.approx(6.0))
    assert ct.micro_batch_ms(times, 3000) == (30.0, 8.0)
    assert ct.micro_batch_ms(times, 500) == (5.0, 4.0)        # GPU in proportion, host the smallest size's
    assert ct.micro_batch_ms(times, 6000) == (60.0, 8.0)


# A toy model: one sharded NorMuon bank of 16e6 bytes, a replicated Adam row of 1.6e6 bytes, a tied pair.
TABLE = {"bank": dict(optim="normuon", comms="sharded"), "scal": dict(optim="adam", comms="replicated"),
         "lm_head": dict(optim="adam", comms="sharded"), "embed": dict(optim="adam", comms="sharded")}
SIZES = {"bank": 16_000_000, "scal": 1_600_000, "lm_head": 3_200_000, "embed": 3_200_000}


def test_each_step_reduces_the_banks_always_adam_on_its_steps_and_embed_once_untied():
    assert ct.due_labels(TABLE, do_adam=False, tied_now=True) == ["bank"]
    assert ct.due_labels(TABLE, do_adam=True, tied_now=True) == ["bank", "scal", "lm_head"]
    assert ct.due_labels(TABLE, do_adam=True, tied_now=False) == ["bank", "scal", "lm_head", "embed"]
    assert ct.step_collectives(["bank", "scal"], TABLE, SIZES) == [
        ("bank", "reduce_scatter", 16_000_000), ("bank", "all_gather", 16_000_000), ("scal", "all_reduce", 1_600_000)]


def test_the_step_model_by_hand_on_a_toy_table():
    # 16 GPUs, batch_slices 16: one micro-batch of 16 tokens a step. Two steps: a NorMuon-only one, an Adam one (tied).
    counts = Counter({(256, False, True): 1, (256, True, True): 1})
    times = {16: (5.0, 2.0)}                                  # the GPU bounds the micro-batch
    cost = ct.world_cost(16, SIZES, SIZES, TABLE, counts, 16, times, TOY)
    # bank: RS + AG, 0.15 + 0.024 ms each (see above); scal: an all-reduce of 1.6e6 bytes, 0.03 + 0.048 ms;
    # lm_head: RS + AG of 3.2e6 bytes, 0.03 + 0.024 ms each.
    step0_bw, step0_lat = 2 * 0.15, 2 * 0.024
    step1_bw, step1_lat = step0_bw + 0.03 + 2 * 0.03, step0_lat + 0.048 + 2 * 0.024
    assert cost.bandwidth_ms == pytest.approx((step0_bw + step1_bw) / 2)
    assert cost.latency_ms == pytest.approx((step0_lat + step1_lat) / 2)
    assert cost.nic_bytes == pytest.approx((2 * 15e6 + 2 * 15e6 + 2 * 1.5e6 + 2 * 3e6) / 8 / 2)
    assert cost.compute_ms == 5.0 and cost.host_bound_ms == 0.0 and cost.micro_batches == 1
    assert cost.serial_ms == pytest.approx(5.0 + cost.comm_ms)
    assert cost.overlapped_ms == 5.0
    assert cost.limit == "compute"
    assert cost.stages == ((16, 5.0, 2.0),)


def test_the_host_floor_bounds_a_micro_batch_whose_launches_take_longer_than_its_gpu_time():
    counts = Counter({(512, False, True): 3})
    cost = ct.world_cost(16, SIZES, SIZES, TABLE, counts, 16, {32: (5.0, 19.0)}, TOY)
    assert cost.compute_ms == 19.0 and cost.host_bound_ms == 19.0
    assert cost.nohost_compute_ms == 5.0
    assert cost.limit == "host floor"
    # Two micro-batches per rank (batch_slices 32 on 16 GPUs) of 16 tokens, each host-bound at 19 ms.
    cost = ct.world_cost(16, SIZES, SIZES, TABLE, counts, 32, {16: (5.0, 19.0)}, TOY)
    assert (cost.micro_batches, cost.compute_ms) == (2, 38.0)


def test_due_labels_are_what_the_optimizer_reduces(monkeypatch):
    """The bench's rule against NorMuonAndAdam.step itself (tiny model, one process, the updates skipped): NorMuon
    rows every step, Adam rows on do_adam steps, embed only once untied, in the table's launch order."""
    hp = tg.parse_args(["--preset=tiny"])
    torch.manual_seed(0)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    opt = tg.build_optimizer(hp, model, 0, 1)
    launched = []
    real = opt._launch_reduce
    monkeypatch.setattr(opt, "_launch_reduce", lambda label, grad: launched.append(label) or real(label, grad))
    monkeypatch.setattr(opt, "_update", lambda *args: None)
    for tied_now, do_adam in ((True, False), (True, True), (False, False), (False, True)):
        if not tied_now and opt.tied_now:
            opt.untie()
        launched.clear()
        opt.step(do_adam=do_adam, lr_factor=1.0, momentum=0.9)
        assert launched == ct.due_labels(hp.param_table, do_adam, tied_now), (tied_now, do_adam)


def test_the_schedule_steps_adam_on_odd_steps_and_unties_after_the_split_step():
    hp = tg.Hyperparameters()
    counts = ct.schedule_counts(hp)
    assert sum(counts.values()) == hp.num_iterations == 1285
    assert hp.untie_step == 847
    # Odd steps after 847 (849 ... 1283): the Adam steps that reduce embed.
    assert sum(n for (_, do_adam, tied), n in counts.items() if do_adam and not tied) == (1283 - 849) // 2 + 1
    # steps 0-422: 211 odd (Adam) and 212 even
    assert (counts[(131_072, True, True)], counts[(131_072, False, True)]) == (211, 212)


def test_the_banks_pad_to_shard_past_8_gpus():
    hp = tg.Hyperparameters()
    at8, at16, at64 = (ct.param_bytes(hp, w) for w in (8, 16, 64))
    D, H = hp.model_dim, hp.mlp_hidden
    # vo: 24 matrices of D x D, padded to 32 and 64; mlp: 24 matrices of H x D (12 pairs), to 32 and 64; qk's 64
    # head-pair matrices shard as they are; bf16.
    assert at16["vo"] - at8["vo"] == 8 * D * D * 2 and at64["vo"] - at8["vo"] == 40 * D * D * 2
    assert at16["mlp"] - at8["mlp"] == 8 * H * D * 2 and at64["mlp"] - at8["mlp"] == 40 * H * D * 2
    assert at64["qk"] == at8["qk"]
    assert {k: v for k, v in at64.items() if k not in ("vo", "mlp")} == {k: v for k, v in at8.items()
                                                                         if k not in ("vo", "mlp")}


def test_docs_multi_node_shows_the_bench_output_with_the_shipped_times():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ct.main([]) == 0
    printed = out.getvalue().strip()
    doc = (ROOT / "docs" / "multi-node.md").read_text(encoding="utf-8")
    assert printed in doc, ("docs/multi-node.md's table is not bench/comm_table.py's output; paste it:\n" + printed)
    assert "| 8 | 1 | 0 (NVLink) |" in printed


def test_the_shipped_times_file_names_its_source_and_loads():
    times, device = ct.load_times(ct.DEFAULT_TIMES)
    data = json.loads(ct.DEFAULT_TIMES.read_text())
    assert data["source"].startswith("notes/") and (ROOT / data["source"].split(" ")[0]).is_dir()
    assert device == data["device"] and times and all(h > 0 and g > 0 for g, h in times.values())


def test_a_times_entry_without_host_ms_is_an_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"16384": {"gpu_ms": 20.0}}))
    with pytest.raises(ValueError, match="'16384' needs gpu_ms and host_ms"):
        ct.load_times(path)
    assert ct.main([f"--times={path}"]) == 2


def test_model_step_json_needs_host_and_adds_sizes_to_one_devices_file(tmp_path, capsys):
    assert model_step.main(["--json=x.json"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --json writes the GPU and the host times: add --host"]
    path = tmp_path / "t.json"
    model_step.write_times(str(path), 49152, 67.0004, 18.7, "GPU A")
    model_step.write_times(str(path), 16384, 23.7, 17.2, "GPU A")
    times, device = ct.load_times(path)
    assert times == {16384: (23.7, 17.2), 49152: (67.0, 18.7)} and device == "GPU A"
    assert [k for k in json.loads(path.read_text()) if k.isdigit()] == ["16384", "49152"]
    with pytest.raises(ValueError, match="holds times of GPU A"):
        model_step.write_times(str(path), 8192, 12.0, 17.0, "GPU B")
