"""What the peer benchmarks share: the CPU's name for the tables and the timing rule."""
import platform
import statistics
import time


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (every figure names the CPU it ran on)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def median_time(fn, repeats, min_seconds, max_calls=50):
    """Median seconds of fn() over at least `repeats` calls and `min_seconds` in all
    (at most max_calls), after one untimed warm-up call: workspaces, thread pools and
    first touches of memory are not what is measured."""
    fn()
    times = []
    while len(times) < repeats or sum(times) < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= max_calls:
            break
    return statistics.median(times)
