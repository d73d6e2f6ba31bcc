"""The tools built on the library: the ``kvhal`` command and what its subcommands run.

``cli`` (the command; ``python -m kvhal``), ``bench``, ``bench_lifecycle``, ``bench_streaming``, ``stress``,
``plan``, ``fidelity`` with ``fidelity_model`` (``kvhal eval``), ``tiers_bench`` and ``tiers_server`` (a local
redis-server for the tier benchmark and tests). They use kvhal's public API; ``import kvhal`` imports none of them.
"""
