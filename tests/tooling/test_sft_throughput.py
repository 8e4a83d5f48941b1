"""benchmarks/sft_throughput.py and examples/sft_cp.py's ``--cp-impl``: the rows, ratios and table from fabricated
records; a failed launch's status from its output; the example's refusals of accelerate's CP on packed rows and on
CPU (usage errors before any work); and, under the CI pin, a real tiny CPU run of the benchmark (hfpatch cp=2 and
cp=1 train, the accelerate row is the refusal)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

for _module in ("accelerate", "trl", "datasets"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"examples/sft_cp.py needs {_module} (pip install 'hfpatch[trainer]')", allow_module_level=True)

from _paths import ROOT  # noqa: E402
from _release import skip_unless_ci_pin  # noqa: E402

for _folder in ("benchmarks", "examples"):
    sys.path.insert(0, str(ROOT / _folder))

import sft_cp  # noqa: E402
import sft_throughput as st  # noqa: E402
from _report import Run, throughput_line  # noqa: E402


def _record(tokens: float, seconds: float, processes: int, losses=(4.0, 3.5, 3.0), peak=None) -> dict:
    run = Run(label="x", losses=tuple(losses), tokens=tokens, seconds=seconds, timed=f"2-{len(losses)}",
              processes=processes, peak_allocated_gib=peak, peak_reserved_gib=None if peak is None else peak + 1)
    return {"attention": "a", "rows_per_step": 1, "packed": True, "throughput": run.to_dict()}


def test_rows_ratios_and_table_from_fabricated_records():
    rows = [st.row_of("hfpatch", 2, ["cmd", "a"], _record(2 * 2 * 65536, 4.0, 2, peak=40.0), "ok"),
            st.row_of("one GPU", 1, ["cmd", "b"], _record(2 * 32768, 1.0, 1, peak=30.0), "ok"),
            st.row_of("accelerate", 2, ["cmd", "c"], _record(2 * 2 * 65536, 5.0, 2), "ok"),
            st.row_of("hfpatch unpacked", 2, ["cmd", "d"], _record(2 * 2 * 65536, 4.5, 2), "ok")]
    assert rows[0]["tokens_per_s"] == 65536 and rows[0]["tokens_per_s_per_gpu"] == 32768
    assert rows[0]["step_s"] == 2.0 and rows[0]["tokens_per_step"] == 131072 and rows[0]["timed_steps"] == "2-3"
    assert rows[0]["loss_first"] == 4.0 and rows[0]["loss_last"] == 3.0 and rows[0]["peak_reserved_gib"] == 41.0
    q = st.ratios(rows)
    assert q == {"hfpatch_vs_one_gpu": pytest.approx(0.5), "hfpatch_vs_accelerate": pytest.approx(1.25),
                 "unpacked_hfpatch_vs_accelerate": pytest.approx(5.0 / 4.5)}
    text = st.markdown(rows, {"title": "t", "runs": "r", "stamp": None, "ratios": q})
    assert "| hfpatch | 2 | a | 131072 | 65,536 | 32,768 | 2.000 | 40.00 | 41.00 | 4.0000, 3.0000 | ok | `cmd a` |" \
        in text, text
    assert "0.500x" in text and "1.250x" in text and "1.111x" in text and "not stamped yet" in text
    # a failed run is a row with its reason, and the ratios it would feed are None
    failed = [rows[0], rows[1], st.row_of("accelerate", 2, ["cmd", "c|d"], None, "out of memory", "OOM | here")]
    q = st.ratios(failed)
    assert q["hfpatch_vs_accelerate"] is None and q["hfpatch_vs_one_gpu"] == pytest.approx(0.5)
    assert q["unpacked_hfpatch_vs_accelerate"] is None
    text = st.markdown(failed, {"title": "t", "runs": "r", "stamp": None, "ratios": q})
    assert "| accelerate | 2 | - | - | - | - | - | - | - | - | out of memory: OOM \\| here | `cmd c\\|d` |" in text
    assert "accelerate's CP (tokens/s per GPU): -x" in text


def test_a_failed_launch_is_named_from_its_output():
    usage = "W1 some warning\n[rank0]: examples/sft_cp.py: error: --cp-impl accelerate needs --device cuda: x\n" \
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    assert st.failure(usage, 1) == ("refused", "--cp-impl accelerate needs --device cuda: x")
    oom = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nChildFailedError: x\n"
    assert st.failure(oom, 1) == ("out of memory", "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                                   "allocate 2.00 GiB")
    assert st.failure("ValueError: bad\nlast line\n", 3) == ("failed (exit 3)", "ValueError: bad")
    assert st.failure("", 9) == ("failed (exit 9)", "exit status 9, no output")


def test_run_arguments_give_the_same_tokens_per_gpu():
    args = st.parse_args(["--out", "x", "--tokens-per-gpu", "32768", "--model", "small"])
    assert args.selected == list(st.RUNS) and args.tag == "sft_throughput_small_32768_bfloat16"
    hf, one, acc, unpacked = (st.run_arguments(run, args) for run in st.RUNS)
    assert hf[hf.index("--pack-len") + 1] == "65536" and "--plain" not in hf and "--cp-impl" not in hf
    assert one[one.index("--pack-len") + 1] == "32768"
    assert acc[acc.index("--pack-len") + 1] == "65536" and acc[acc.index("--doc-len") + 1] == "131072"
    assert {"--plain", "--cp-impl", "accelerate"} <= set(acc) and acc[acc.index("--batch") + 1] == "1"
    assert unpacked == [a for a in acc if a not in ("--cp-impl", "accelerate")]      # the same rows, hfpatch's ring
    with pytest.raises(SystemExit):
        st.parse_args(["--out", "x", "--runs", "hfpatch,nope"])


@pytest.mark.parametrize("argv, fix", [
    (["--cp", "2", "--cp-impl", "accelerate", "--device", "cuda"], "Fix: add --plain"),
    (["--cp", "2", "--cp-impl", "accelerate", "--plain"], "Fix: run it on GPUs"),
])
def test_accelerate_cp_is_refused_where_it_cannot_run(argv, fix, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        sft_cp.parse_args(argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("examples/sft_cp.py: error: --cp-impl accelerate ") and fix in message, message


def test_accelerate_cp_is_accepted_on_gpus_with_plain_rows_and_without_cp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sft_cp.parse_args(["--cp", "2", "--cp-impl", "accelerate", "--plain", "--device", "cuda"]).batch == 2
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sft_cp.parse_args(["--cp", "1", "--cp-impl", "accelerate"]).cp_impl == "accelerate"   # no CP at all


def test_the_throughput_line_shows_peak_memory_only_where_measured():
    run = Run(label="cp=2", losses=(1.0, 1.0), tokens=100.0, seconds=1.0, timed="2", processes=2)
    assert Run.from_dict(run.to_dict()) == run and run.to_dict()["peak_allocated_gib"] is None
    assert throughput_line(run) == "throughput, cp=2: 100 tokens/s on 2 processes, 50 per process (step 2)"
    measured = Run(**{**run.to_dict(), "losses": (1.0, 1.0), "peak_allocated_gib": 12.5, "peak_reserved_gib": 14.0})
    assert throughput_line(measured).endswith("(step 2); peak memory 12.50 GiB allocated, 14.00 GiB reserved")


def test_cpu_run_of_the_benchmark(tmp_path):
    skip_unless_ci_pin("the benchmark's launches (its logic runs on every release above)")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_throughput.py"), "--device", "cpu",
                             "--out", str(tmp_path), "--model", "tiny", "--dtype", "float32", "--tokens-per-gpu",
                             "64", "--doc-len", "16", "--steps", "2", "--timeout", "200", "--tag", "t"],
                            env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]    # the accelerate row is refused
    saved = json.loads((tmp_path / "t.json").read_text())
    rows = {r["run"]: r for r in saved["rows"]}
    assert rows["hfpatch"]["status"] == "ok" and rows["one GPU"]["status"] == "ok", rows
    assert rows["hfpatch"]["attention"].startswith("hfpatch ring") and rows["hfpatch"]["gpus"] == 2
    assert rows["one GPU"]["attention"] == "sdpa, document mask from the position ids"
    assert rows["hfpatch"]["tokens_per_s_per_gpu"] > 0 and rows["hfpatch"]["peak_allocated_gib"] is None   # CPU
    assert rows["accelerate"]["status"] == "refused" and "needs --device cuda" in rows["accelerate"]["reason"]
    assert rows["hfpatch unpacked"]["status"] == "ok" and rows["hfpatch unpacked"]["tokens_per_s_per_gpu"] > 0
    assert saved["complete"] and saved["stamp"]["device_type"] == "cpu"
    assert saved["ratios"]["hfpatch_vs_one_gpu"] > 0 and saved["ratios"]["hfpatch_vs_accelerate"] is None
    assert (tmp_path / "t.md").read_text().count("\n| ") == 5        # the header and four rows
