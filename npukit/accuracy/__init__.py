"""Accuracy tooling: per-layer dumps, golden-run replay, and `npu-compare`.

Modules, and what other parts of npukit (the overflow detector) can reuse:

- `naming`     msprobe entry names: api_name_table (torch function -> "Functional.relu"),
               CallCounter, api_entry_name, module_entry_name, split_entry_name.
- `tensor_io`  pickle-free .npy tensor files exact for bf16/float8: write_tensor, read_tensor.
- `dump`       DumpSession: records the ops and modules npukit.watch hands it, writes dump.json.
- `dump_leaves` a dump.json leaf as its writers (dump, overflow detector) fill it: fill_stats,
               describe_value.
- `replay`     ReplaySession: same initial weights and first batches in two runs.
- `dumpfile`   readers for npukit and msprobe dump directories.
- `metrics`    fp64 chunked, multi-process tensor comparison.
- `compare`    pairing (with sequence alignment), verdicts, first divergence.
- `report`     terminal, CSV, JSON and HTML reports.
- `precheck`   npu-compare --precheck: each op of one dump re-run on the NPU, in fp32 and fp64, judged alone.
"""
