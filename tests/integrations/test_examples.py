"""CI runs every example as its docstring launches it, on 2 gloo CPU processes, and checks what it prints: its steps,
its throughput, and the comparison with the same steps without CP that the example runs and prints itself ("CP
matches no CP"); exit status 0. ``examples/train_cp.py`` on 4 processes, with a loss reference computed here, is
tests/integrations/test_example.py's.

Also: ``--plot`` without matplotlib is a usage error (exit 2, one line naming ``pip install matplotlib``), before
any work; with matplotlib the CP launch writes the picture. And README.md's Trainer and SFTTrainer snippets are the
examples' lines between their "README.md: begin" and "README.md: end" markers, so what the README shows is what
these launches run.

The launches run under the CI pin of transformers only (tests/_release.py); the older releases run
tests/integrations/test_example.py and the trainer integration's own tests.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _paths import ROOT
from _release import skip_unless_ci_pin
from hfpatch.integrations import requirements
from ring_kernels.world import free_port

EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
# The README's note above a copied block, naming the example it is copied from.
_COPIED_FROM = re.compile(r"^<!-- copied from (examples/\w+\.py)\b")
_BEGIN, _END = "# README.md: begin", "# README.md: end"
_TRAINER_MODULES = ("accelerate", "trl", "datasets")
_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _needs_the_trainer_stack() -> None:
    for module in _TRAINER_MODULES:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the Trainer examples need {module} (pip install 'hfpatch[trainer]')")
    for name, minimum in (("transformers", requirements.TRANSFORMERS_MIN),
                          ("accelerate", requirements.ACCELERATE_MIN), ("trl", requirements.TRL_MIN)):
        found = requirements.installed(name)
        if found is None or found < minimum:
            pytest.skip(f"hfpatch.integrations supports {name}>={minimum}; {found} is installed")


def _under_the_ci_pin() -> None:
    skip_unless_ci_pin("the examples' launches (tests/integrations/test_example.py runs examples/train_cp.py on every "
                       "release)")


def _launch(launcher: list, example: str, *args: str) -> str:
    """Run ``python -m <launcher> examples/<example> <args>`` from the repository root; its stdout, after
    asserting exit status 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", *launcher, f"examples/{example}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert done.returncode == 0, (f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}\n"
                                  f"{done.stderr[-6000:]}")
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    return done.stdout


def _torchrun(processes: int) -> list:
    return ["torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]


def _accelerate_launch(processes: int) -> list:
    # --multi_gpu only picks accelerate's multi-process launcher (CPU processes here); a free port, not 29500,
    # which another test's launch may hold at the same time.
    return ["accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]


def _check_trainer_report(out: str, steps: int) -> None:
    """What the Trainer examples (trainer_cp, sft_cp, dpo_cp, reward_cp, kto_cp, grpo_cp) print with CP, then without, then side by
    side (an RL loss measured at its terms' scale)."""
    assert re.search(r"^<hfpatch\.integrations\.TrainerCP \w+ cp=2 ring>$", out, re.M), out
    assert len(re.findall(r"^step \d+  loss \S+  grad_norm \S+$", out, re.M)) == steps, out
    assert len(re.findall(r"^\[no CP\] step \d+  loss \S+  grad_norm \S+$", out, re.M)) == steps, out
    assert re.search(r"^throughput, cp=2: [\d,]+ tokens/s on 2 processes", out, re.M), out
    assert re.search(r"^\[no CP\] throughput, no CP: [\d,]+ tokens/s on 1 process ", out, re.M), out
    assert len(re.findall(r"^ +\d+ +-?\d+\.\d{8} +-?\d+\.\d{8}  \S+$", out, re.M)) == steps, out   # the table
    assert re.search(r"^largest relative difference( \(to the loss's terms' scale, \S+\))? \S+, bound 1e-05 "
                     r"\(float32 loss, ring_kernels.tolerances\): "
                     r"CP matches no CP$", out, re.M), out
    assert re.search(r"^throughput: cp=2 [\d,]+ tokens/s on 2 processes, no CP [\d,]+ tokens/s on 1: \S+x", out,
                     re.M), out


def test_trainer_example_with_torchrun_prints_the_comparison(tmp_path):
    _needs_the_trainer_stack()
    _under_the_ci_pin()
    plot = tmp_path / "loss.png"
    out = _launch(_torchrun(2), "trainer_cp.py", "--cp", "2", "--steps", "3", "--seq-len", "64",
                  *(["--plot", str(plot)] if _MATPLOTLIB else []))
    _check_trainer_report(out, steps=3)
    if _MATPLOTLIB:
        assert f"loss curves: {plot}" in out and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out


def test_sft_example_with_accelerate_launch_prints_the_comparison():
    _needs_the_trainer_stack()
    _under_the_ci_pin()
    out = _launch(_accelerate_launch(2), "sft_cp.py", "--cp", "2", "--steps", "3", "--pack-len", "128")
    _check_trainer_report(out, steps=3)


def test_dpo_example_with_torchrun_prints_the_comparison():
    _needs_the_trainer_stack()
    _under_the_ci_pin()
    out = _launch(_torchrun(2), "dpo_cp.py", "--cp", "2", "--steps", "3")
    _check_trainer_report(out, steps=3)


@pytest.mark.parametrize("example, trainer", [("reward_cp.py", "RewardTrainer"), ("kto_cp.py", "KTOTrainer")])
def test_reward_and_kto_examples_with_torchrun_print_the_comparison(example, trainer):
    _needs_the_trainer_stack()
    _under_the_ci_pin()
    out = _launch(_torchrun(2), example, "--cp", "2", "--steps", "3")
    _check_trainer_report(out, steps=3)
    assert f"<hfpatch.integrations.TrainerCP {trainer} cp=2 ring>" in out, out


@pytest.mark.parametrize("trainer", ["grpo"])
def test_grpo_example_with_torchrun_prints_the_comparison(trainer):
    """Completions sampled by the model itself, with CP and without: the same steps. (``--trainer rloo`` takes
    the same script through RLOOTrainer, whose cases integrations/test_integrations.py runs through ``enable``.)"""
    _needs_the_trainer_stack()
    _under_the_ci_pin()
    out = _launch(_torchrun(2), "grpo_cp.py", "--cp", "2", "--steps", "3", "--trainer", trainer)
    _check_trainer_report(out, steps=3)
    assert f"<hfpatch.integrations.TrainerCP {trainer.upper()}Trainer cp=2 ring>" in out, out


def test_train_example_on_two_processes_prints_the_comparison():
    _under_the_ci_pin()
    out = _launch(_torchrun(2), "train_cp.py", "--steps", "3", "--seq-len", "64")
    assert "mesh dp=1 x cp=2" in out and "CP: <hfpatch.Patch" in out, out
    assert len(re.findall(r"^step \d+/3  loss ", out, re.M)) == 6, out    # with CP, then without
    assert re.search(r"^summary: cp dp=1 cp=2 seq=64 ", out, re.M), out
    assert re.search(r"^summary: no-cp dp=1 cp=2 seq=64 ", out, re.M), out
    assert re.search(r"^largest relative difference \S+, bound 1e-05 \(float32 loss, ring_kernels.tolerances\): "
                     r"CP matches no CP$", out, re.M), out
    assert re.search(r"^throughput: cp=2 [\d,]+ tokens/s on 2 processes, no CP [\d,]+ tokens/s on 2: ", out,
                     re.M), out


PLOTTING_EXAMPLES = ["trainer_cp.py", "sft_cp.py", "dpo_cp.py", "reward_cp.py", "kto_cp.py", "grpo_cp.py",
                     "train_cp.py"]

# One interpreter with matplotlib hidden (``sys.modules["matplotlib"] = None``: not importable, ``find_spec`` finds
# nothing) runs each example as ``__main__`` with ``--plot``, its stdout and stderr captured apart, and prints one
# JSON line per example: [example, exit code, stdout, stderr].
_PLOT_RUNS = """
import contextlib, io, json, runpy, sys
sys.modules["matplotlib"] = None
sys.path.insert(0, "examples")
for example, argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = argv
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path("examples/" + example, run_name="__main__")
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
    print(json.dumps([example, code, out.getvalue(), err.getvalue()]))
"""


@pytest.fixture(scope="module")
def plot_runs(tmp_path_factory) -> dict:
    """example -> (exit code, stdout, stderr) of its ``--plot`` run without matplotlib (``_PLOT_RUNS``)."""
    plot = str(tmp_path_factory.mktemp("plot") / "loss.png")
    runs = [(e, [f"examples/{e}", *([] if e == "train_cp.py" else ["--cp", "1"]), "--plot", plot])
            for e in PLOTTING_EXAMPLES]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", _PLOT_RUNS, json.dumps(runs)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {example: (code, out, err) for example, code, out, err in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("example", PLOTTING_EXAMPLES)
def test_plot_without_matplotlib_exits_2_before_any_work(example, plot_runs):
    code, out, err = plot_runs[example]
    assert code == 2, out + err[-3000:]
    lines = err.strip().splitlines()
    assert lines == [f"examples/{example}: --plot needs matplotlib, which is not installed. Fix: pip install "
                     "matplotlib"], err
    assert not out


def _readme_snippets() -> list:
    """(example path, the README block under its "copied from" note) for every such note."""
    lines, found = README.read_text(encoding="utf-8").splitlines(), []
    for i, line in enumerate(lines):
        note = _COPIED_FROM.match(line)
        if not note:
            continue
        assert lines[i + 1] == "```python", f"README.md:{i + 2}: a ```python block must follow the note on line {i + 1}"
        end = lines.index("```", i + 2)
        found.append((note.group(1), "\n".join(lines[i + 2:end]) + "\n"))
    return found


def _marked_lines(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip().startswith(_BEGIN)]
    ends = [i for i, line in enumerate(lines) if line.strip() == _END]
    assert len(begins) == 1 and len(ends) == 1 and begins[0] < ends[0], \
        f"{path.relative_to(ROOT)}: expected one {_BEGIN!r} line, then one {_END!r} line"
    return textwrap.dedent("\n".join(lines[begins[0] + 1:ends[0]]) + "\n")


def test_readme_snippets_are_the_examples_marked_lines():
    snippets = _readme_snippets()
    assert sorted(example for example, _ in snippets) == ["examples/sft_cp.py", "examples/trainer_cp.py"], snippets
    for example, block in snippets:
        assert block == _marked_lines(ROOT / example), (
            f"README.md's block copied from {example} differs from that file's lines between {_BEGIN!r} and "
            f"{_END!r}; copy them again:\n{_marked_lines(ROOT / example)}")


def test_the_readme_sft_snippet_has_what_sfttrainer_needs():
    """padding_free is an SFTConfig field (SFTTrainer rejects it), and a model built from a config has no
    tokenizer: SFTTrainer needs processing_class."""
    block = dict(_readme_snippets())["examples/sft_cp.py"]
    config = block[block.index("SFTConfig("):block.index("SFTTrainer(")]
    assert "padding_free=" in config and "padding_free" not in block[block.index("SFTTrainer("):], block
    assert "processing_class=" in block[block.index("SFTTrainer("):], block


def test_a_launch_of_the_wrong_size_is_a_usage_error():
    """examples/trainer_cp.py (and sft_cp.py, which shares the check) started as one plain process with the default
    --cp 2: exit 2 naming the launch to use, before any work."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "examples/trainer_cp.py"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "examples/trainer_cp.py: error: --dp 1 x --cp 2 needs 2 processes, this launch has 1. Fix: torchrun "
        "--nproc-per-node 2 examples/trainer_cp.py --dp 1 --cp 2"), done.stderr


def test_the_comparison_names_a_difference_beyond_the_tolerance():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _report import Run, compare
    finally:
        sys.path.remove(str(EXAMPLES))
    without_cp = Run(label="no CP", losses=(4.0, 3.9), tokens=100.0, seconds=1.0, timed="2", processes=1)
    close = Run(label="cp=2", losses=(4.0, 3.9 * (1 + 5e-6)), tokens=100.0, seconds=2.0, timed="2", processes=2)
    far = Run(label="cp=2", losses=(4.0, 3.9 * (1 + 2e-5)), tokens=100.0, seconds=2.0, timed="2", processes=2)
    lines, agree = compare(close, without_cp, "float32")
    assert agree and lines[-2].endswith("CP matches no CP"), lines
    assert lines[-1] == "throughput: cp=2 50 tokens/s on 2 processes, no CP 100 tokens/s on 1: 0.50x (step 2)", lines
    lines, agree = compare(far, without_cp, "float32")
    assert not agree and lines[-2].startswith("largest relative difference 2e-05, bound 1e-05"), lines
    assert lines[-2].endswith("CP DIFFERS from no CP"), lines
    lines, agree = compare(Run(**{**far.to_dict(), "losses": (4.0,)}), without_cp, "float32")
    assert not agree and lines[-1] == "the runs logged 1 and 2 steps: nothing to compare", lines


def test_a_loss_that_cancels_is_compared_at_its_terms_scale():
    """An RL loss near zero (advantages summing to zero): measured against ``loss_scale``, not against itself, and
    a difference beyond the bound at that scale still fails."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _report import Run, compare
    finally:
        sys.path.remove(str(EXAMPLES))
    without_cp = Run(label="no CP", losses=(-3e-8, 2e-8), tokens=100.0, seconds=1.0, timed="2", processes=1,
                     loss_scale=0.3)
    noise = Run(label="cp=2", losses=(-4.6e-7, 2e-8), tokens=100.0, seconds=2.0, timed="2", processes=2)
    lines, agree = compare(noise, without_cp, "float32")
    assert agree and lines[-2].startswith(
        "largest relative difference (to the loss's terms' scale, 0.3) 1.4e-06"), lines
    assert not compare(noise, Run(**{**without_cp.to_dict(), "loss_scale": None}), "float32")[1]   # against itself
    far = Run(label="cp=2", losses=(-3e-8 + 1e-5, 2e-8), tokens=100.0, seconds=2.0, timed="2", processes=2)
    lines, agree = compare(far, without_cp, "float32")
    assert not agree and lines[-2].endswith("CP DIFFERS from no CP"), lines
