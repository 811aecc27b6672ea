"""Support code that the test suites and the benchmarks share; no tests live here.

- `stack`: start and end a real `serve-rft up` (the `Stack` handle, `start_stack`, the
  module-scoped `stack_fixture` factory, `launch` / `kill_all` for tests that drive the process).
- `stack_checks`: checks that several stack test modules run against their own stack
  (`check_...(stack)`), and the store reads they share.
- `load`: closed-loop users that chat and reward, `/v1/status` reads, bounded waits.
- `ray_cluster`: a real multi-node Ray cluster on one machine (`ray start` per node).
- `conformance`: the JSON-shape comparison of serve_rft's answers with vLLM's own server's.
- `weights`: model weights built for weight-swap tests.
- `experiences`: experiences for the store's unit tests (`experience`, `large_experience`).
- `batches`: rewarded batches that trainer-step tests step on (`uneven_batch`, `small_batch`).
- `tiny_lm`: a tiny random causal LM and fixed rollouts for the logprob-path tests.
- `trainers`: stand-ins (policy, synchronizer, store) around a real `Publishing` trainer.

Test modules and `benchmarks/*.py` import from here, never from one another. Under pytest the
modules' ``assert`` statements are rewritten as in test modules (pytest's
``register_assert_rewrite``), so a failing check reports its values.
"""

import sys

if "pytest" in sys.modules:  # under pytest; a benchmark run does not import it
    import pytest

    pytest.register_assert_rewrite(*(f"{__name__}.{m}" for m in (
        "batches", "conformance", "experiences", "load", "ray_cluster", "stack", "stack_checks",
        "tiny_lm", "trainers", "weights")))
