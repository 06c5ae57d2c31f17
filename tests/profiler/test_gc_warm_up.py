"""gc-pauses leaves out the warm-up step, as dynamic-shapes does.

Found on VeOmni's NPU MoE under npu-run --profile: the first step held the script's imports
(transformers collects hundreds of times while importing), so every one of the 521 collections
was there and the advice 'garbage collection pauses the loop' named transformers' import lines."""

from __future__ import annotations

import gc

import torch

import npukit.profiler
from npukit.profiler.advisor import advise
from npukit.profiler.table import EventTable


def _make_garbage_and_collect() -> None:
    garbage = []
    for _ in range(20000):
        node = {}
        node["self"] = node
        garbage.append(node)
    del garbage
    gc.collect()


def _gc_finding(tmp_path, collect_in_step) -> bool:
    with npukit.profiler.profile(tmp_path, trace=False, auto_steps=False) as prof:
        for index in range(3):
            if collect_in_step(index):
                _make_garbage_and_collect()
            torch.randn(4).sum()
            prof.step()
    return any(f.rule == "gc-pauses" for f in advise(EventTable.load(tmp_path / "rank0")))


def test_collections_in_the_warm_up_step_only_are_not_pauses_of_the_loop(tmp_path):
    assert not _gc_finding(tmp_path, lambda index: index == 0)


def test_collections_in_every_step_still_are(tmp_path):
    assert _gc_finding(tmp_path, lambda index: True)
