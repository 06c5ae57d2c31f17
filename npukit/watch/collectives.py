"""The protocol between the emulated device's collectives and the readers that watch them.

No imports: the device (which records the mark) and the profiler's reader (which reads it back
from a profile, device or not) both take it from here, so neither imports the other.
"""

from __future__ import annotations

# A range the emulated NPU's hccl group records (only while a profiler records) around each gloo
# work it starts: `npukit.collective:<the collective asked for>:<the one gloo runs>`. gloo runs a
# reduce_scatter as an all_reduce and records it so (gloo:all_reduce); the profiler's extract.py
# names each such work by its range, so an FSDP step's profile shows its reduce_scatter.
COLLECTIVE_MARK = "npukit.collective:"
