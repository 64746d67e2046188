from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from geofm.checkpoints import load_checkpoint_file, resolve_checkpoint_path
from geofm.errors import CheckpointFormatError, CheckpointNotFoundError


def test_torch_and_safetensors_files_load_on_cpu(tmp_path, save):
    state = {"a.weight": torch.randn(2, 3), "a.bias": torch.zeros(2)}
    for suffix in (".pth", ".pt", ".bin", ".ckpt"):
        loaded = load_checkpoint_file(save({"model": state, "epoch": 3}, f"c{suffix}"))
        assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["a.weight"], state["a.weight"])
    save_file(state, tmp_path / "w.safetensors")
    loaded = load_checkpoint_file(tmp_path / "w.safetensors")
    assert loaded.keys() == state.keys() and torch.equal(loaded["a.bias"], state["a.bias"])


def test_missing_file_names_the_path_and_how_to_get_it(tmp_path):
    path = tmp_path / "weights" / "swin_base_patch4_window7_224_22k.pth"
    with pytest.raises(CheckpointNotFoundError) as err:
        load_checkpoint_file(path)
    assert str(path) in str(err.value) and "download" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


def test_unknown_suffix_and_corrupt_files_are_format_errors(tmp_path):
    (tmp_path / "w.npz").write_bytes(b"\0")
    with pytest.raises(CheckpointFormatError, match="suffix"):
        load_checkpoint_file(tmp_path / "w.npz")
    (tmp_path / "w.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointFormatError, match=r"w.pth"):
        load_checkpoint_file(tmp_path / "w.pth")
    (tmp_path / "w.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}")
    with pytest.raises(CheckpointFormatError, match=r"w.safetensors"):
        load_checkpoint_file(tmp_path / "w.safetensors")


def test_folders_resolve_to_the_deepspeed_or_export_file(tmp_path, save):
    tagged = save({"module": {}}, "run/checkpoints/step_0000100/mp_rank_00_model_states.pt")
    (tmp_path / "run" / "checkpoints" / "last").symlink_to("step_0000100")
    for folder in ("run", "run/checkpoints", "run/checkpoints/last", "run/checkpoints/step_0000100"):
        assert resolve_checkpoint_path(tmp_path / folder).resolve() == tagged.resolve(), folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"mp_rank_00_model_states.pt"):
        resolve_checkpoint_path(tmp_path / "empty")


def test_yacs_config_loads_as_plain_dict_without_yacs(monkeypatch, save, kit):
    CfgNode = type("CfgNode", (kit.CfgNodeBase,), {})
    with monkeypatch.context() as patch:
        kit.fake_modules(patch, "yacs.config", CfgNode=CfgNode)
        config = CfgNode({"MODEL": CfgNode({"TYPE": "swin", "SWIN": CfgNode({"DEPTHS": [2, 2, 18, 2]})}), "LR": 1e-4})
        path = save({"model": {"encoder.x.weight": torch.ones(2)}, "config": config, "epoch": 99})
    assert "yacs" not in sys.modules and "yacs.config" not in sys.modules

    loaded = load_checkpoint_file(path)
    assert "yacs" not in sys.modules
    assert loaded["config"] == {"MODEL": {"TYPE": "swin", "SWIN": {"DEPTHS": [2, 2, 18, 2]}}, "LR": 1e-4}
    assert type(loaded["config"]) is dict and type(loaded["config"]["MODEL"]["SWIN"]) is dict
    assert torch.equal(loaded["model"]["encoder.x.weight"], torch.ones(2)) and loaded["epoch"] == 99


def test_deepspeed_fragment_records_load_as_plain_dicts(monkeypatch, save, kit):
    class fragment_address:  # same shape as DeepSpeed's dataclass in its bf16 optimiser state
        def __init__(self, numel, start):
            self.numel, self.start = numel, start

    with monkeypatch.context() as patch:
        kit.fake_modules(patch, "deepspeed.utils.tensor_fragment", fragment_address=fragment_address)
        path = save({"module": {"w.weight": torch.ones(1)}, "optimizer": {"map": [{"w": fragment_address(4, 8)}]}})
    loaded = load_checkpoint_file(path)
    assert loaded["optimizer"]["map"] == [{"w": {"numel": 4, "start": 8}}]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_pickle_calling_os_system_is_refused_without_running(tmp_path, zip_format):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    payload = {"model": {"a.weight": torch.ones(1)}, "config": _Exploit(marker)}
    torch.save(payload, path, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointFormatError) as err:
        load_checkpoint_file(path)
    assert str(path) in str(err.value) and "system" in str(err.value)
    assert not marker.exists()


def test_protocol_4_pickle_is_refused_naming_the_instruction(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil4.pth"
    torch.save({"config": _Exploit(marker)}, path, pickle_protocol=4)
    with pytest.raises(
        CheckpointFormatError, match=r"evil4\.pth: refused to unpickle a pickle instruction .* \(opcode 149\)"
    ):
        load_checkpoint_file(path)
    assert not marker.exists()


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    path = tmp_path / "noise.pth"
    path.write_bytes(bytes(range(7, 200)))
    with pytest.raises(
        CheckpointFormatError, match=r"noise\.pth: not a torch checkpoint \(neither a zip archive nor a pickle"
    ):
        load_checkpoint_file(path)


class _Record:
    def __init__(self):
        self.value = 1


def test_unknown_class_is_refused_by_name(save):
    path = save({"model": {}, "extra": _Record()}, "odd.pth")
    with pytest.raises(CheckpointFormatError, match=r"odd\.pth.*_Record"):
        load_checkpoint_file(path)
