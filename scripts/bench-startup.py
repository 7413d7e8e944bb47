#!/usr/bin/env python3
"""Start-up benchmark: exec to first generated token, peak RSS and tg128, with the repacked-weight
pack file (the default) against repacking at every start (INFER_PACK_CACHE=0), interleaved in one
run so both see the same machine load. Warm page cache: each mode runs once before it is timed.

    scripts/bench-startup.py [--bin target/release/infer] [--reps 5] [MODEL ...]

MODEL is an alias or a path (default: qwen2.5-coder-1.5b gemma-3-270m). Prints one line per model
and mode: median (min-max) seconds to the first byte of output for a 5-token prompt with -n 1, the
median wall time of that run, peak RSS of a 32-token run (/usr/bin/time -v) and tg128 tokens/s
(`infer bench -p 0 -n 128`), then the pack/repack ratios.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import time

PROMPT = "hello there how are you"  # 5 tokens for Qwen2.5 and Gemma-3
MODES = {"repack": {"INFER_PACK_CACHE": "0"}, "pack": {}}


def env(mode):
    e = dict(os.environ)
    e.pop("INFER_PACK_CACHE", None)
    e.update(MODES[mode])
    return e


def first_token(binary, model, mode):
    """Seconds from exec to the first byte on stdout, and to exit."""
    t0 = time.perf_counter()
    p = subprocess.Popen([binary, "run", "-q", "-m", model, "-p", PROMPT, "-n", "1", "--temp", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env(mode))
    p.stdout.read(1)
    t1 = time.perf_counter()
    p.stdout.read()
    p.wait()
    assert p.returncode == 0, f"{mode}: infer run failed"
    return t1 - t0, time.perf_counter() - t0


def peak_rss_mb(binary, model, mode):
    o = subprocess.run(["/usr/bin/time", "-v", binary, "run", "-q", "-m", model, "-p", PROMPT,
                        "-n", "32", "--temp", "0"], capture_output=True, text=True, env=env(mode))
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", o.stderr)
    return int(m.group(1)) / 1024, o.stdout


def tg128(binary, model, mode):
    o = subprocess.run([binary, "bench", "-m", model, "-p", "0", "-n", "128", "-r", "3", "--json"],
                       capture_output=True, text=True, env=env(mode), check=True)
    return json.loads(o.stdout)["tests"][0]["tps_median"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/infer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("models", nargs="*", default=["qwen2.5-coder-1.5b", "gemma-3-270m"])
    a = ap.parse_args()
    for model in a.models:
        for mode in MODES:  # warm the page cache; the first pack run writes the pack file
            first_token(a.bin, model, mode)
        ft = {m: [] for m in MODES}
        wall = {m: [] for m in MODES}
        for _ in range(a.reps):
            for mode in MODES:
                f, w = first_token(a.bin, model, mode)
                ft[mode].append(f)
                wall[mode].append(w)
        rss, text = {}, {}
        for mode in MODES:
            rss[mode], text[mode] = peak_rss_mb(a.bin, model, mode)
        assert text["pack"] == text["repack"], "outputs differ between the modes"
        tg = {m: [] for m in MODES}
        for _ in range(2):
            for mode in MODES:
                tg[mode].append(tg128(a.bin, model, mode))
        size = os.path.getsize(resolve(a.bin, model)) / 2**20
        print(f"{model} (file {size:.0f} MiB, {a.reps} reps, same run)")
        for mode in MODES:
            f = ft[mode]
            print(f"  {mode:<7} first token {statistics.median(f):.3f} s ({min(f):.3f}-{max(f):.3f}), "
                  f"wall {statistics.median(wall[mode]):.3f} s, peak RSS {rss[mode]:.0f} MiB, "
                  f"tg128 {statistics.median(tg[mode]):.1f} t/s ({', '.join(f'{t:.1f}' for t in tg[mode])})")
        r = statistics.median(ft["pack"]) / statistics.median(ft["repack"])
        t = statistics.median(tg["pack"]) / statistics.median(tg["repack"])
        print(f"  pack/repack: first token x{r:.2f}, tg128 x{t:.3f}, outputs identical")


def resolve(binary, model):
    if os.path.exists(model):
        return model
    out = subprocess.run([binary, "models"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.split()[0] == model:
            return line.split()[-1]
    raise SystemExit(f"{model}: not found by `infer models`")


if __name__ == "__main__":
    main()
