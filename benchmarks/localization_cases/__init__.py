"""The generated cases of benchmarks/localization.py (a package, so `make bench` does not run it).

- `cases`   a case from (seed, index): model family, precision (fp16/bf16 autocast or fp32 with HF32),
            1-4 ranks, 1-2 steps, and one fault of a known kind and location, or none (clean)
- `models`  the six model families and the sites that hold a precision hazard
- `runner`  golden and NPU runs under npukit's DumpSession, npu-compare's body on them, the verdict
            judged against the fault's location (its docstring defines "named at the injected op"),
            and the fix finder with its trials run in-process
"""
