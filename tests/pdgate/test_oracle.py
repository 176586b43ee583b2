"""The oracle in the default run (bounded: ``ORACLE_EXAMPLES`` scenarios, 25 by default) and its soak
(``pytest -m slow``: at least 10,000 requests, fds and RSS back to their baseline). See ``oracle.py``.

``PDGATE_MUTATION`` switches one mechanism off for the mutation check (``tests/pdgate/mutations.py``; all of
them: ``scripts/oracle_mutations.sh``): the oracle must then fail, naming the invariant and the seed (the first
failing scenario is reported as drawn, not shrunk).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from tests.pdgate import mutations
from tests.pdgate.oracle import SHAPES, Cluster, Scenario, run, scenarios
from tests.procs import Procs

EXAMPLES = int(os.environ.get("ORACLE_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    procs = Procs()
    try:
        cl = Cluster(procs)
        cl.start()
        yield cl
    finally:
        procs.close()


@pytest.mark.timeout(600)
def test_the_promise_holds_in_generated_scenarios(cluster: Cluster) -> None:
    mutation = os.environ.get("PDGATE_MUTATION", "")
    undo = mutations.apply(mutation)
    try:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                  phases=[Phase.explicit, Phase.generate] if mutation else list(Phase),
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(sc=scenarios())
        def holds(sc: Scenario) -> None:
            problems = asyncio.run(run(cluster, sc))
            assert not problems, "the promise broke:\n  " + "\n  ".join(problems) + f"\nscenario: {sc}"

        for shape in SHAPES:  # the shapes each mechanism needs, every run, before the drawn ones
            holds = example(sc=shape)(holds)
        holds()
    finally:
        undo()


@pytest.fixture(scope="module")
def mixed() -> Iterator[Cluster]:
    procs = Procs()
    try:
        cl = Cluster(procs, mixed=True)
        cl.start()
        yield cl
    finally:
        procs.close()


@pytest.mark.timeout(600)
def test_the_promise_holds_on_a_mixed_cluster(mixed: Cluster) -> None:
    """An SGLang pair and a vLLM pair behind one gateway (issue 29): the same generated scenarios and shapes, every
    request judged as before, whichever kind served it."""

    @settings(max_examples=int(os.environ.get("ORACLE_MIXED_EXAMPLES", "12")), deadline=None, database=None,
              print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(sc=scenarios())
    def holds(sc: Scenario) -> None:
        problems = asyncio.run(run(mixed, sc))
        assert not problems, "the promise broke:\n  " + "\n  ".join(problems) + f"\nscenario: {sc}"

    for shape in SHAPES:
        holds = example(sc=shape)(holds)
    holds()
