"""Profiler: op hotspots, estimated NPU time, profile diff and advice (`npu-profile`).

Record with `npu-run --profile DIR script.py` or, from Python::

    import npukit.profiler
    with npukit.profiler.profile("prof", steps="1,1,3") as prof:
        for batch in loader:
            train_step(batch)
            prof.step()          # optional: optimizer.step() marks steps by itself
"""

from __future__ import annotations


def profile(out_dir, steps=None, **options):
    """Record a profile into out_dir/rank{RANK}/; see npukit.profiler.record.ProfileSession."""
    from npukit.profiler.record import profile as _profile

    return _profile(out_dir, steps, **options)


__all__ = ["profile"]
