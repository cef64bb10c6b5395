"""Seed 001 Sections 6.2 and 6.3 on the paper's own testbed (8 nodes of 28 cores): random
sequences of 20 jobs submitted at once under CE, CS and SNS (Fig. 14), and the scaling-ratio
sweep (Fig. 19). The model is :mod:`nodeshare.experiments.sns`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.experiments import pyplot, save
from nodeshare.producers.workloads import Workload
from nodeshare.schemas.events import ProgramClass
from nodeshare.streams.core.placement.learned import InterferenceModel

from .sns import (
    COMM_GROWTH,
    TESTBED_NODE,
    TESTBED_NODES,
    TraceJob,
    assign_programs,
    run_policies,
    testbed_machine,
)

#: Seed 001's 12 test programs by class (Sections 6.1 and 6.4: 5 scaling, 4 neutral, 3 compact).
PAPER_CLASS_MIX: Mapping[ProgramClass, int] = {ProgramClass.SCALING: 5, ProgramClass.NEUTRAL: 4,
                                               ProgramClass.COMPACT: 3}
#: How a testbed sequence draws its programs: by the paper's class mix, or uniformly from the library.
PROGRAM_MIXES = ("paper", "library")


def testbed_sequence(programs: Sequence[Workload], jobs: int, rng: np.random.Generator,
                     run_scale_s: float = 10.0, classes: Sequence[ProgramClass] | None = None,
                     mix: Mapping[ProgramClass, int] = PAPER_CLASS_MIX,
                     scaling_ratio: float | None = None) -> tuple[list[TraceJob], list[int]]:
    """One Section 6.2 job sequence: ``jobs`` jobs submitted at once with 16 or 28 processes; a
    program's CE run time is fixed (the paper sizes each program's input once), ``run_scale_s``
    times its library solo time.

    Programs are drawn uniformly from the library, or, given each program's class, as the paper
    draws from its 12 programs: a class with the weight ``mix`` gives it (5 scaling, 4 neutral,
    3 compact of 12), then a program of that class uniformly. A class the library lacks is left out.
    With ``scaling_ratio`` (and ``classes``), a job runs a scaling program with that chance
    instead (Section 6.3's sequences, ``assign_programs``)."""
    if scaling_ratio is not None:
        if classes is None:
            raise ValueError("a scaling ratio needs the programs' classes")
        prog = assign_programs(jobs, classes, scaling_ratio, rng)
    elif classes is None:
        prog = rng.integers(len(programs), size=jobs)
    else:
        members = {c: [i for i, k in enumerate(classes) if k is c] for c in mix}
        kinds = [c for c in mix if members[c]]
        if not kinds:
            raise ValueError("no program of the library is in a class of the mix")
        weight = np.array([mix[c] for c in kinds], dtype=float)
        drawn = rng.choice(len(kinds), size=jobs, p=weight / weight.sum())
        prog = np.array([rng.choice(members[kinds[k]]) for k in drawn])
    procs = rng.choice([16, 28], size=jobs)
    seq = [TraceJob(f"j{i:02d}", 0.0, programs[p].solo_s * run_scale_s, int(n))
           for i, (p, n) in enumerate(zip(prog, procs, strict=True))]
    return seq, [int(p) for p in prog]


def experiment_sns_testbed(sequences: int = 36, jobs: int = 20, seed: int = 7, alpha: float = 0.9,
                           nodes: int = TESTBED_NODES, comm_growth: float = COMM_GROWTH,
                           latency: str = "measured", loaded_latency_queue: float = TESTBED_NODE.queue,
                           mba: bool = True, programs_mix: str = "paper",
                           progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Seed 001 Section 6.2: random job sequences, all jobs submitted at once, on the paper's
    8-node testbed, under CE, CS and SNS. Per sequence: the scaling ratio (core-hours of scaling
    jobs under CE) and the throughput gain of CS and SNS over CE (throughput = 1 / mean
    submit-to-finish time); the means over sequences and how often SNS beats CS.
    ``comm_growth`` (communication's growth per doubling of nodes), ``latency`` (the
    loaded-latency curve) and ``mba`` (bandwidth partitions) are the model's assumptions that
    move SNS most (see ``testbed_machine``). ``programs_mix``: ``paper`` draws programs by the
    paper's class mix, ``library`` uniformly (see ``testbed_sequence``)."""
    if programs_mix not in PROGRAM_MIXES:
        raise ValueError(f"programs mix must be one of {PROGRAM_MIXES}, got {programs_mix!r}")
    machine = testbed_machine(comm_growth, latency, loaded_latency_queue, mba)
    programs, classes = machine.programs, machine.classes()
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    shared = ("CS", "SNS", "learned")
    # each job's run time over its exclusive run time at its scale, per policy
    promised: dict[str, list[float]] = {p: [] for p in shared}
    learned_from: list[int] = []  # measured jobs the learned policy had learned from when each job started
    model = InterferenceModel()  # one pipeline measures every sequence, one after the other
    for s in range(sequences):
        seq, assignment = testbed_sequence(programs, jobs, rng,
                                           classes=classes if programs_mix == "paper" else None)
        seq = [replace(j, job_id=f"s{s:02d}{j.job_id}") for j in seq]  # one pipeline measures every sequence
        core_s = np.array([j.procs * j.run_s for j in seq])
        scaling = np.array([classes[a] is ProgramClass.SCALING for a in assignment])
        outs = run_policies(seq, assignment, machine, nodes, alpha, model=model)
        turnaround = {p: float(o["end"].mean()) for p, o in outs.items()}  # every job was submitted at 0
        wait = {p: float(o["start"].mean()) for p, o in outs.items()}
        run = {p: float((o["end"] - o["start"]).mean()) for p, o in outs.items()}
        for p in shared:
            o = outs[p]
            promised[p] += [float(end - start) / (machine.runtime_by_scale(prog, j.procs)[int(k)] * j.run_s)
                            for j, prog, k, start, end in zip(seq, assignment, o["scale"], o["start"], o["end"],
                                                              strict=True)]
        learned_from += outs["learned"]["learned"].tolist()
        rows.append({
            "scaling_ratio": float(core_s[scaling].sum() / core_s.sum()),
            "throughput_gain_vs_ce_pct": {p: 100.0 * (turnaround["CE"] / turnaround[p] - 1.0) for p in shared},
            "sns_vs_cs_pct": 100.0 * (turnaround["CS"] / turnaround["SNS"] - 1.0),
            "vs_cs_pct": {p: 100.0 * (turnaround["CS"] / turnaround[p] - 1.0) for p in ("SNS", "learned")},
            "mean_turnaround_s": turnaround, "mean_wait_s": wait, "mean_run_s": run,
            "learned_from_at_start": int(outs["learned"]["learned"].min()),
        })
        if progress is not None:
            progress(s + 1, sequences)
    gains = {p: [r["throughput_gain_vs_ce_pct"][p] for r in rows] for p in shared}
    beyond = {p: np.array(v) > 1.0 / alpha + 1e-9 for p, v in promised.items()}
    warm = np.array(learned_from) == 0  # placed before anything was measured
    rel = {p: {m: float(np.mean([r[f"mean_{m}_s"][p] / max(r[f"mean_{m}_s"]["CE"], 1e-9) for r in rows]))
               for m in ("wait", "run", "turnaround")} for p in shared}
    return {
        "experiment": "sns-testbed", "sequences": sequences, "jobs_per_sequence": jobs, "nodes": nodes,
        "node": machine.describe(),
        "alpha": alpha, "seed": seed, "comm_growth": comm_growth, "latency": latency, "mba": mba,
        "programs_mix": programs_mix,
        **({"loaded_latency_queue": loaded_latency_queue} if latency == "mm1" else {}),
        "programs": {w.name: {"class": classes[i].value,
                              "speedup_by_scale": {str(k): 1.0 / v for k, v in
                                                   machine.runtime_by_scale(i, 16).items()}}
                     for i, w in enumerate(programs)},
        "throughput_gain_vs_ce_pct": {p: float(np.mean(v)) for p, v in gains.items()},
        "throughput_gain_vs_ce_range_pct": {p: [float(min(v)), float(max(v))] for p, v in gains.items()},
        "sns_beats_cs": sum(r["sns_vs_cs_pct"] > 0 for r in rows),
        "sns_below_ce": sum(g < 0 for g in gains["SNS"]),
        # sequences won against CS, per policy (issue 37)
        "beats_cs": {p: sum(r["vs_cs_pct"][p] > 0 for r in rows) for p in ("SNS", "learned")},
        "below_ce": {p: sum(g < 0 for g in v) for p, v in gains.items()},
        # mean over sequences of each policy's mean wait, run and turnaround over CE's
        "vs_ce": rel,
        # SNS promises each job alpha of its exclusive speed at the scale it picked (Section 4.3)
        "sns_run_vs_exclusive_at_scale": {"mean": float(np.mean(promised["SNS"])),
                                          "p90": float(np.percentile(promised["SNS"], 90)),
                                          "beyond_1_over_alpha_pct": 100.0 * float(beyond["SNS"].mean())},
        "beyond_1_over_alpha_pct": {p: 100.0 * float(v.mean()) for p, v in beyond.items()},
        "learned": {"measured_jobs": model.measured_jobs,
                    "warmup_jobs": int(warm.sum()),
                    "warmup_beyond_1_over_alpha_pct": 100.0 * float(beyond["learned"][warm].mean()) if warm.any()
                    else None,
                    "after_warmup_beyond_1_over_alpha_pct": 100.0 * float(beyond["learned"][~warm].mean())
                    if (~warm).any() else None,
                    "warmup_sequences_gain_vs_ce_pct": [r["throughput_gain_vs_ce_pct"]["learned"] for r in rows
                                                        if r["learned_from_at_start"] == 0]},
        "scaling_ratio": [r["scaling_ratio"] for r in rows],
        "per_sequence": rows,
        "paper": {"throughput_gain_vs_ce_pct": {"CS": 13.7, "SNS": 19.8}, "sns_beats_cs": 26, "sequences": 36,
                  # Fig. 13: 16 processes spread on 8 nodes (CG: at 2), exclusive, vs one node
                  "best_speedup": {"MG": "> 1.3", "LU": "> 1.3", "TS": "> 1.3", "BW": "> 1.3", "CG": 1.13}},
    }


def experiment_sns_sweep(ratios: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                         sequences: int = 10,
                         jobs: int = 20, seed: int = 7, alpha: float = 0.9,
                         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Seed 001 Section 6.3 (Fig. 19) on the testbed: sequences whose jobs run a scaling program
    with the chance ``ratio`` (0 .. 1); per ratio, the mean over sequences of SNS's and CS's mean
    run, wait and turnaround time, each relative to CE's."""
    machine = testbed_machine()
    classes = machine.classes()
    rng = np.random.default_rng(seed)
    rows = []
    total, done = len(ratios) * sequences, 0
    for ratio in ratios:
        rel: dict[str, dict[str, list[float]]] = {p: {"run": [], "wait": [], "turnaround": []} for p in ("CS", "SNS")}
        for _ in range(sequences):
            seq, assignment = testbed_sequence(machine.programs, jobs, rng, classes=classes, scaling_ratio=ratio)
            means = {p: {"run": float((o["end"] - o["start"]).mean()), "wait": float(o["start"].mean()),
                         "turnaround": float(o["end"].mean())}
                     for p, o in run_policies(seq, assignment, machine, TESTBED_NODES, alpha).items()}
            for p in ("CS", "SNS"):
                for m in ("run", "wait", "turnaround"):
                    rel[p][m].append(means[p][m] / max(means["CE"][m], 1e-9))
            done += 1
            if progress is not None:
                progress(done, total)
        rows.append({"scaling_ratio": ratio,
                     **{p: {m: float(np.mean(v)) for m, v in rel[p].items()} for p in ("CS", "SNS")}})
    return {"experiment": "sns-sweep", "sequences_per_ratio": sequences, "jobs_per_sequence": jobs, "seed": seed,
            "alpha": alpha, "ratios": rows,
            "paper": {"sns_turnaround_cut_pct_between_0.35_and_0.85": "> 10", "sns_at_ratio_0": "equal to CE"}}


def plot_sns_sweep(result: dict[str, Any], path: Path) -> Path:
    """Seed 001 Fig. 19: SNS's (and CS's) run, wait and turnaround time relative to CE by scaling ratio."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    x = [r["scaling_ratio"] for r in result["ratios"]]
    for k, m in enumerate(("run", "wait", "turnaround")):
        ax.plot(x, [r["SNS"][m] for r in result["ratios"]], marker="o", color=f"C{k}", label=f"SNS {m}")
        ax.plot(x, [r["CS"][m] for r in result["ratios"]], ls="--", color=f"C{k}", alpha=0.6, label=f"CS {m}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="scaling ratio (chance a job runs a scaling program)", ylabel="relative to CE",
           title=f"{result['sequences_per_ratio']} sequences of {result['jobs_per_sequence']} jobs per ratio "
                 "on the 8-node testbed (Seed 001 Fig. 19)")
    ax.legend(fontsize=8, ncol=2)
    return save(fig, path)


def plot_sns_testbed(result: dict[str, Any], path: Path) -> Path:
    """Seed 001 Fig. 14: each sequence's throughput gain over CE against its scaling ratio."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    x = result["scaling_ratio"]
    paper = result["paper"]["throughput_gain_vs_ce_pct"]
    for p, marker in (("CS", "o"), ("SNS", "^"), ("learned", "s")):
        if p not in result["throughput_gain_vs_ce_pct"]:
            continue
        ys = [r["throughput_gain_vs_ce_pct"][p] for r in result["per_sequence"]]
        ax.scatter(x, ys, marker=marker, label=f"{p} (mean {result['throughput_gain_vs_ce_pct'][p]:+.1f}%"
                                               + (f"; paper {paper[p]:+.1f}%)" if p in paper else ")"))
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(xlabel="scaling ratio (core-hours of scaling jobs under CE)", ylabel="throughput vs CE (%)",
           title=f"{result['sequences']} sequences of {result['jobs_per_sequence']} jobs on {result['nodes']} "
                 f"nodes of {result['node']['cores']} cores (Seed 001 Fig. 14); SNS beats CS in "
                 f"{result['sns_beats_cs']}")
    ax.legend()
    return save(fig, path)
