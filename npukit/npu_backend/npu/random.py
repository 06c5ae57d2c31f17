"""torch.npu RNG API: one generator per emulated device, independent of the CPU generator."""

from __future__ import annotations

import torch

from npukit.npu_backend import _C
from npukit.npu_backend.npu._device import device_index

__all__ = ["manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
           "set_rng_state", "get_rng_state_all", "set_rng_state_all"]


def _generator(device=None) -> torch.Generator:
    return _C.default_generator(device_index(device))


def manual_seed(seed: int) -> None:
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for index in range(_C.device_count()):
        _C.default_generator(index).manual_seed(int(seed))


def seed() -> None:
    _generator().seed()


def seed_all() -> None:
    value = _generator().seed()
    manual_seed_all(value)


def initial_seed() -> int:
    return _generator().initial_seed()


def get_rng_state(device="npu") -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device="npu") -> None:
    _generator(device).set_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [_C.default_generator(i).get_state() for i in range(_C.device_count())]


def set_rng_state_all(new_states) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)
