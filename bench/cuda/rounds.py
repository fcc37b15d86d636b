"""Timing variants in interleaved rounds, so that drift falls on every variant alike.

With unlocked clocks a GPU's speed drifts over a benchmark run (temperature, power, boost), and
the rows of a table timed one after the other carry that drift into their ratios: in one run of
bench_attention.py on an H100 the same kernel timed early and late differed by 4-8% (dense) and up
to 25% (block-sparse at 32K) (bench/RESULTS.md, "The overlapped schedule verified with the
masks"). Here each round times every variant once, in an order rotated from round to round, and
a variant's ratio to the base is taken within each round (the two times seconds apart), then
summarised over the rounds by its median and its range.

Pure Python: `time_one(variant)` is the caller's timer (a median of CUDA-event-timed calls on the
GPU), so tests/python/test_bench_rounds.py checks the logic on the CPU.
"""
import statistics


def interleaved(variants, rounds, time_one):
    """Times every variant once per round; returns {name: [time of round 0, 1, ...]}.

    variants: a list of (name, variant) pairs, names unique; variant is what time_one takes.
    Round r starts at variant r % len(variants) and goes round the list, so each variant is timed
    at every position of a round about equally often.
    """
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variants: names must be unique, got {names}")
    if rounds < 1:
        raise ValueError(f"rounds: expected at least 1, got {rounds}")
    times = {name: [] for name in names}
    n = len(variants)
    for r in range(rounds):
        for i in range(n):
            name, variant = variants[(r + i) % n]
            times[name].append(float(time_one(variant)))
    return times


def summarise(times, base):
    """Per variant: its median time over the rounds and the base's time over its own, per round.

    Returns {name: {"ms": median, "ms_min": ..., "ms_max": ..., "speed": median over rounds of
    base_time / time (above 1: faster than the base), "speed_min": ..., "speed_max": ...}}.
    """
    if base not in times:
        raise ValueError(f"base: {base!r} is not one of the variants {list(times)}")
    out = {}
    for name, ts in times.items():
        if len(ts) != len(times[base]):
            raise ValueError(f"times[{name!r}]: {len(ts)} rounds, the base has {len(times[base])}")
        speed = [b / t for b, t in zip(times[base], ts)]
        out[name] = {"ms": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts),
                     "speed": statistics.median(speed), "speed_min": min(speed), "speed_max": max(speed)}
    return out


def table(summary, base, title):
    """The summary as text lines: one row a variant, its median time, range, and speed vs base."""
    lines = [title, f"{'variant':<34} {'ms':>9} {'min':>9} {'max':>9}  {base + ' / it':>14} {'range':>15}"]
    for name, s in summary.items():
        lines.append(f"{name:<34} {s['ms']:>9.3f} {s['ms_min']:>9.3f} {s['ms_max']:>9.3f}  "
                     f"{s['speed']:>13.3f}x {s['speed_min']:>7.3f}-{s['speed_max']:.3f}")
    return lines
