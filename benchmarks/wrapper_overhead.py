"""Overhead of the generated wrapper over calling the handler directly (CPU, no tensors involved).

The wrapper sits on the hot path (once per attention layer per step), so it must stay cheap: target <= 2 us
per call. Run: ``python benchmarks/wrapper_overhead.py`` (prints the numbers; not a test, timings vary).
"""
from __future__ import annotations

import inspect
import platform
import time
import timeit

from hfpatch import codegen
from hfpatch.signatures.registry import load_registry, match


def handler(call, extra):
    return call


def _best(fn, number: int, repeat: int) -> float:
    # process_time: CPU seconds of this process, so other load on a shared machine inflates it less.
    return min(timeit.repeat(fn, number=number, repeat=repeat, timer=time.process_time)) / number


def main(number: int = 100_000, repeat: int = 5) -> None:
    print(f"python {platform.python_version()} on {platform.machine()}; best of {repeat} x {number} calls, CPU time")
    print(f"{'entry':<12} {'direct us':>10} {'wrapper us':>11} {'overhead us':>12}  call style")
    for entry in load_registry():
        sig = entry.signature()
        wrapper = codegen.render(match(sig), handler)
        q = k = v = object()
        # The direct baseline gets the same call dict the wrapper builds, prebuilt: what remains is the cost of
        # binding the arguments and building the dict, i.e. the wrapper's whole overhead.
        direct_call = {role: None for role in entry.roles.values() if role != "extra_kwargs"}
        extra = {}
        styles = {
            # How HF's integrations/flash_attention.py calls it: 4 positional + keywords.
            "hf-style": lambda: wrapper(q, k, v, None, query_length=128, is_causal=True, dropout=0.0,
                                        softmax_scale=0.125, sliding_window=None, softcap=None),
            "positional": lambda: wrapper(q, k, v, None, 128, True),
        }
        direct = _best(lambda: handler(direct_call, extra), number, repeat)
        for style, fn in styles.items():
            best = _best(fn, number, repeat)
            print(f"{entry.id:<12} {direct * 1e6:>10.3f} {best * 1e6:>11.3f} {(best - direct) * 1e6:>12.3f}  {style}")
    assert inspect.signature(wrapper, follow_wrapped=False) == sig


if __name__ == "__main__":
    main()
