"""srt.compat.sglang's import remap (no network): SGLang's module names answer with srt's
modules, model files import their siblings, unknown names fail naming themselves; and a user's
own SGLang-style model file (a Llama variant with a GELU MLP) registers and runs unedited
through the loader, the ModelRunner and the Engine, matching HF."""

from __future__ import annotations

import importlib
import json
import sys
from types import ModuleType

import pytest
import torch

import srt.layers.linear
import srt.models.utils
from srt.compat import sglang as sglang_compat
from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import get_model
from srt.models.registry import get_model_class, supported_architectures
from tests.srt.compat import user_model
from tests.srt.models.hf_compare import compare_with_hf, make_prompts, run_model

transformers = pytest.importorskip("transformers")


@pytest.fixture
def remap():
    sglang_compat.install()
    yield sglang_compat


def test_names_map_to_srt_modules(remap):
    assert remap.srt_name("sglang.srt.layers.linear") == "srt.layers.linear"
    assert remap.srt_name("sglang.srt.models.utils") == "srt.models.utils"
    assert remap.srt_name("sglang.srt.models.llama") is None  # a model file, not srt's
    assert remap.srt_name("sglang.kernels.jit.utils") == "sgl_ext.jit.utils"
    assert remap.srt_name("sglang.utils") == "srt.utils"
    assert remap.srt_name("sgl_kernel") == "sgl_ext"
    mod = importlib.import_module("sglang.srt.layers.linear")
    assert mod is srt.layers.linear
    assert srt.layers.linear.__spec__.name == "srt.layers.linear"  # keeps its own spec
    assert importlib.import_module("sglang.srt.models.utils") is srt.models.utils
    from sglang.srt.layers.layer_boundary.residual import batch  # a submodule by attribute
    from sglang.srt.utils import add_prefix

    assert batch is importlib.import_module("srt.layers.layer_boundary.residual.batch")
    assert add_prefix("mlp", "model.layers.0") == "model.layers.0.mlp"


def test_unknown_names_fail_naming_themselves(remap, tmp_path):
    with pytest.raises(ModuleNotFoundError, match="sglang.srt.layers.no_such_layer"):
        importlib.import_module("sglang.srt.layers.no_such_layer")
    with pytest.raises(ModuleNotFoundError, match="no_such_model.py beside"):
        importlib.import_module("sglang.srt.models.no_such_model")
    (tmp_path / "bad_entry.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="EntryClass"):
        remap.register_model_file(tmp_path / "bad_entry.py")
    with pytest.raises(FileNotFoundError):
        remap.register_model_file(tmp_path / "missing.py")


def test_model_files_import_their_siblings_and_leave_srt_models_alone(remap, tmp_path):
    (tmp_path / "llama.py").write_text(
        "from torch import nn\n\nclass LlamaForCausalLM(nn.Module):\n    pass\n"
    )
    (tmp_path / "my_llama.py").write_text(
        "from sglang.srt.models.llama import LlamaForCausalLM\n\n"
        "class MyLlamaForCausalLM(LlamaForCausalLM):\n    pass\n\n"
        "EntryClass = [MyLlamaForCausalLM]\n"
    )
    (cls,) = remap.register_model_file(tmp_path / "my_llama.py")
    assert cls.__module__ == "sglang.srt.models.my_llama"
    assert sys.modules["sglang.srt.models.llama"].__file__ == str(tmp_path / "llama.py")
    assert get_model_class("MyLlamaForCausalLM", "sglang") is cls
    assert "MyLlamaForCausalLM" in supported_architectures("sglang")
    # srt's own llama is untouched: as a module, as the srt.models attribute, in the registry
    import srt.models.llama as ours

    assert ours.__file__.endswith("srt/models/llama.py")
    assert get_model_class("LlamaForCausalLM").__module__ == "srt.models.llama"
    with pytest.raises(ValueError, match="no SGLang model file registered"):
        get_model_class("NoSuchModelForCausalLM", "sglang")


def test_install_refuses_next_to_the_real_sglang(monkeypatch):
    sglang_compat.uninstall()
    try:
        monkeypatch.setitem(sys.modules, "sglang", ModuleType("sglang"))
        with pytest.raises(RuntimeError, match="real 'sglang'"):
            sglang_compat.install()
    finally:
        monkeypatch.undo()
        sglang_compat.install()


@pytest.fixture(scope="module")
def gelu_llama(tmp_path_factory):
    """(the user's model file, an HF checkpoint of the same model named for it, HF model)."""
    from tests.srt.models.hf_compare import save_hf_checkpoint

    root = tmp_path_factory.mktemp("user_model")
    model_file = root / "gelu_llama.py"
    model_file.write_text(user_model.SOURCE)
    cfg = transformers.LlamaConfig(
        vocab_size=160,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="gelu_pytorch_tanh",
        max_position_embeddings=128,
        initializer_range=0.1,
        rope_theta=500.0,
    )
    ckpt = root / "ckpt"
    hf = save_hf_checkpoint(ckpt, transformers.LlamaForCausalLM, cfg)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = [user_model.ARCHITECTURE]
    (ckpt / "config.json").write_text(json.dumps(config))
    return model_file, ckpt, hf


@pytest.mark.parametrize("page_size", [1, 16])
def test_user_model_file_runs_unedited_and_matches_hf(gelu_llama, page_size):
    model_file, ckpt, hf = gelu_llama
    (cls,) = sglang_compat.register_model_file(model_file)
    assert cls.__name__ == user_model.ARCHITECTURE
    config = ModelConfig.from_hf(ckpt, dtype="float32")
    model = get_model(config, model_impl="sglang")
    assert type(model) is cls
    prompts, dec = make_prompts(config.vocab_size)
    prefill, steps, _ = run_model(model, config, prompts, dec, page_size=page_size)
    compare_with_hf(hf, prompts, dec, prefill, steps)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_user_model_file_through_the_engine_gives_hf_greedy_tokens(gelu_llama):
    from srt.entrypoints.engine import Engine

    model_file, ckpt, hf = gelu_llama
    prompts, _ = make_prompts(160, lens=(3, 9), steps=0, seed=4)
    engine = Engine(
        model_path=str(ckpt),
        device="cpu",
        model_impl="sglang",
        model_file=str(model_file),
        max_total_tokens=256,
    )
    try:
        out = engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in out] == [_hf_greedy(hf, p, 6) for p in prompts]


def test_command_lines_take_model_impl_and_model_file(gelu_llama, capsys):
    from srt import bench_one_batch, launch_server
    from srt.server_args import ServerArgs

    model_file, ckpt, _ = gelu_llama
    flags = ["--model-impl", "sglang", "--model-file", str(model_file)]
    kw = launch_server._engine_kwargs(launch_server.build_parser().parse_args(flags))
    assert (kw["model_impl"], kw["model_file"]) == ("sglang", str(model_file))
    cpu = ["--device", "cpu"]
    for argv, line in (
        (["--model-impl", "sglang"], "error: --model-impl sglang needs --model-file PATH (sglang)"),
        (["--model-file", str(model_file)], "error: --model-file needs --model-impl sglang"),
        (["--model-impl", "sglang", "--model-file", "x.txt"], "error: --model-file is not a"),
    ):
        assert bench_one_batch.cli_main(argv + cpu) == 2
        assert capsys.readouterr().err.strip().startswith(line)
    argv = ["--model-path", str(ckpt), *flags, *cpu, "--batch-size", "1", "--input-len", "4"]
    results = bench_one_batch.main(argv + ["--output-len", "2", "--result-filename", ""])
    assert results and all(r["passed"] for r in results)
    assert "gelu_llama.py: 0 of " in capsys.readouterr().out  # a plain RoPE call per layer
    with pytest.raises(ValueError, match="needs model_file"):
        ServerArgs(model_impl="sglang")
    with pytest.raises(ValueError, match="tensor parallelism"):
        ServerArgs(model_impl="sglang", model_file=str(model_file), tp_size=2)
