"""Shared fixtures: tiny HF models exported once per session and saved as .pt2."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)

# every transfer of every test run carries its check header (spawned ranks inherit the setting)
os.environ.setdefault("AFD_CHECK_WIRE", "1")

# name -> (family, layers, overrides); the MoE numerics model mixes MoE and dense layers.
MODELS = {
    "llama2": ("llama", 2, {}),
    "llama3": ("llama", 3, {}),
    "llama2_mha": ("llama", 2, {"num_key_value_heads": 4}),
    "qwen3moe2": ("qwen3_moe", 2, {}),
    "qwen3moe3_mixed": ("qwen3_moe", 3, {"mlp_only_layers": [1]}),
    "phi3": ("phi3", 2, {}),
    "gemma2": ("gemma2", 2, {}),
    "gptj": ("gptj", 2, {}),
    "gpt2": ("gpt2", 2, {}),
    "granite": ("granite", 2, {}),
    "olmo2": ("olmo2", 2, {}),
    "nemotron": ("nemotron", 2, {}),
    "gpt_bigcode": ("gpt_bigcode", 1, {}),
    "falcon": ("falcon", 2, {}),
    "deepseek_v3": ("deepseek_v3", 2, {}),
    "bloom": ("bloom", 2, {}),
    "mpt": ("mpt", 2, {}),
    "gpt_oss": ("gpt_oss", 2, {}),
    "phimoe": ("phimoe", 2, {}),
    "bitnet": ("bitnet", 2, {}),
    # hybrids: layer 0's token mixer is not attention (Mamba; gated delta-net linear attention)
    "jamba": ("jamba", 2, {}),
    "qwen3_next": ("qwen3_next", 2, {}),
    # gated delta-net then full attention, dense (Qwen3.5): TP splits the delta-net by heads too
    "qwen3_5": ("qwen3_5", 2, {}),
    # every mixer a block of its own: [attention MoE] [MLP] [Mamba MoE] [attention MLP] (models.py)
    "nemotron_h": ("nemotron_h", 7, {}),
    # [Mamba attention MoE] [attention MLP]: a Mamba beside the attention of a layer (TP keeps it whole)
    "nemotron_h_tp": ("nemotron_h", 5, {"hybrid_override_pattern": "M*E*-"}),
    # an MLP and an MoE side by side, the MoE's parts the layer's own children (Gemma-4)
    "gemma4_moe": ("gemma4_moe", 2, {}),
    # per-layer inputs mixed into the residual after the MLP (Gemma-4 dense)
    "gemma4": ("gemma4", 2, {}),
    # attention sinks as an LSE scale on the attention output (Granite-SWA)
    "granite_swa": ("granite_swa", 2, {}),
    # MLA with a sparse-attention indexer (DeepSeek-V3.2)
    "deepseek_v32": ("deepseek_v32", 2, {}),
    # eager MLA-style attention with an indexer, four residual streams (hyper-connections: HY-V4)
    "hy_v4": ("hy_v4", 2, {}),
    "llama2_v127": ("llama", 2, {"vocab_size": 127}),  # a vocabulary no TP group size divides
    # decode-shaped: one token per sequence (the sequence static), traced with 3 sequences
    "llama2_seq1": ("llama", 2, {"export_seq": 1, "export_batch": 3}),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", help="rewrite tests/golden/* from the current code")


@pytest.fixture(scope="session")
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@pytest.fixture(scope="session")
def check_golden(update_goldens: bool):
    """``check_golden(name, text)``: ``text`` equals ``tests/golden/<name>`` (rewritten first with
    ``--update-goldens``)."""

    def check(name: str, text: str) -> None:
        path = os.path.join(os.path.dirname(__file__), "golden", name)
        if update_goldens:
            with open(path, "w") as f:
                f.write(text)
        assert os.path.exists(path), f"missing golden {path}; run pytest --update-goldens"
        with open(path) as f:
            assert text == f.read(), f"{path} changed; rerun with --update-goldens and explain it in the commit"

    return check


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def exported(model_dir: str):
    """name -> (ExportedProgram, path of the saved .pt2), built lazily."""
    from afd_compile.models import build_hf, export_lm

    cache: dict[str, tuple[torch.export.ExportedProgram, str]] = {}

    def get(name: str) -> tuple[torch.export.ExportedProgram, str]:
        if name not in cache:
            family, layers, overrides = MODELS[name]
            config = {k: v for k, v in overrides.items() if not k.startswith("export_")}
            shape = {k[len("export_"):]: v for k, v in overrides.items() if k.startswith("export_")}
            ep = export_lm(build_hf(family, num_layers=layers, **config), vocab_size=overrides.get("vocab_size", 128),
                           **shape)
            path = os.path.join(model_dir, f"{name}.pt2")
            torch.export.save(ep, path)
            cache[name] = (ep, path)
        return cache[name]

    return get
