import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# TRAIN_GPT_FILE=/path/to/train_gpt.py: the tests import that file as `train_gpt`, and its folder comes first on
# sys.path, so that its siblings (harness.py, triton_kernels.py, ...) are the ones beside it, not this repository's.
# tests/test_new_idea.py runs the model and optimizer tests this way against an edited copy of the trainer.
TRAIN_GPT_FILE = os.environ.get("TRAIN_GPT_FILE", "")


def _import_trainer_from(path: str) -> None:
    import importlib.util
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"TRAIN_GPT_FILE={path}: no such file; name a copy of train_gpt.py")
    loaded = sys.modules.get("train_gpt")
    if loaded is not None:
        if os.path.abspath(getattr(loaded, "__file__", "")) == path:
            return
        raise RuntimeError(f"TRAIN_GPT_FILE={path}, but train_gpt was already imported from {loaded.__file__}")
    folder = os.path.dirname(path)
    while folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module           # before it runs: its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["train_gpt"]
        raise


if TRAIN_GPT_FILE:
    _import_trainer_from(TRAIN_GPT_FILE)


def pytest_report_header(config):
    if TRAIN_GPT_FILE:
        return f"train_gpt: {sys.modules['train_gpt'].__file__} (TRAIN_GPT_FILE)"
    return None


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device (see README, Tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compiler_settings_restored(monkeypatch):
    """train_gpt.configure_compiler changes process-wide torch settings; they are put back after the test."""
    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    for config, name in ((functorch_config, "autograd_cache_allow_custom_autograd_functions"),
                         (functorch_config, "force_non_lazy_backward_lowering"),
                         (torch._dynamo.config, "recompile_limit"),
                         (torch.compiler.config, "cache_key_tag"),
                         (inductor_config, "post_grad_custom_post_pass")):
        monkeypatch.setattr(config, name, getattr(config, name))
