"""Profiler: op hotspots, estimated NPU time, profile diff and advice (`npu-profile`).

Record with `npu-run --profile DIR script.py` or, from Python::

    import npukit.profiler
    with npukit.profiler.profile("prof", steps="1,1,3") as prof:
        for batch in loader:
            train_step(batch)
            prof.step()          # optional: optimizer.step() marks steps by itself
"""

from __future__ import annotations

# A range the emulated NPU's hccl group records (only while a profiler records) around each gloo
# work it starts: `npukit.collective:<the collective asked for>:<the one gloo runs>`. gloo runs a
# reduce_scatter as an all_reduce and records it so (gloo:all_reduce); extract.py names each such
# work by its range, so an FSDP step's profile shows its reduce_scatter.
COLLECTIVE_MARK = "npukit.collective:"


def profile(out_dir, steps=None, **options):
    """Record a profile into out_dir/rank{RANK}/; see npukit.profiler.record.ProfileSession."""
    from npukit.profiler.record import profile as _profile

    return _profile(out_dir, steps, **options)


__all__ = ["COLLECTIVE_MARK", "profile"]
