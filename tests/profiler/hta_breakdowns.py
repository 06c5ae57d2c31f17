"""HolisticTraceAnalysis's device breakdowns of a profile folder: `python hta_breakdowns.py DIR` prints
`BREAKDOWNS {json}`: per rank, the temporal breakdown, the idle-time breakdown per stream and the
communication/computation overlap (NaN where HTA returns NaN), or the error HTA raised. Run in its own
process: HTA parses the ranks in worker processes of its own."""
import json
import sys


def breakdowns(trace_dir: str) -> dict:
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=trace_dir)
    found: dict = {}
    try:
        temporal = analysis.get_temporal_breakdown(visualize=False)
        found["temporal"] = {str(row.pop("rank")): row for row in temporal.to_dict("records")}
    except Exception as error:  # what HTA made of the trace is the finding
        found["temporal"] = f"{type(error).__name__}: {error}"
    found["idle"] = {}
    for rank in analysis.t.get_ranks():
        try:
            idle, _ = analysis.get_idle_time_breakdown(ranks=[rank], visualize=False)
            found["idle"][str(rank)] = idle.to_dict("records")
        except Exception as error:
            found["idle"][str(rank)] = f"{type(error).__name__}: {error}"
    try:
        overlap = analysis.get_comm_comp_overlap(visualize=False)
        found["overlap_pctg"] = {str(row["rank"]): row["comp_comm_overlap_pctg"] for row in overlap.to_dict("records")}
    except Exception as error:
        found["overlap_pctg"] = f"{type(error).__name__}: {error}"
    return found


if __name__ == "__main__":
    print("BREAKDOWNS " + json.dumps(breakdowns(sys.argv[1])))
