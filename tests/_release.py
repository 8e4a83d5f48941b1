"""Which test modules depend on the installed transformers release (CI's rule; see docs/ci.md and tox.ini).

Every test module is *release-dependent* unless it is listed in ``RELEASE_INDEPENDENT`` below: conftest.py
marks each test of an unlisted module ``release_dependent``, and every older tox env runs only those
(``pytest -m release_dependent``); the whole suite runs once, on the newest release, in the CI venv. So a new
test module (the model sweep, say) runs under every release without anyone remembering a marker; leaving a
module out of the older envs is a decision written here, with its reason.

A module may be listed only when nothing it runs can see transformers: it exercises ``ring_kernels`` (which
knows nothing of transformers or hfpatch), the test harness, or benchmark scripts built on those.
tests/tooling/test_ci_selection.py checks that statically for every listed module and the local modules it
imports (tests/ and its folders, benchmarks/, ring_kernels/): no import of ``hfpatch`` or ``transformers``
anywhere in them.
"""
from __future__ import annotations

MARKER = "release_dependent"

# module path relative to tests/ ("ring_kernels/test_layout.py") -> why the transformers release cannot change its
# outcome
RELEASE_INDEPENDENT = {
    "ring_kernels/test_backends.py": "ring_kernels' block-attention backends against a plain reference",
    "ring_kernels/test_dist_harness.py": "ring_kernels.world, the local worlds of the tests (tests/_dist.py) on "
                                         "gloo",
    "ring_kernels/test_layout.py": "ring_kernels.layout shard / unshard",
    "ring_kernels/test_layout_costs.py": "ring_kernels.layout_costs and scripts/fit_layout_costs.py on the "
                                         "committed layout grid",
    "ring_kernels/test_merge.py": "ring_kernels' LSE merge (eager and the fused Triton kernels under the "
                                  "interpreter)",
    "ring_kernels/test_ring_batch.py": "ring_kernels' batch ring / zigzag / stripe engines on gloo worlds",
    "ring_kernels/test_ring_checkpointing.py": "ring_kernels.checkpointing (kept ring outputs through torch's "
                                               "checkpointing) on gloo worlds",
    "ring_kernels/test_ring_options.py": "ring_kernels' options object (defaults, setter, scope, environment "
                                         "override)",
    "ring_kernels/test_ring_sinks.py": "ring_kernels' attention sinks in every variant on gloo worlds",
    "ring_kernels/test_ring_ulysses.py": "ring_kernels' Ulysses and USP attention on gloo worlds",
    "ring_kernels/test_ring_varlen.py": "ring_kernels' varlen ring / zigzag / llama3 engines on gloo worlds",
    "ring_kernels/test_torch_releases.py": "ring_kernels.torch_releases: the torch range at import, the triton "
                                           "bound, the CPU kernel's GQA",
    "ring_kernels/test_transport.py": "ring_kernels' transport and ring exchange",
    "ring_kernels/test_triton_backend.py": "ring_kernels' Triton kernel under the interpreter (hfpatch never picks "
                                           "a backend by release)",
    "tooling/test_benchmarks_cpu.py": "benchmarks/ (ring_bench, native_cp, cpu_peak_memory) on ring_kernels; the "
                                      "release is only a version string in the result stamp",
    "tooling/test_host_syncs.py": "benchmarks/host_path.py's host-op counter on ring_kernels' varlen path",
    "tooling/test_import_graph.py": "scripts/import_graph.py reads the source with ast; nothing it checks is "
                                    "imported",
    "gpu/test_backends_gpu.py": "ring_kernels' block backends on one CUDA device (skipped on CPU)",
    "gpu/test_ring_gpu.py": "ring_kernels on CUDA (skipped on CPU)",
    "gpu/test_transport_gpu.py": "ring_kernels' transports on CUDA (skipped on CPU)",
    "gpu/test_triton_gpu.py": "ring_kernels' Triton kernel on CUDA (skipped on CPU)",
    "gpu/test_ulysses_gpu.py": "ring_kernels' Ulysses and USP on CUDA (skipped on CPU)",
}

# Release-independent modules whose subject is torch itself -- its private attention ops, checkpoint internals, the
# triton it pins, the torch range -- rather than ring_kernels' own logic: the matrix's envs on the torch series
# between the two ends (tox.ini's torch column) run them too (`-m torch_ops`), so that every series of the range
# runs them in CI. Every module here is in RELEASE_INDEPENDENT (tests/tooling/test_ci_selection.py checks).
TORCH_MARKER = "torch_ops"
TORCH_OPS = {
    "ring_kernels/test_backends.py": "aten's private attention ops (flash, efficient, cuDNN, the CPU flash kernel) "
                                     "behind the block backends, against a plain reference",
    "ring_kernels/test_merge.py": "the LSE merge, eager and the fused Triton kernels under the interpreter of the "
                                  "triton the torch pins",
    "ring_kernels/test_ring_checkpointing.py": "torch's checkpoint internals, through which the kept ring outputs "
                                               "pass",
    "ring_kernels/test_torch_releases.py": "the torch range at import, the CPU flash kernel's GQA gate, the triton "
                                           "bound",
}

# Modules that must run on the same pytest-xdist worker (tests/conftest.py's scheduler, `--dist loadscope`), by
# node id: they share one gloo world per session (tests/integrations/_dropin_world.py), which each worker would
# otherwise start again, or must not run at the same time (memory).
SAME_WORKER = {
    "tests/integrations/test_dropin_axolotl.py": "tests/integrations/_dropin_world.py",
    "tests/integrations/test_dropin_ring_flash_attn.py": "tests/integrations/_dropin_world.py",
    # The real-scale models (about 5 GB per rank, 2 ranks each): one after the other, never both at once on a
    # 24 GiB CI machine.
    "tests/attention/test_keep_attention.py": "real-scale models",
    "tests/model/test_model_probe_scale.py": "real-scale models",
    "tests/attention/test_head_parallel.py": "real-scale models",
}


# Release-dependent modules that run under the CI pin only (the README suite), each with why its subject is not
# the transformers release: tools of the repository (benchmarks, the CLI's own messages, the examples' launches)
# built on paths that the modules every env runs already put through each release (apply, the demo, the check CLI,
# the trainer integrations, the training stack). tests/conftest.py skips their tests elsewhere, saying so.
UNDER_THE_PIN = {
    "integrations/test_examples.py": "the examples' launches and usage errors: the trainers they drive run per "
                                     "release in integrations/test_integrations.py",
    "integrations/test_example.py": "the torchrun example: apply and the training step run per release in "
                                    "tooling/test_demo.py and model/test_e2e_models.py",
    "tooling/test_cli.py": "the CLI's arguments and messages: the demo and the check run per release in "
                           "tooling/test_demo.py and tooling/test_check_cli.py",
    "tooling/test_sft_cp_compare.py": "a benchmark script: SFTTrainer runs per release in "
                                      "integrations/test_integrations.py",
    "tooling/test_sft_throughput.py": "a benchmark script (throughput, not results)",
    "tooling/test_train_step_bench.py": "a benchmark script: the training step runs per release in "
                                        "integrations/test_training_stack.py",
    "tooling/test_train_step_plot.py": "the benchmark's plot",
    "tooling/test_hybrid_step_bench.py": "a benchmark script: the hybrid models run per release in the model sweep",
}


def ci_pin() -> str:
    """The transformers release .ci/run pins in the CI venv (the newest the registries cover): tests that run at
    real scale, or against data committed for that release, run under it only."""
    import re
    from pathlib import Path

    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text(encoding="utf-8")
    found = re.search(r"'transformers==([0-9][0-9a-z.]*)'", ci)
    if found is None:
        raise RuntimeError(".ci/run pins no 'transformers==<version>'")
    return found.group(1)


def installed_transformers() -> str | None:
    """The installed transformers release (its metadata, without importing it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def skip_unless_ci_pin(why: str) -> None:
    """Skip the calling test unless the installed transformers is the CI pin; ``why`` says what runs only there."""
    import pytest
    import transformers

    pin = ci_pin()
    if transformers.__version__ != pin:
        pytest.skip(f"{why}: only under the CI pin, transformers {pin}; this env has {transformers.__version__}")
