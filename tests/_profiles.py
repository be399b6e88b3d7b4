"""The suite's hypothesis profiles (loaded by tests/conftest.py, which also seeds each run).

- ``default`` (``make test``): :data:`DEFAULT_EXAMPLES` examples a property, new ones every run.
  The run's seed is printed in pytest's header and in its summary (with the command that
  reproduces a failure): ``HYPOTHESIS_SEED=<seed> make test``, or one test alone with
  ``python -m pytest --hypothesis-seed=<seed> tests/<file>.py::<test>`` (each test draws from a
  generator of its own seeded with the run's seed, so alone it draws what it drew in the run).
  A failure found that way becomes an ``@example(...)`` on the test, checked by every run after.
- ``interpret`` (``make test``'s Triton-interpreter pass): :data:`INTERPRET_EXAMPLES` a property
  (and proportionally fewer for those counted with :func:`examples`): a kernel in the
  interpreter costs about a hundred times its torch reference, which ``test-cpu`` draws 25 for.
- ``thorough`` (``make test-all``, or ``HYPOTHESIS_PROFILE=thorough``): :data:`THOROUGH_FACTOR`
  times as many examples, for the properties of the profile and those that set their own count
  with :func:`examples`.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

DEFAULT_EXAMPLES = 25
INTERPRET_EXAMPLES = 6
THOROUGH_FACTOR = 8

settings.register_profile(
    "default", max_examples=DEFAULT_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "interpret", max_examples=INTERPRET_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough",
    max_examples=DEFAULT_EXAMPLES * THOROUGH_FACTOR,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def examples(n: int) -> int:
    """``n`` examples under the default profile, as many more as the loaded profile has
    (``@settings(max_examples=examples(15))`` for a property costlier than most)."""
    return max(1, round(n * settings.default.max_examples / DEFAULT_EXAMPLES))


def fast_tier_takes(cases: list, *fast) -> list:
    """``cases`` for ``pytest.mark.parametrize``, each not in ``fast`` marked slow: ``make test``
    runs those in ``fast``, ``make test-all`` every case (for parameter sets whose cases each
    cost seconds in Triton's interpreter)."""
    missing = [c for c in fast if c not in cases]
    assert not missing, f"fast cases not among the cases: {missing}"
    slow = pytest.mark.slow
    return [c if c in fast else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=slow) for c in cases]
