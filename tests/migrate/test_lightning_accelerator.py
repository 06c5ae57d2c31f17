"""Lightning's Fabric and Trainer on an NPU (#32).

TinyLlama's pretraining builds `L.Fabric(devices=..., precision="bf16-mixed")`: migrated, it trained on
the CPU under npu-run without a word (Lightning has no NPU accelerator, "auto" finds no CUDA), and
`accelerator="cuda"` was told to become "npu", which Lightning refuses.
"""

from __future__ import annotations

from pathlib import Path

from npukit.migrate import MigrateOptions, run_migration


def _findings(tmp_path: Path, text: str) -> list:
    (tmp_path / "train.py").write_text(text)
    return run_migration(MigrateOptions(target=tmp_path, dry_run=True)).findings


def test_fabric_and_trainer_without_an_npu_accelerator_are_reported_once_each(tmp_path: Path) -> None:
    findings = _findings(tmp_path, (
        "import torch\n"
        "import lightning as L\n"
        "import pytorch_lightning as pl\n"
        "from lightning.pytorch import Trainer\n"
        "fabric = L.Fabric(devices=8, precision='bf16-mixed')\n"
        "f2 = L.Fabric(accelerator='cuda', devices=1)\n"
        "t = pl.Trainer(accelerator='gpu', devices=2)\n"
        "t2 = Trainer(accelerator='auto')\n"
        "ok = L.Fabric(accelerator='cpu')\n"
        "mine = L.Fabric(accelerator=NPUAccelerator(), strategy=SingleDeviceStrategy(device='npu:0'))\n"))
    by_line = {}
    for finding in findings:
        by_line.setdefault(finding.line, []).append(finding)
    assert sorted(by_line) == [5, 6, 7, 8], [(f.line, f.kind, f.reason) for f in findings]
    for line, found in by_line.items():
        assert [f.kind for f in found] == ["lightning-accelerator"], (line, found)
        finding = found[0]
        assert finding.severity == "warning"
        # the suggestion is what makes it run on the NPU: an accelerator, a strategy on npu, autocast on npu
        for needed in ("Accelerator", "SingleDeviceStrategy(device='npu:0')", "MixedPrecision", "hccl"):
            assert needed in finding.suggestion, (needed, finding.suggestion)
    assert "trains on the CPU" in by_line[5][0].reason

