"""What the ecosystem's trace viewers make of a profile folder: `python viewers_read.py DIR` prints
JSON {"tensorboard": {worker: profile kind}, "hta": {rank: [collective names]}}. Run in its own
process: both readers start worker processes of their own."""
import json
import sys
import tempfile


def tensorboard(run_dir: str) -> dict:
    """torch-tb-profiler's loader, as `tensorboard --logdir DIR` runs it for one run folder."""
    from torch_tb_profiler import io
    from torch_tb_profiler.profiler.loader import RunLoader

    run = RunLoader("profile", run_dir, io.Cache(tempfile.mkdtemp())).load()
    return {worker: type(profile).__name__ for (worker, _span), profile in run.profiles.items()}


def holistic_trace_analysis(trace_dir: str) -> dict:
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=trace_dir)
    symbols = analysis.t.symbol_table.get_sym_table()
    ranks = {}
    for rank in sorted(analysis.t.traces):
        names = {symbols[index] for index in analysis.t.get_trace(rank)["name"].unique()}
        ranks[rank] = sorted(name for name in names if name.startswith(("gloo:", "nccl:", "hccl:")))
    return ranks


if __name__ == "__main__":
    print("VIEWERS " + json.dumps({"tensorboard": tensorboard(sys.argv[1]), "hta": holistic_trace_analysis(sys.argv[1])}))
