"""Hyperparameters: --name=value parsing, presets, and validation errors that name the fix."""
import math
import subprocess
import sys

import pytest
import torch

import checks
import train_gpt as tg
import harness  # noqa: E402


def test_parse_types_and_preset_order():
    hp = tg.parse_args(["--num_layers=11", "--preset=tiny", "--muon_lr=0.05", "--compile=false",
                        "--stages=4096:1:3:1/0.5/0.25:1/0.5/0:896,8192:1.5:7:1:1:2048"])
    assert hp.preset == "tiny" and hp.model_dim == 128          # preset applied first, whatever its position
    assert hp.num_layers == 11 and hp.muon_lr == 0.05 and hp.compile is False
    assert hp.stages == (tg.Stage(4096, 1.0, 3, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 896),
                         tg.Stage(8192, 1.5, 7, (1.0,), (1.0,), 2048))
    assert tg.parse_args([f"--stages={harness.show(hp.stages)}"]).stages == hp.stages   # what --help shows parses back


@pytest.mark.parametrize("argv,needle", [
    (["--nosuch=1"], "unknown option --nosuch"),
    (["--num_layers=abc"], "--num_layers='abc' is not an int"),
    (["--preset=huge"], "unknown --preset=huge"),
    (["num_layers=3"], "expected --name=value"),
    (["--lr=0.1"], "did you mean --adam_lr, --muon_lr, --lr_min?"),
    (["--stages=4096:1:3"],
     "--stages='4096:1:3' is not batch:lr_peak:ws_long:mtp_start:mtp_end:max_doc_len[:prefix_start][:prefix_end] "
     "per stage"),
    (["--train_bs_schedule=1,2,3"], "unknown option --train_bs_schedule"),    # no shims for old options
    (["--muon_lrr=0.1"], "did you mean --muon_lr"),
    (["--num_layers", "3"], "--num_layers needs a value: write --num_layers=VALUE"),
    (["--compile=maybe"], "--compile='maybe' is not true or false"),
])
def test_parse_errors(argv, needle):
    with pytest.raises(tg.ConfigError) as e:
        tg.parse_args(argv)
    assert needle in str(e.value)


@pytest.mark.parametrize("world_size,argv,needle", [
    (3, [], "world size 3 neither divides --batch_slices=8 nor is a multiple of it"),
    (1, ["--stages=131072:1:3:1:1:896,1000:1:3:1:1:2048"], "global batch 1000"),
    (1, ["--stages=1024:1:3:0/1:0/1:896"], "stage 1 of --stages (1024:1.0:3:0.0/1.0:0.0/1.0:896:0.0:0.0) needs"),
    (1, ["--stages=1024:1:3:1/1:1:896"], "needs as many start as end MTP weights"),
    (1, ["--stages=1024:1:3:1:1:0"], "stage 1 of --stages (1024:1.0:3:1.0:1.0:0:0.0:0.0) needs a positive batch, "
                                     "window and max_doc_len"),
    (1, ["--stages=1024:1:3:1:1:896:-0.25"], "stage 1 of --stages (1024:1.0:3:1.0:1.0:896:-0.25:0.0) needs prefix "
                                             "weights (p_start:p_end) >= 0"),
    (1, ["--val_tokens=1000"], "--val_tokens=1000"),
    (1, ["--attn_layout=PN"], "--attn_layout"),
    (1, ["--attn_backend=magic"], "--attn_backend=magic"),
    (1, ["--long_window_layers=3,11"], "--long_window_layers=(3, 11) must be layer indices below 11"),
    (8, ["--attn_layout=PNPNNPNNNPN"], None),                      # an 11th attention layer: the bank pads itself
    (1, ["--model_dim=512"], "must equal model_dim = 512"),
    (1, ["--nonfinite_check_every=-1"], "--nonfinite_check_every=-1 must be >= 0"),
    (1, ["--model_dim=1024", "--num_heads=8"], None),              # shapes follow the model: nothing to restate
    (1, ["--long_window_layers=3,9"], None),                        # a paired layer may take the long window
])
def test_validation_names_the_fix(world_size, argv, needle):
    hp = tg.parse_args(argv)
    if needle is None:
        tg.validate_hyperparameters(hp, world_size)
        return
    with pytest.raises(tg.ConfigError) as e:
        tg.validate_hyperparameters(hp, world_size)
    assert needle in str(e.value)


def test_fused_kernel_shapes_are_checked_before_compiling_on_a_gpu_only():
    """The fused MLP kernel (CUDA only) reads the model dim in K-steps of 64, of 128 in its FP8 forward: 6 heads of
    132 pass the model's own checks but not the kernel's, which preflight names, and 4 heads of 176 pass the bf16
    kernel only; on a CPU, or with --kernels=torch, the MLP is the reference and any dim goes."""
    fused = "--kernels=mlp:fused"
    hp = tg.parse_args(["--num_heads=6", "--head_dim=132", "--model_dim=792", "--fp8_mlp=false", fused])
    tg.validate_hyperparameters(hp, 1)
    with pytest.raises(tg.ConfigError, match="multiple of 64 \\(not 792\\), or --kernels=mlp:torch"):
        _check_kernel_shapes(hp, torch.device("cuda"))
    _check_kernel_shapes(hp, torch.device("cpu"))
    _check_kernel_shapes(tg.parse_args(["--num_heads=6", "--head_dim=132", "--model_dim=792", "--kernels=torch"]),
                         torch.device("cuda"))
    narrow = ["--num_heads=4", "--head_dim=176", "--model_dim=704", fused]
    _check_kernel_shapes(tg.parse_args([*narrow, "--fp8_mlp=false"]), torch.device("cuda"))
    with pytest.raises(tg.ConfigError, match="multiple of 128 \\(not 704\\)"):
        _check_kernel_shapes(tg.parse_args(narrow), torch.device("cuda"))
    _check_kernel_shapes(tg.parse_args([fused]), torch.device("cuda"))


def _check_kernel_shapes(hp, device):
    checks.check_fused_kernel_shapes(hp, device, tg.mlp_kernel_step(hp, device))


def test_preflight_names_a_model_dim_the_gpu_kernels_cannot_take(tmp_path):
    """preflight runs the check before anything compiles (it raises before its CUDA memory query, so a CPU
    machine can test it); on the CPU the same options pass."""
    from _shards import make_dataset
    make_dataset(tmp_path)
    hp = tg.parse_args(["--preset=tiny", f"--train_files={tmp_path}/*train*.bin", f"--val_files={tmp_path}/*val*.bin",
                        "--num_heads=4", "--head_dim=36", "--model_dim=144", "--kernels=mlp:fused"])
    tg.validate_hyperparameters(hp, 1)
    with pytest.raises(tg.ConfigError, match="not 144"):
        tg.preflight(hp, 1, torch.device("cuda"))
    assert tg.preflight(hp, 1, torch.device("cpu"))[-1].startswith("data:")


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_defaults_valid_on_every_supported_world_size(world_size):
    tg.validate_hyperparameters(tg.Hyperparameters(), world_size)


def test_import_starts_nothing():
    code = ("import sys, threading, torch; before = threading.active_count(); import train_gpt, triton_kernels; "
            "import torch.distributed as d; assert not d.is_initialized(); "
            "assert threading.active_count() == before, 'threads started at import'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, cwd=tg.Path(tg.__file__).parent)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("argv", [["--preset=tiny"],
                                  ["--model_dim=512", "--num_heads=4", "--mlp_hidden=1024", "--bigram_vocab_size=1024"]])
def test_configs_build_and_take_a_step_on_cpu(argv):
    """What a newcomer tries first: the tiny preset, and a wider model from the command line alone (the optimizer's
    matrix shapes and the banks follow the model). float32, so the step is exact arithmetic on any CPU."""
    hp = tg.parse_args([*argv, "--dtype=float32", "--use_fp8=false", "--attn_backend=sdpa"])
    tg.validate_hyperparameters(hp, 1)
    torch.manual_seed(0)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    opt = tg.build_optimizer(hp, model, 0, 1)
    g = torch.Generator().manual_seed(1)
    T = 256
    inputs = torch.randint(0, 1000, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, 1000, (T,), generator=g, dtype=torch.int64)
    cu_seqlens = torch.tensor([0, 100, T, T], dtype=torch.int32)          # two documents, then padding
    sched = tg.schedule_at(1, hp)                                          # an Adam step
    loss = model(inputs, targets, cu_seqlens, sched.ws_short, sched.ws_long, torch.tensor(sched.mtp_weights), T)
    loss.backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt.step(do_adam=sched.do_adam, lr_factor=sched.lr_factor, momentum=sched.momentum)
    assert torch.isfinite(loss)
    assert 0.9 < loss.item() / (T * 1.75 * math.log(hp.vocab_size)) < 1.1    # near-uniform logits at init
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    unchanged = {name for name, p in model.named_parameters() if torch.equal(p, before[name])}
    # At init smear_lambda = 0 silences the smear gate, and the second layers of MUDD and of the gates are zero, so
    # their first layers have no gradient; everything else moved (W_o is random since record 64; the gates' biases
    # and scale through the columns whose consumers have a gradient at init).
    assert unchanged == {"smear_gate", "mudd_w1", "mudd_gate_w1"}
