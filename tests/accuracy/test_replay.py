"""ReplaySession: the second run starts from the first run's weights and batches."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from npukit.accuracy.replay import ReplaySession
from npukit.errors import UserError


def script(seed, replay_dir, dtype=torch.float32, model_cls=None):
    """A training script whose weights and data depend on the seed."""
    torch.manual_seed(seed)
    with ReplaySession(replay_dir, batches=2) as session:
        model = (model_cls or (lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))))().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
        losses, labels = [], []
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(dtype)).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            labels.append(y.tolist())
    return losses, labels, session


def test_second_run_replays_weights_and_batches(tmp_path):
    first, first_labels, recorder = script(1, tmp_path)
    assert not recorder.replaying and (tmp_path / "replay.json").is_file()
    second, second_labels, replayer = script(2, tmp_path)
    assert replayer.replaying and replayer.replayed_modules == 1 and replayer.replayed_batches == 2
    assert second == first and second_labels == first_labels
    unreplayed, _, _ = script(2, tmp_path / "fresh")
    assert unreplayed != first  # without replay the seed changes everything


def test_replay_into_bf16_model_rounds_the_recorded_values(tmp_path):
    first, _, _ = script(1, tmp_path)
    second, _, _ = script(2, tmp_path, dtype=torch.bfloat16)
    assert second == pytest.approx(first, rel=2e-2)


def test_different_model_is_a_clear_error(tmp_path):
    script(1, tmp_path)
    with pytest.raises(UserError, match="root module 0 was a Sequential .* now it is a Linear"):
        script(1, tmp_path, model_cls=lambda: nn.Linear(4, 2))
