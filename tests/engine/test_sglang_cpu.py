"""The CPU profile (engine/sglang/cpu.py, config/kernels/cpu.toml) without SGLang running: its stand-ins, its check
against the installed SGLang's source (``pip install --no-deps sglang==0.5.23``, as the README's test command does),
the refusal when that source changed, and the command lines it plans. The kernel stand-in's arithmetic runs in
SGLang's own environment (tests/real_sglang/test_cpu_profile.py); the profile serving, in the SGLang real tier."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.sglang import cpu
from engine.sglang.plan import load_profile, plan
from tests.engine.test_sglang import SGLANG
from tests.procs import ROOT


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stand-ins last for this test only: its finder and every module it made are gone afterwards."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_the_kernel_stand_in_gives_one_function_and_names_itself_for_the_rest(isolated: None) -> None:
    done = cpu.install_stand_ins()
    assert "sgl_kernel" in done
    from sgl_kernel import assign_req_to_token_pool_cpu  # what srt/mem_cache/allocation.py imports on a CPU

    assert assign_req_to_token_pool_cpu is cpu.assign_req_to_token_pool_cpu
    flash = importlib.import_module("sgl_kernel.flash_attn")  # a GPU path's import still resolves ...
    with pytest.raises(RuntimeError, match=r"not available on pdgate.s CPU profile .*no CPU build of sgl_kernel"):
        flash.flash_attn_varlen_func(1, 2)  # ... and using it says why it cannot run


def test_the_torchvision_stand_in_imports_as_sglang_does_and_refuses_use(isolated: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_importable", lambda name: False)  # as with PyPI's CUDA-linked wheel
    assert "torchvision" in cpu.install_stand_ins()
    import torchvision.transforms as T  # as SGLang's multimodal code writes it
    import torchvision.transforms.functional as F
    from torchvision.transforms import InterpolationMode

    mode = InterpolationMode.BICUBIC  # a default argument at import time
    assert "BICUBIC" in repr(mode)

    class Resize(T.v2.Transform):  # a class deriving from one still defines
        pass

    assert Resize.__name__ == "Resize"
    assert importlib.util.find_spec("torchvision") is not None  # transformers asks, and must not fall over
    with pytest.raises(RuntimeError, match="torchvision does not import against this torch"):
        F.to_tensor(None)


def test_a_real_torchvision_is_left_alone(isolated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_importable", lambda name: True)
    assert cpu.install_stand_ins() == ["sgl_kernel"]


def test_nothing_is_left_after_the_stand_in_tests() -> None:
    assert "sgl_kernel" not in sys.modules and not any(isinstance(f, cpu._Finder) for f in sys.meta_path)


@pytest.mark.skipif(SGLANG is None, reason="sglang not installed: pip install --no-deps sglang==0.5.23")
def test_the_profile_matches_the_installed_sglang() -> None:
    assert cpu.check() == []


def test_a_changed_source_is_refused_naming_what_did_not_match(monkeypatch: pytest.MonkeyPatch) -> None:
    real = cpu.source
    monkeypatch.setattr(cpu, "source", lambda m: real(m).replace("indices_event = torch.cuda.Event()", "pass")
                        if SGLANG is not None else "")
    problems = cpu.check()
    assert any("host-indices" in p and "torch.cuda.Event" in p for p in problems), problems
    with pytest.raises(cpu.Refused, match="host-indices"):
        cpu.apply(force=False)


def test_the_cpu_cluster_plans_sglang_from_its_own_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_ENGINES_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"bash engine/sglang/install\.sh"):
        plan(ROOT / "config" / "cluster.sglang-cpu.toml")  # not installed: the one line that says what to run
    exe = tmp_path / "sglang" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.touch()
    prefill, decode = plan(ROOT / "config" / "cluster.sglang-cpu.toml")
    assert prefill["command"][:3] == [str(exe), "-m", "engine.sglang.worker"]
    profile = load_profile("cpu")
    for w in (prefill, decode):
        cmd = w["command"]
        assert cmd[cmd.index("--model-path") + 1] == str(tmp_path / "models" / "tiny-llama")
        assert cmd[cmd.index("--served-model-name") + 1] == "tiny-llama"
        assert cmd[cmd.index("--disaggregation-transfer-backend") + 1] == "mooncake_tcp"
        assert all(a in cmd for a in profile.args["all"]) and "--enable-metrics" in cmd
        assert w["env"]["SGLANG_USE_CPU_ENGINE"] == "1" and w["env"]["PDGATE_KERNEL_PROFILE"] == "cpu"
    assert "--disaggregation-decode-retraction-backup" in decode["command"]
    assert "--disaggregation-decode-retraction-backup" not in prefill["command"]
